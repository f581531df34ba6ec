"""Draft vocabulary (d2t) and quantized drafter layers: the ranking, the scattered head, bad input, and that
verification stays lossless with q = 0 outside d2t."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from dspark_export.errors import ConfigError, EngineRunError
from dspark_export.exporter.drafter import (OUTSIDE_DRAFT_VOCAB, build_drafter_graphs, check_d2t,
                                            draft_vocab_index, quantize_drafter_layers)
from dspark_export.plugins.common.sampling import sample_from_probs, warp_probs
from dspark_export.plugins.markov_draft.schema import scatter_draft_logits
from dspark_export.plugins.speculative_verify.reference import run as verify_reference
from dspark_export.training.draft_vocab import (count_response_tokens, load_draft_vocab_source, ranking_from_counts,
                                                ranking_object, read_ranking, select_d2t, write_ranking)

from test_export_drafter import GAMMA, _drafter

F32, I64 = np.float32, np.int64


# -- the ranking -------------------------------------------------------------------------------------------

def test_ranking_puts_eos_first_then_counts_then_ids():
    counts = np.array([0, 5, 0, 9, 5, 1, 0, 0])
    assert ranking_from_counts(counts, eos_token_ids=[2]).tolist() == [2, 3, 1, 4, 5, 0, 6, 7]
    # d2t: the top of the ranking completed by unseen ids, sorted by id
    assert select_d2t(np.array([2, 3, 1]), 2, 8).tolist() == [2, 3]
    assert select_d2t(np.array([2, 3, 1]), 5, 8).tolist() == [0, 1, 2, 3, 4]


def test_ranking_counts_response_tokens_only(tmp_path):
    records = [{"dataset": "d", "row": 0, "prompt_ids": [7, 7, 7], "response_ids": [1, 1, 4, 2]},
               {"dataset": "d", "row": 1, "prompt_ids": [7], "response_ids": [4, 4, 2]}]
    assert count_response_tokens(records, 8).tolist() == [0, 2, 2, 0, 3, 0, 0, 0]
    path = tmp_path / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = load_draft_vocab_source(path, 8, eos_token_ids=[2])
    assert data["ranking"].tolist() == [2, 4, 1]  # token 7 appears in prompts only
    back = read_ranking(write_ranking(tmp_path / "draft_vocab.json", ranking_object(
        count_response_tokens(records, 8), [2], "test", 2)), 8)
    assert back["ranking"].tolist() == [2, 4, 1] and back["counts"] == [2, 3, 2]


@pytest.mark.parametrize("content, pattern", [
    ({"vocab_size": 8, "ranking": [1, 9]}, r"ranking: token ids must be in \[0, 8\)"),
    ({"vocab_size": 8, "ranking": [1, 1]}, "distinct"),
    ({"vocab_size": 16, "ranking": [1]}, "vocab_size: expected the drafter's 8, found 16"),
    ({"vocab_size": 8}, "'ranking' list"),
])
def test_bad_ranking_files_are_named(tmp_path, content, pattern):
    path = tmp_path / "draft_vocab.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=pattern):
        read_ranking(path, 8)


def test_bad_responses_and_sizes_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_draft_vocab_source(tmp_path / "missing.jsonl", 8, [2])
    with pytest.raises(ConfigError, match="outside"):
        count_response_tokens([{"dataset": "d", "row": 3, "response_ids": [8]}], 8)
    for size in (0, -1, 9):
        with pytest.raises(ConfigError, match=r"1 <= N <= vocab_size = 8"):
            select_d2t(np.array([1]), size, 8)


@pytest.mark.parametrize("d2t, pattern", [
    (np.arange(300), r"1 <= N <= vocab_size = 256 ids, found N = 300"),
    (np.zeros(0, I64), "found N = 0"),
    (np.array([3, 256]), r"d2t\[1\] = 256"),
    (np.array([-1, 3]), r"d2t\[0\] = -1"),
    (np.array([3, 3]), "3 repeats"),
    (np.array([1.0, 2.0]), "integer token ids"),
])
def test_bad_d2t_is_named(d2t, pattern):
    with pytest.raises(ConfigError, match=pattern):
        check_d2t(d2t, 256)


def test_bad_d2t_fails_the_export(tiny_llama):
    drafter = _drafter(tiny_llama)
    rope = (drafter.inv_freq.numpy(), float(drafter.attention_scaling))
    with pytest.raises(ConfigError, match=r"d2t\[0\] = 999"):
        build_drafter_graphs(drafter, rope, d2t=np.array([999]))
    with pytest.raises(ConfigError, match="drafter layer weights"):
        build_drafter_graphs(drafter, rope, layer_weights="int3")


# -- the graphs --------------------------------------------------------------------------------------------

def _block_feed(spec, sessions, temperature, seed=0):
    s_ctx = sessions
    rng = np.random.default_rng(seed)
    lens = np.array([6, 3, 9])
    R, P = len(lens), 10
    feed = {"anchor_ids": np.array([7, 100, 3]), "start_positions": lens, "context_lens": lens,
            "temperature": np.full(R, temperature, F32), "top_k": np.zeros(R, I64), "top_p": np.ones(R, F32),
            "uniforms": rng.random((R, GAMMA), dtype=F32), "confidence_temperature": np.ones(GAMMA, F32)}
    aux = rng.standard_normal((P, spec.feature_size)).astype(F32)
    ctx = s_ctx.run(None, {"aux_hidden": aux, "position_ids": np.arange(P)})
    for i in range(spec.num_layers):
        for j, name in enumerate(("context_key", "context_value")):
            kv = ctx[2 * i + j].transpose(1, 0, 2)[None]  # [1, kvH, P, D]
            feed[f"{name}.{i}"] = np.ascontiguousarray(np.repeat(kv, R, axis=0))
    return feed


def _sessions(drafter, **kw):
    rope = (drafter.inv_freq.numpy(), float(drafter.attention_scaling))
    ctx, block, spec = build_drafter_graphs(drafter, rope, **kw)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    mk = lambda m: ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])  # noqa: E731
    return mk(ctx), mk(block), spec, block


def _run(sess, feed):
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))


@pytest.mark.parametrize("lm_head_dtype", ["float32", "int8"])
def test_permuted_full_d2t_gives_the_full_head(tiny_llama, lm_head_dtype):
    """Scatter correctness: d2t = every token in a shuffled order reproduces the full-vocabulary block."""
    drafter = _drafter(tiny_llama)
    vocab = drafter.config.vocab_size
    perm = np.random.default_rng(3).permutation(vocab)
    s_ctx, s_full, spec, _ = _sessions(drafter, lm_head_dtype=lm_head_dtype)
    _, s_d2t, spec_d2t, _ = _sessions(drafter, lm_head_dtype=lm_head_dtype, d2t=perm)
    assert spec_d2t.draft_vocab_size == vocab and spec.draft_vocab_size == 0
    for temperature in (0.0, 1.0):
        feed = _block_feed(spec, s_ctx, temperature)
        full, sub = _run(s_full, feed), _run(s_d2t, feed)
        np.testing.assert_allclose(sub["draft_logits"], full["draft_logits"], atol=1e-4)
        np.testing.assert_array_equal(sub["draft_ids"], full["draft_ids"])


@pytest.mark.parametrize("layer_weights", ["float32", "int8", "int4", "w8a8"])
def test_d2t_block_drafts_inside_the_draft_vocabulary(tiny_llama, layer_weights):
    drafter = _drafter(tiny_llama)
    vocab = drafter.config.vocab_size
    d2t = np.sort(np.random.default_rng(4).choice(vocab, 40, replace=False))
    s_ctx, s_block, spec, block = _sessions(drafter, lm_head_dtype="int8", d2t=d2t, layer_weights=layer_weights)
    s_full_ctx, s_full, _, _ = _sessions(drafter, lm_head_dtype="int8")
    ops = {n.op_type for n in block.graph.node}
    assert ("MatMulNBits" in ops) == (layer_weights in ("int8", "int4"))
    assert ("MatMulIntegerToFloat" in ops) == (layer_weights == "w8a8")
    weights = {t.name for t in block.graph.initializer}
    float_linears = [n.name for n in block.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    assert bool(float_linears) == (layer_weights == "float32"), float_linears
    assert spec.layer_weights == layer_weights and spec.draft_vocab_size == 40
    outside = np.setdiff1d(np.arange(vocab), d2t)
    for temperature in (0.0, 1.0):
        feed = _block_feed(spec, s_ctx, temperature)
        out = _run(s_block, feed)
        assert np.isin(out["draft_ids"], d2t).all()
        assert out["draft_logits"].shape == (feed["anchor_ids"].shape[0], GAMMA, 40)   # over d2t
        assert np.isfinite(out["draft_logits"]).all()  # the runtime's drafter check still passes
        logits = scatter_draft_logits(out["draft_logits"], d2t, vocab)   # the verify op's q, as the runtime feeds it
        n = logits.shape[0] * GAMMA
        q = warp_probs(logits.reshape(n, vocab), np.ones(n, F32), np.zeros(n, I64), np.ones(n, F32))
        assert (q[:, outside] == 0).all()  # q is exactly 0 outside d2t
        if temperature == 0:
            np.testing.assert_array_equal(out["draft_ids"], d2t[logits[..., d2t].argmax(-1)])
        if layer_weights == "float32":  # the d2t columns are the full head's base logits (slot 0: anchor bias only)
            full = _run(s_full, _block_feed(spec, s_full_ctx, temperature))
            np.testing.assert_allclose(logits[:, 0, d2t], full["draft_logits"][:, 0, d2t], atol=1e-4)


def _scatter_first(block: onnx.ModelProto, block_size: int) -> onnx.ModelProto:
    """The block graph with MarkovDraft over the full vocabulary again: base logits scattered to V before the op
    and its logits gathered back at d2t (the form every backend had before the op took d2t; here by the TensorRT
    lowering's own expansion)."""
    from dspark_export.engines.trt.lowering import expand_draft_vocab
    from dspark_export.plugins.markov_draft.onnx_function import make_function

    out = onnx.ModelProto()
    out.CopyFrom(block)
    assert expand_draft_vocab(out.graph) == ["/drafter_block/markov_draft/MarkovDraft"]
    out.functions.append(make_function(block_size=block_size, has_markov=True, has_confidence=True))
    return out


@pytest.mark.parametrize("lm_head_dtype", ["float32", "int8"])
def test_markov_draft_runs_over_the_draft_vocabulary(tiny_llama, lm_head_dtype):
    """With a Markov head, MarkovDraft takes the N-row logits and W2[d2t] (no scatter before it, no [V, r] table in
    the graph) and gives what scattering to V first gave: same drafts (greedy and sampled with the same
    uniforms), the same logits at d2t (returned over d2t), same confidence."""
    drafter = _drafter(tiny_llama)
    vocab, rank = drafter.config.vocab_size, drafter.config.markov_rank
    d2t = np.random.default_rng(6).choice(vocab, 40, replace=False)  # unsorted: the exporter sorts it
    s_ctx, s_block, spec, block = _sessions(drafter, lm_head_dtype=lm_head_dtype, d2t=d2t)
    (node,) = [n for n in block.graph.node if n.op_type == "MarkovDraft"]
    assert node.overload.endswith("_d2t") and len(node.input) == 13
    inits = {t.name: t for t in block.graph.initializer}
    assert list(inits[node.input[9]].dims) == [40, rank] and list(inits[node.input[12]].dims) == [40]
    assert onnx.numpy_helper.to_array(inits[node.input[12]]).tolist() == sorted(d2t.tolist())
    assert not any(n.op_type == "ScatterElements" for n in block.graph.node)
    assert not any(list(t.dims) == [vocab, rank] and "markov_w2" in t.name for t in block.graph.initializer)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s_old = ort.InferenceSession(_scatter_first(block, GAMMA).SerializeToString(), so,
                                 providers=["CPUExecutionProvider"])
    for temperature in (0.0, 1.0, 0.7):
        feed = _block_feed(spec, s_ctx, temperature, seed=3)
        new, old = _run(s_block, feed), _run(s_old, feed)
        np.testing.assert_array_equal(new["draft_ids"], old["draft_ids"])
        assert new["draft_logits"].shape == old["draft_logits"].shape == (feed["anchor_ids"].shape[0], GAMMA, 40)
        np.testing.assert_allclose(new["draft_logits"], old["draft_logits"], rtol=1e-6, atol=1e-5)
        np.testing.assert_allclose(new["confidence"], old["confidence"], rtol=1e-6)


def test_drafter_without_markov_head_scatters_before_the_op(tiny_llama):
    """No Markov head: no W1 to carry V, so the logits are scattered to V before MarkovDraft as before, and the
    block's draft_logits are gathered back at d2t (the same [R, γ, N] contract as with a Markov head)."""
    drafter = _drafter(tiny_llama, markov_rank=0, with_markov=False)
    d2t = np.sort(np.random.default_rng(7).choice(drafter.config.vocab_size, 40, replace=False))
    s_ctx, s_block, spec, block = _sessions(drafter, lm_head_dtype="int8", d2t=d2t)
    (node,) = [n for n in block.graph.node if n.op_type == "MarkovDraft"]
    assert "d2t" not in node.overload and any(n.op_type == "ScatterElements" for n in block.graph.node)
    out = _run(s_block, _block_feed(spec, s_ctx, 1.0))
    assert np.isin(out["draft_ids"], d2t).all()
    assert out["draft_logits"].shape[1:] == (GAMMA, 40) and np.isfinite(out["draft_logits"]).all()


def test_quantized_drafter_layers_are_batch_invariant(tiny_llama):
    """A request's drafts and logits do not depend on its batch mates (MatMulNBits, accuracy_level 4)."""
    drafter = _drafter(tiny_llama)
    s_ctx, s_block, spec, _ = _sessions(drafter, lm_head_dtype="int8", layer_weights="int4")
    feed = _block_feed(spec, s_ctx, 0.0)
    together = _run(s_block, feed)
    for r in range(3):
        alone = _run(s_block, {k: (v[r:r + 1] if v.ndim and v.shape[0] == 3 and k != "confidence_temperature" else v)
                               for k, v in feed.items()})
        np.testing.assert_array_equal(alone["draft_ids"][0], together["draft_ids"][r])
        np.testing.assert_allclose(alone["draft_logits"][0], together["draft_logits"][r], rtol=0, atol=1e-4)


def test_quantize_drafter_layers_keeps_the_head_and_functions(tiny_llama):
    drafter = _drafter(tiny_llama)
    rope = (drafter.inv_freq.numpy(), float(drafter.attention_scaling))
    _, block, _ = build_drafter_graphs(drafter, rope, lm_head_dtype="float32")
    n_matmul = sum(n.op_type == "MatMul" and any(i in {t.name for t in block.graph.initializer} for i in n.input)
                   for n in block.graph.node)
    q = quantize_drafter_layers(block, "int4")
    assert sum(n.op_type == "MatMulNBits" for n in q.graph.node) == n_matmul  # q/k/v/o, gate/up/down per layer
    assert any(n.op_type == "Gemm" for n in q.graph.node)  # the LM head is not MatMulNBits
    assert [f.name for f in q.functions] == [f.name for f in block.functions]
    with pytest.raises(ConfigError, match="int3"):
        quantize_drafter_layers(block, "int3")


# -- losslessness with q = 0 outside d2t -------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_verification_keeps_the_target_distribution_with_a_draft_vocabulary(temperature):
    """Drafts from q restricted to d2t (fill outside) and SpeculativeVerify: the first emitted token is
    distributed as p, including tokens q can never propose (TV < 0.02 at 40k trials)."""
    rng = np.random.default_rng(21)
    trials, vocab = 40_000, 8
    d2t = np.array([0, 2, 3, 6])
    t2d = draft_vocab_index(d2t, vocab)
    target_row, bonus_row = (rng.normal(0, 1.5, (1, vocab)).astype(F32) for _ in range(2))
    target_row[0, 5] = target_row.max() + 1.0  # the target's favourite token lies outside d2t
    draft_n = rng.normal(0, 1.5, (1, len(d2t))).astype(F32)
    draft_row = np.concatenate([draft_n, [[OUTSIDE_DRAFT_VOCAB]]], axis=1)[:, t2d].astype(F32)
    params = dict(temperature=np.full(trials, temperature, F32), top_k=np.zeros(trials, I64), top_p=np.ones(trials, F32))
    q = warp_probs(draft_row, *(v[:1] for v in params.values()))
    assert (q[0, np.setdiff1d(np.arange(vocab), d2t)] == 0).all()
    x0 = sample_from_probs(np.broadcast_to(q, (trials, vocab)), rng.random(trials, dtype=F32))
    assert np.isin(x0, d2t).all()
    feeds = dict(target_logits=np.tile(np.concatenate([target_row, bonus_row]), (trials, 1)),
                 query_start=np.arange(0, 2 * trials + 1, 2, dtype=I64), draft_ids=x0[:, None].astype(I64),
                 draft_logits=np.broadcast_to(draft_row, (trials, 1, vocab)).copy(), verify_lens=np.ones(trials, I64),
                 **params, uniforms=rng.random((trials, 2), dtype=F32))
    outputs = verify_reference(feeds)
    first = np.where(outputs["num_accepted"] == 1, x0, outputs["next_ids"])
    frequencies = np.bincount(first, minlength=vocab) / trials
    p = warp_probs(target_row, *(v[:1] for v in params.values()))[0]
    assert 0.5 * np.abs(frequencies - p).sum() < 0.02
    assert frequencies[5] > 0.1  # a token outside d2t is still emitted at its target rate (by the residual)


# -- end to end: spec == ar on engines with a draft vocabulary and quantized drafter layers -------------------

@pytest.mark.parametrize("drafter_weights", ["int4", "w8a8", "float32"])
def test_spec_equals_ar_with_draft_vocab(build_tiny_engine_dir, tmp_path_factory, drafter_weights):
    from dspark_export.engines.manifest import Manifest
    from dspark_export.runtime.api import Runtime
    from dspark_export.runtime.request import SamplingParams

    folder = tmp_path_factory.mktemp("d2t")
    counts = np.random.default_rng(5).integers(0, 50, 256)
    ranking = write_ranking(folder / "draft_vocab.json", ranking_object(counts, [2], "test", 1))
    out = build_tiny_engine_dir(f"d2t-{drafter_weights}", target_buckets=(1, 2, 4, 8, 16), request_buckets=(1, 2),
                                max_context=128, profile_repeats=1, profile_context=16, draft_vocab="64",
                                draft_vocab_from=str(ranking), drafter_weights=drafter_weights)
    manifest = Manifest.load(out)
    d2t = manifest.data["draft_vocab"]["d2t"]
    assert len(d2t) == 64 and 2 in d2t and d2t == select_d2t(ranking_from_counts(counts, [2]), 64, 256).tolist()
    spec = manifest.data["graphs"]["drafter_block"]["spec"]
    assert spec["draft_vocab_size"] == 64 and spec["layer_weights"] == drafter_weights
    prompts = ["hello there", "12+7=", "abcabcabc"]
    outs = {}
    for policy in ("ar", "fixed:3", "dspark"):
        rt = Runtime.open(out, policy=policy)
        outs[policy] = [r.token_ids for r in rt.generate_text(prompts, SamplingParams(max_new_tokens=24))]
        assert all(len(t) > 0 for t in outs[policy])
    assert outs["fixed:3"] == outs["ar"] and outs["dspark"] == outs["ar"]
    # sampled: the block's [S, γ, 64] logits are scattered to V for the verify op (EngineStages.full_draft_logits)
    rt = Runtime.open(out, policy="fixed:3")
    sampled = rt.generate_text(prompts, SamplingParams(max_new_tokens=24, temperature=0.8, seed=1))
    assert all(r.finish_reason in ("length", "stop") and r.token_ids for r in sampled), [r.error for r in sampled]
    stages = rt.generator.stages
    compact = np.random.default_rng(0).standard_normal((2, 3, 64)).astype(F32)
    full = stages.full_draft_logits(compact)
    np.testing.assert_array_equal(full[..., sorted(d2t)], compact)
    assert full.shape == (2, 3, 256) and (np.delete(full, sorted(d2t), axis=2) == np.float32(OUTSIDE_DRAFT_VOCAB)).all()
    assert stages.full_draft_logits(full) is full
    only = stages.full_draft_logits(compact, np.array([1]))   # the sampled slots only; greedy rows stay 0
    np.testing.assert_array_equal(only[1], full[1])
    assert (only[0] == 0).all()
    with pytest.raises(EngineRunError, match="draft_logits 63 wide; expected V = 256 or the manifest's draft_vocab size"):
        stages.full_draft_logits(compact[..., :63])


def test_manifest_draft_vocab_must_match_the_graph(build_tiny_engine_dir, tmp_path_factory):
    from dspark_export.engines.manifest import Manifest
    from dspark_export.errors import EngineDirError

    folder = tmp_path_factory.mktemp("d2t-bad")
    ranking = write_ranking(folder / "draft_vocab.json", ranking_object(np.arange(256), [2], "test", 1))
    out = build_tiny_engine_dir("d2t-manifest", target_buckets=(1, 2, 4, 8), request_buckets=(1,), max_context=64,
                                profile_repeats=1, profile_context=16, draft_vocab="32", draft_vocab_from=str(ranking))
    text = (out / "manifest.json").read_text()
    Manifest.load(out, verify=False)   # as built: the manifest's d2t is the graph's
    data = json.loads(text)
    data["draft_vocab"]["d2t"] = data["draft_vocab"]["d2t"][:-1]
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EngineDirError, match="draft_vocab: expected size and d2t of 32"):
        Manifest.load(out, verify=False)
    # same size, distinct, in range, but not the graph's ids: sampled verification would scatter q wrongly
    data = json.loads(text)
    d2t = data["draft_vocab"]["d2t"]
    data["draft_vocab"]["d2t"] = sorted(d2t[:-2] + [t for t in range(256) if t not in d2t][:2])
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EngineDirError, match=r"draft_vocab.d2t differs from the drafter block graph's "
                                             r"draft_vocab.d2t \(drafter_block.onnx: 4 ids"):
        Manifest.load(out, verify=False)
    (out / "manifest.json").write_text(text)
    graph = out / "graphs" / "drafter_block.onnx"
    graph.write_bytes(b"\x00" * graph.stat().st_size)   # unreadable, same size (verify=False checks sizes only)
    with pytest.raises(EngineDirError, match=r"drafter_block.onnx: cannot read the drafter block graph's draft_vocab"):
        Manifest.load(out, verify=False)


