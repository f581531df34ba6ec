"""The dspark.cpu library (plugins/cpu_ops): its build and cache, and dspark.cpu::MarkovDraftGreedy, the C++
greedy slots of dspark::MarkovDraft (`cpu_greedy`), against the numpy reference, bit for bit across its two
paths and batch mates, inside the op's ONNX function, and the rewrite of built graphs. MatMulW4A8 has its own
file (test_matmul_w4a8.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from plugin_cases import markov_feeds, run_ort

from dspark_export.errors import ConfigError, EngineDirError
from dspark_export.plugins import cpu_ops
from dspark_export.plugins.graph import make_op_model
from dspark_export.plugins.markov_draft import onnx_function as markov_fn
from dspark_export.plugins.markov_draft.reference import run
from dspark_export.plugins.markov_draft.schema import MarkovDraftConfig

F32, I64 = np.float32, np.int64


def _greedy_inputs(seed: int, requests=5, gamma=5, vocab=300, vd=83, rank=32, ties=False):
    """Inputs of the kernel with a draft vocabulary of `vd` rows (not a multiple of 16: the tail block)."""
    rng = np.random.default_rng(seed)
    u = rng.normal(0, 2, (requests, gamma, vd)).astype(F32)
    w1 = rng.normal(size=(vocab, rank)).astype(F32)
    w2 = rng.normal(size=(vd, rank)).astype(F32) * 0.2
    if ties:   # exact ties: logits on a grid and no bias, so the argmax must take the first index
        u, w2 = np.round(u).astype(F32), np.zeros_like(w2)
    d2t = np.sort(rng.choice(vocab, vd, replace=False)).astype(I64)
    return u, rng.integers(0, vocab, requests).astype(I64), w1, w2, d2t


@pytest.mark.parametrize("ties", [False, True])
def test_greedy_kernel_matches_the_reference(ties):
    """draft ids exactly and logits to float rounding, with and without d2t (the reference's greedy path)."""
    from dspark_export.plugins.common.sampling import SamplingBatch
    from dspark_export.plugins.markov_draft.reference import MarkovDraftWeights, markov_draft

    for seed in range(3):
        u, anchor, w1, w2, d2t = _greedy_inputs(seed, ties=ties)
        r, g, _ = u.shape
        greedy = SamplingBatch(np.zeros(r, F32), np.zeros(r, I64), np.ones(r, F32))
        hidden, uniforms, temps = np.zeros((r, g, 4), F32), np.zeros((r, g), F32), np.ones(g, F32)
        for table in (d2t, None):
            vocab_w1 = w1 if table is not None else w1[: u.shape[2]]
            ids, logits = cpu_ops.markov_draft_greedy(u, anchor % vocab_w1.shape[0], vocab_w1, w2, table)
            ref = markov_draft(u, hidden, anchor % vocab_w1.shape[0], greedy, uniforms, temps,
                               MarkovDraftWeights(vocab_w1, w2, d2t=table))
            np.testing.assert_array_equal(ids, ref.draft_ids)
            np.testing.assert_allclose(logits, ref.draft_logits, rtol=1e-5, atol=1e-5)


def test_portable_and_vectorized_paths_agree_bitwise():
    for seed, ties in ((0, False), (1, True), (2, False)):
        u, anchor, w1, w2, d2t = _greedy_inputs(seed, vocab=9000, vd=8192 if seed == 2 else 83, ties=ties)
        fast = cpu_ops.markov_draft_greedy(u, anchor, w1, w2, d2t)
        slow = cpu_ops.markov_draft_greedy(u, anchor, w1, w2, d2t, portable=True)
        np.testing.assert_array_equal(fast[0], slow[0])
        np.testing.assert_array_equal(fast[1], slow[1])


def test_a_request_drafts_the_same_alone_and_in_a_batch():
    u, anchor, w1, w2, d2t = _greedy_inputs(3, requests=6)
    ids, logits = cpu_ops.markov_draft_greedy(u, anchor, w1, w2, d2t)
    for r in range(6):
        one = cpu_ops.markov_draft_greedy(u[r:r + 1], anchor[r:r + 1], w1, w2, d2t)
        np.testing.assert_array_equal(one[0][0], ids[r])
        np.testing.assert_array_equal(one[1][0], logits[r])


def test_bad_input_is_named():
    u, anchor, w1, w2, d2t = _greedy_inputs(4)
    with pytest.raises(ConfigError, match=r"outside \[0, V=300\)"):
        cpu_ops.markov_draft_greedy(u, np.full_like(anchor, 300), w1, w2, d2t)
    with pytest.raises(ConfigError, match=r"markov_w2 \[Vd, r\]"):
        cpu_ops.markov_draft_greedy(u, anchor, w1, w2[:, :5], d2t)


# -- inside the ONNX function -------------------------------------------------------------------------------

CONFIGS = {"markov_conf": dict(has_markov=True, has_confidence=True), "markov": dict(has_markov=True,
                                                                                     has_confidence=False)}


@pytest.mark.parametrize("case", ["greedy", "mixed"])
@pytest.mark.parametrize("config_tag", CONFIGS)
@pytest.mark.parametrize("gamma,vocab", [(4, 50), (7, 37)])
def test_cpu_greedy_function_matches_the_reference(gamma, vocab, config_tag, case):
    """With `cpu_greedy` the all-greedy batch runs the C++ slots, a mixed batch the unchanged sampling branch;
    both agree with the reference (greedy: logits to rounding; mixed: as the plain function)."""
    config = dict(block_size=gamma, cpu_greedy=True, **CONFIGS[config_tag])
    for seed in range(3):
        feeds = markov_feeds(np.random.default_rng(seed), case, config, num_requests=6, vocab=vocab)
        expected, actual = run(feeds), run_ort("MarkovDraft", config, feeds)
        np.testing.assert_array_equal(actual["draft_ids"], expected["draft_ids"])
        np.testing.assert_allclose(actual["draft_logits"], expected["draft_logits"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(actual["confidence"], expected["confidence"], rtol=1e-5, atol=1e-6)
        if case == "mixed":   # the sampling branch is the plain function's, bit for bit
            plain = run_ort("MarkovDraft", dict(config, cpu_greedy=False), feeds)
            for name in plain:
                np.testing.assert_array_equal(actual[name], plain[name])


def test_cpu_greedy_with_a_draft_vocabulary_on_onnx_runtime():
    config = dict(block_size=5, has_markov=True, has_confidence=True, has_d2t=True, cpu_greedy=True)
    rng = np.random.default_rng(7)
    feeds = markov_feeds(rng, "greedy", config, num_requests=4, vocab=60)
    d2t = np.sort(rng.choice(60, 21, replace=False)).astype(I64)
    feeds = dict(feeds, base_logits=np.ascontiguousarray(feeds["base_logits"][..., d2t]),
                 markov_w2=np.ascontiguousarray(feeds["markov_w2"][d2t]), d2t=d2t)
    expected, actual = run(feeds), run_ort("MarkovDraft", config, feeds)
    np.testing.assert_array_equal(actual["draft_ids"], expected["draft_ids"])
    assert np.isin(actual["draft_ids"], d2t).all()
    np.testing.assert_allclose(actual["draft_logits"], expected["draft_logits"], rtol=1e-5, atol=1e-5)


def test_cpu_greedy_needs_the_markov_head():
    from dspark_export.errors import PluginError

    with pytest.raises(PluginError, match="cpu_greedy.*has_markov=False"):
        MarkovDraftConfig(block_size=4, has_markov=False, has_confidence=True, cpu_greedy=True)


def test_rewrite_switches_markov_nodes_only_and_once():
    """`use_cpu_greedy` gives a built graph's MarkovDraft the cpu_greedy body (overload tag `_cpu`, the
    dspark.cpu import) and is idempotent; a node without a Markov head is left as it is."""
    model = make_op_model("MarkovDraft", dict(block_size=4, has_markov=True, has_confidence=True))
    assert not cpu_ops.graph_uses_cpu_ops(model)
    assert markov_fn.use_cpu_greedy(model) == 1
    [node] = model.graph.node
    assert node.overload == "g4_markov_conf_cpu"
    assert [(f.name, f.overload) for f in model.functions] == [("MarkovDraft", "g4_markov_conf_cpu")]
    assert cpu_ops.graph_uses_cpu_ops(model)
    assert markov_fn.use_cpu_greedy(model) == 0
    onnx.checker.check_model(model, full_check=True)
    plain = make_op_model("MarkovDraft", dict(block_size=4, has_markov=False, has_confidence=True))
    assert markov_fn.use_cpu_greedy(plain) == 0 and not cpu_ops.graph_uses_cpu_ops(plain)


def test_overload_tags_round_trip():
    for fields in ({}, {"has_d2t": True}, {"cpu_greedy": True}, {"has_d2t": True, "cpu_greedy": True}):
        config = MarkovDraftConfig(block_size=6, has_markov=True, has_confidence=False, **fields)
        assert dataclasses.asdict(markov_fn._config_from_overload(config.overload)) == dataclasses.asdict(config)
    assert markov_fn._config_from_overload("g4_markov_unknown") is None


# -- RaggedAttention -----------------------------------------------------------------------------------------

def _attention_inputs(seed, q_lens=(1, 6, 3), lens=(100, 0, 37), heads=9, kv_heads=3, d=64, capacity=256):
    rng = np.random.default_rng(seed)
    qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(I64)
    n = int(qs[-1])
    q = rng.normal(size=(n, heads * d)).astype(F32) * 2
    k, v = (rng.normal(size=(n, kv_heads * d)).astype(F32) for _ in range(2))
    pk, pv = (rng.normal(size=(len(q_lens), kv_heads, capacity, d)).astype(F32) for _ in range(2))
    return q, k, v, pk, pv, qs, np.asarray(lens, I64)


def _attention_reference(q, k, v, pk, pv, qs, lens, scale, causal=True):
    """softmax(scale · q·K) V in float64, keys = the cache's live entries then this pass's rows up to the row
    (every row of the request without `causal`)."""
    r_count, kvh, _, d = pk.shape
    group = q.shape[1] // d // kvh
    out = np.zeros(q.shape, np.float64)
    for r in range(r_count):
        rows = slice(qs[r], qs[r + 1])
        for j in range(qs[r + 1] - qs[r]):
            for h in range(q.shape[1] // d):
                g = h // group
                seen = j + 1 if causal else qs[r + 1] - qs[r]
                keys = np.concatenate([pk[r, g, :lens[r]], k[rows][:seen].reshape(-1, kvh, d)[:, g]])
                vals = np.concatenate([pv[r, g, :lens[r]], v[rows][:seen].reshape(-1, kvh, d)[:, g]])
                s = keys.astype(np.float64) @ q[qs[r] + j, h * d:(h + 1) * d] * scale
                e = np.exp(s - s.max())
                out[qs[r] + j, h * d:(h + 1) * d] = e @ vals / e.sum()
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_ragged_attention_matches_the_reference_on_both_paths(causal):
    """Causal (the target) and bidirectional (the drafter block: every row sees its whole block)."""
    for seed in range(2):
        inputs = _attention_inputs(seed)
        fast = cpu_ops.ragged_attention(*inputs, 0.125, causal)
        np.testing.assert_allclose(fast, _attention_reference(*inputs, 0.125, causal), rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(cpu_ops.ragged_attention(*inputs, 0.125, causal, portable=True), fast)


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 2, 32), (4, 4, 48), (16, 2, 128), (6, 1, 80)])
def test_ragged_attention_head_layouts_on_both_paths(heads, kv_heads, d):
    """Head sizes other than 64 (column blocks of 1-3 vectors, queries not held in registers) and query groups of
    1-8 heads (value rows shared by up to 4 row-heads at once), over requests with fewer and more than 16 keys."""
    inputs = _attention_inputs(5, q_lens=(1, 7, 2, 20), lens=(3, 45, 0, 17), heads=heads, kv_heads=kv_heads, d=d,
                               capacity=64)
    fast = cpu_ops.ragged_attention(*inputs, 0.1)
    np.testing.assert_allclose(fast, _attention_reference(*inputs, 0.1), rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(cpu_ops.ragged_attention(*inputs, 0.1, portable=True), fast)


def test_ragged_attention_rows_equal_decode_rows_and_ignore_batch_mates():
    """Row j of a request's block equals, bit for bit, the one-row pass over a cache that holds the block's first j
    keys (a decode step after those tokens committed), at another capacity and without the batch mates."""
    q, k, v, pk, pv, qs, lens = _attention_inputs(3, q_lens=(5, 2), lens=(40, 7), capacity=128)
    block = cpu_ops.ragged_attention(q, k, v, pk, pv, qs, lens, 0.125)
    kvh, d = pk.shape[1], pk.shape[3]
    for j in range(5):
        cache_k = np.zeros((1, kvh, 256, d), F32)
        cache_v = np.zeros_like(cache_k)
        cache_k[0, :, :40], cache_v[0, :, :40] = pk[0, :, :40], pv[0, :, :40]
        cache_k[0, :, 40:40 + j] = k[:j].reshape(j, kvh, d).transpose(1, 0, 2)
        cache_v[0, :, 40:40 + j] = v[:j].reshape(j, kvh, d).transpose(1, 0, 2)
        one = cpu_ops.ragged_attention(q[j:j + 1], k[j:j + 1], v[j:j + 1], cache_k, cache_v, np.array([0, 1], I64),
                                       np.array([40 + j], I64), 0.125)
        np.testing.assert_array_equal(one[0], block[j])


def test_ragged_attention_in_onnx_runtime_names_bad_input():
    from onnx import TensorProto, helper
    import onnxruntime as ort

    node = helper.make_node("RaggedAttention", ["q", "k", "v", "pk", "pv", "qs", "lens"], ["y"],
                            domain=cpu_ops.DOMAIN, scale=0.125)
    f = lambda name, elem: helper.make_tensor_value_info(name, elem, None)  # noqa: E731
    graph = helper.make_graph([node], "g", [f(n, TensorProto.FLOAT) for n in ("q", "k", "v", "pk", "pv")]
                              + [f("qs", TensorProto.INT64), f("lens", TensorProto.INT64)], [f("y", TensorProto.FLOAT)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(cpu_ops.DOMAIN, 1)])
    so = ort.SessionOptions()
    cpu_ops.register(so)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    q, k, v, pk, pv, qs, lens = _attention_inputs(4)
    feed = dict(q=q[None], k=k[None], v=v[None], pk=pk, pv=pv, qs=qs, lens=lens)
    [y] = sess.run(None, feed)
    np.testing.assert_array_equal(y[0], cpu_ops.ragged_attention(q, k, v, pk, pv, qs, lens, 0.125))
    with pytest.raises(Exception, match=r"cache_lens.*request 0 has 300 entries, outside \[0, P=256\]"):
        sess.run(None, dict(feed, lens=np.array([300, 0, 37], I64)))
    with pytest.raises(Exception, match=r"query_start.*0 \.\. N = 10"):
        sess.run(None, dict(feed, qs=np.array([0, 1, 7, 9], I64)))


# -- the library ----------------------------------------------------------------------------------------------

def test_library_is_cached_by_source_hash(tmp_path, monkeypatch):
    """Compiled once into the cache directory (atomically: no partial library is ever left under its name)."""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    cpu_ops.library_path.cache_clear()
    try:
        path = cpu_ops.library_path()
        assert path.parent == tmp_path / "ops" and path.exists()
        assert [p.name for p in (tmp_path / "ops").iterdir()] == [path.name]
    finally:
        cpu_ops.library_path.cache_clear()


def test_missing_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_ops.library_path.cache_clear()
    try:
        with pytest.raises(EngineDirError, match=r"no-such-compiler.*--int4-kernel matmulnbits "
                                                 r"--attention-kernel onnx --markov-draft-kernel onnx"):
            cpu_ops.library_path()
        assert not list((tmp_path / "ops").glob("*.so"))
    finally:
        cpu_ops.library_path.cache_clear()


def test_unwritable_cache_falls_back_to_the_temp_directory(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(blocker))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cpu_ops.library_path.cache_clear()
    try:
        path = cpu_ops.library_path()
        assert path.exists() and path.is_relative_to(tmp_path / "tmp")
    finally:
        cpu_ops.library_path.cache_clear()