# -- defaults: exact drafting for every drafter but the shipped one ------------------------------------------

def _inputs(path, vocab=49152):
    from types import SimpleNamespace

    config = SimpleNamespace(vocab_size=vocab)
    return SimpleNamespace(drafter_source={"path": path} if path else {"kind": "untrained"},
                           drafter=SimpleNamespace(config=config), eos_token_ids=(2,))


def test_imported_and_untrained_drafters_draft_exactly_by_default(tmp_path):
    from dspark_export.pipeline import BuildConfig, _drafter_choices

    cfg = BuildConfig(out=tmp_path / "x")
    (tmp_path / "imported").mkdir()
    write_ranking(tmp_path / "imported" / "draft_vocab.json", ranking_object(np.arange(256), [2], "t", 1))
    for path in (str(tmp_path / "imported"), None):  # a ranking beside an import is not used unless asked
        assert _drafter_choices(cfg, _inputs(path, 256)) == (None, None, "float32", None)
    d2t, info, weights, window = _drafter_choices(
        BuildConfig(out=tmp_path / "x", draft_vocab="16", drafter_weights="int4", drafter_context="0,8"),
        _inputs(str(tmp_path / "imported"), 256))
    assert len(d2t) == 16 and info["size"] == 16 and weights == "int4" and 2 in d2t
    assert window == {"sink": 0, "recent": 8}
    with pytest.raises(ConfigError, match="--draft-vocab-from"):
        _drafter_choices(BuildConfig(out=tmp_path / "x", draft_vocab="16"), _inputs(None, 256))
    for bad in ("0", "-3", "lots"):
        with pytest.raises(ConfigError, match="draft_vocab: expected 'auto', 'full' or a positive number"):
            BuildConfig(out=tmp_path / "x", draft_vocab=bad)
    with pytest.raises(ConfigError, match="drafter_weights"):
        BuildConfig(out=tmp_path / "x", drafter_weights="int2")
    for bad in ("32", "4,0", "4,-2", "a,b", "4,32,1", "", "\u00b2,3", "\uff14,32", "4,99999999999999999999", "4,4097"):
        with pytest.raises(ConfigError, match=r"drafter_context: expected 'auto', 'full' or SINK,RECENT .*found"):
            BuildConfig(out=tmp_path / "x", drafter_context=bad, max_context=4096)
    assert BuildConfig(out=tmp_path / "x", drafter_context=" 4, 4096", max_context=4096).drafter_context == " 4, 4096"
    with pytest.raises(ConfigError, match=r"1 <= N <= vocab_size = 256"):
        _drafter_choices(BuildConfig(out=tmp_path / "x", draft_vocab="300"), _inputs(str(tmp_path / "imported"), 256))


def test_shipped_drafter_uses_its_committed_choice(tmp_path):
    from dspark_export.modeling.loading import shipped_drafter_path
    from dspark_export.pipeline import SHIPPED_DRAFTER_BUILD, BuildConfig, _drafter_choices

    shipped = shipped_drafter_path("")
    d2t, info, weights, window = _drafter_choices(BuildConfig(out=tmp_path / "x"), _inputs(str(shipped)))
    size = SHIPPED_DRAFTER_BUILD["draft_vocab"]
    assert weights == SHIPPED_DRAFTER_BUILD["drafter_weights"]
    assert f"{window['sink']},{window['recent']}" == SHIPPED_DRAFTER_BUILD["drafter_context"]
    if size == "full":
        assert d2t is None and info is None
    else:
        assert len(d2t) == size == info["size"] and info["source"].endswith("draft_vocab.json")
    small = _drafter_choices(BuildConfig(out=tmp_path / "x", max_context=16, profile_context=8), _inputs(str(shipped)))
    assert small[3] == {"sink": 4, "recent": 16}          # the shipped window within a 16-token context
    choices = _drafter_choices(BuildConfig(out=tmp_path / "x", draft_vocab="full", drafter_weights="float32",
                                           drafter_context="full"), _inputs(str(shipped)))
    assert choices == (None, None, "float32", None)


@pytest.mark.real_model
def test_shipped_block_over_d2t_equals_the_full_vocabulary_form():
    """The shipped drafter (d2t of 8,192, float32 layers, int8 head): MarkovDraft over d2t gives bitwise the
    drafts, logits and confidences of the same block with the op expanded back to the full vocabulary."""
    import torch

    from dspark_export.exporter.drafter import _spec, build_block_graph
    from dspark_export.modeling.loading import load_build_inputs, shipped_drafter_path

    inputs = load_build_inputs(None, None)
    drafter, vocab = inputs.drafter, int(inputs.drafter.config.vocab_size)
    ranking = read_ranking(shipped_drafter_path("") / "draft_vocab.json", vocab)["ranking"]
    d2t = select_d2t(ranking, 8192, vocab)
    embed = inputs.target_model.get_input_embeddings().weight.detach().float().numpy()
    with torch.no_grad():
        block = build_block_graph(drafter, inputs.rope, embed, "int8", d2t, "float32")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s_new, s_old = (ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
                    for m in (block, _scatter_first(block, drafter.config.block_size)))
    spec = _spec(drafter, "int8", 8192, "float32")
    rng = np.random.default_rng(0)
    R, P = 2, 64
    for temperature in (0.0, 0.7):
        feed = {"anchor_ids": rng.integers(0, vocab, R), "start_positions": np.full(R, P), "context_lens": np.full(R, P),
                "temperature": np.full(R, temperature, F32), "top_k": np.zeros(R, I64), "top_p": np.ones(R, F32),
                "uniforms": rng.random((R, spec.block_size), dtype=F32),
                "confidence_temperature": np.ones(spec.block_size, F32)}
        for i in range(spec.num_layers):
            for name in ("context_key", "context_value"):
                feed[f"{name}.{i}"] = rng.standard_normal((R, spec.num_kv_heads, P, spec.head_dim)).astype(F32)
        new, old = _run(s_new, feed), _run(s_old, feed)
        for name in ("draft_ids", "draft_logits", "confidence"):
            np.testing.assert_array_equal(new[name], old[name], err_msg=name)
        assert new["draft_logits"].shape == (R, spec.block_size, 8192)
