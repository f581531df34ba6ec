"""dspark::MarkovDraft: numpy reference (hand cases, errors) and ONNX-function parity on ONNX Runtime."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_export.errors import PluginError
from dspark_export.plugins.common.sampling import SamplingBatch, warp_probs
from dspark_export.plugins.markov_draft.onnx_function import make_node
from dspark_export.plugins.markov_draft.reference import MarkovDraftWeights, markov_draft, run
from dspark_export.plugins.markov_draft.schema import MarkovDraftConfig
from dspark_export.plugins.markov_draft.schema import OUTSIDE_DRAFT_VOCAB, scatter_draft_logits
from plugin_cases import (MARKOV_CONFIGS, SAMPLING_CASES, draft_vocab_feeds, freeze, markov_feeds, run_ort,
                          sampling_feeds)

F32, I64 = np.float32, np.int64
SHAPES = {"g4_v50": (4, 50), "g7_v37": (7, 37)}


@pytest.mark.parametrize("case", [*SAMPLING_CASES, "ties"])
@pytest.mark.parametrize("config_tag", MARKOV_CONFIGS)
@pytest.mark.parametrize("shape_tag", SHAPES)
def test_onnx_matches_reference(shape_tag, config_tag, case):
    gamma, vocab = SHAPES[shape_tag]
    config = dict(block_size=gamma, **MARKOV_CONFIGS[config_tag])
    has_ties = case == "ties"
    for seed in range(3):
        rng = np.random.default_rng(seed)
        feeds = markov_feeds(rng, "mixed" if has_ties else case, config, num_requests=6, vocab=vocab, has_ties=has_ties)
        expected, actual = run(feeds), run_ort("MarkovDraft", config, feeds)
        np.testing.assert_array_equal(actual["draft_ids"], expected["draft_ids"])
        np.testing.assert_allclose(actual["draft_logits"], expected["draft_logits"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(actual["confidence"], expected["confidence"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [*SAMPLING_CASES, "ties"])
@pytest.mark.parametrize("has_confidence", [True, False])
def test_draft_vocabulary_equals_scatter_then_full_vocabulary(case, has_confidence):
    """With d2t (ascending), the op over Vd rows gives what scattering the logits to V first gave: the same
    drafts under greedy and under sampling with the same uniforms, draft_logits over the Vd rows that
    `scatter_draft_logits` turns into the old ones (the same logits at d2t, the fill elsewhere), the same
    confidence; on the reference and on ONNX Runtime."""
    config = dict(block_size=4, has_markov=True, has_confidence=has_confidence)
    has_ties = case == "ties"
    for seed in range(3):
        rng = np.random.default_rng(100 + seed)
        feeds = markov_feeds(rng, "mixed" if has_ties else case, config, num_requests=6, vocab=37, has_ties=has_ties)
        d2t = np.sort(rng.choice(37, 12, replace=False))
        scattered, draft = draft_vocab_feeds(feeds, d2t)
        old = run(scattered)
        outside = np.setdiff1d(np.arange(37), d2t)
        assert (old["draft_logits"][..., outside] == np.float32(OUTSIDE_DRAFT_VOCAB)).all()  # fill + bias = fill
        for new in (run(draft), run_ort("MarkovDraft", dict(config, has_d2t=True), draft)):
            np.testing.assert_array_equal(new["draft_ids"], old["draft_ids"])
            assert np.isin(new["draft_ids"], d2t).all()
            assert new["draft_logits"].shape == (6, 4, len(d2t))
            full = scatter_draft_logits(new["draft_logits"], d2t, 37)
            np.testing.assert_allclose(full, old["draft_logits"], rtol=1e-6, atol=1e-6)
            assert (full[..., outside] == np.float32(OUTSIDE_DRAFT_VOCAB)).all()
            np.testing.assert_allclose(new["confidence"], old["confidence"], rtol=1e-6, atol=1e-7)


def test_draft_vocabulary_sampling_frequencies_match_the_warped_distribution():
    """Over d2t, the first draft is distributed as warp(L_0) restricted to d2t: tokens outside never come."""
    rng = np.random.default_rng(16)
    trials, vocab = 40_000, 9
    d2t = np.array([0, 2, 3, 7])
    feeds = markov_feeds(rng, "t1.3", _config(1, True, False), num_requests=1, vocab=vocab)
    _, draft = draft_vocab_feeds(feeds, d2t)
    shared = ("confidence_temperature", "markov_w1", "markov_w2", "d2t")
    draft = {k: (np.repeat(v, trials, axis=0) if k not in shared else v) for k, v in draft.items()}
    draft["uniforms"] = rng.random((trials, 1), dtype=F32)
    outputs = run(draft)
    logits = scatter_draft_logits(outputs["draft_logits"][0, 0], d2t, vocab)
    target = warp_probs(logits, draft["temperature"][0], draft["top_k"][0], draft["top_p"][0])
    assert (target[np.setdiff1d(np.arange(vocab), d2t)] == 0).all()
    frequencies = np.bincount(outputs["draft_ids"][:, 0], minlength=vocab) / trials
    assert 0.5 * np.abs(frequencies - target).sum() < 0.02


def _d2t_feeds() -> dict:
    feeds = markov_feeds(np.random.default_rng(9), "t0.7", _config(4, True, True), num_requests=2)  # V = 50
    return draft_vocab_feeds(feeds, np.array([1, 4, 9, 30]))[1]


@pytest.mark.parametrize("mutation, pattern", [
    (lambda f: _bad(f, d2t=np.array([1, 4, 9, 50])), r"'d2t'.*\[0, V=50\).*d2t\[3\] = 50"),
    (lambda f: _bad(f, d2t=np.array([-2, 4, 9, 30])), r"'d2t'.*d2t\[0\] = -2"),
    (lambda f: _bad(f, d2t=np.array([1, 9, 4, 30])), r"'d2t'.*strictly ascending.*d2t\[1\] = 9 >= d2t\[2\] = 4"),
    (lambda f: _bad(f, markov_w2=np.zeros((50, 5), F32)), r"'markov_w2'.*\[Vd, r\].*Vd=4 from 'base_logits'.*\(50, 5\)"),
    (lambda f: _bad(f, d2t=np.array([1, 4, 9])), r"'d2t'.*\[Vd\].*Vd=4.*\(3,\)"),
    (lambda f: _bad(f, d2t=np.array([1, 4, 9, 30], np.int32)), r"'d2t'.*\[Vd\] int64.*int32"),
    (lambda f: _bad(f, markov_w1=None, markov_w2=None, confidence_weight=np.zeros(8, F32)),
     r"'d2t'.*needs markov_w1/markov_w2"),
    (lambda f: _bad(f, d2t=None), r"'markov_w1'.*V = Vd = 4 from 'base_logits'.*\(50, 5\)"),
])
def test_draft_vocabulary_errors_name_the_input(mutation, pattern):
    with pytest.raises(PluginError, match=pattern):
        run(mutation(_d2t_feeds()))


def test_draft_vocabulary_configuration_needs_markov_weights():
    with pytest.raises(PluginError, match="has_d2t.*needs the Markov weights"):
        MarkovDraftConfig.from_dict(dict(block_size=4, has_markov=False, has_confidence=True, has_d2t=True))
    assert MarkovDraftConfig.from_dict(_config(7, True, True) | {"has_d2t": True}).overload == "g7_markov_conf_d2t"


def _chain_feeds() -> dict:
    """V = 5, identity W1 and a permutation W2 (x → x+1 mod 5) with weight 10: greedy walks the chain."""
    vocab, gamma = 5, 4
    permutation = np.roll(np.eye(vocab, dtype=F32), 1, axis=0) * 10
    return dict(
        base_logits=np.zeros((2, gamma, vocab), F32), hidden=np.zeros((2, gamma, 3), F32),
        anchor_ids=np.array([0, 3], I64), **sampling_feeds("greedy", 2), uniforms=np.full((2, gamma), 0.5, F32),
        confidence_temperature=np.ones(gamma, F32), markov_w1=np.eye(vocab, dtype=F32), markov_w2=permutation,
    )


@pytest.mark.parametrize("impl", ["reference", "onnxruntime"])
def test_markov_bias_conditions_on_the_previous_draft(impl):
    feeds = _chain_feeds()
    outputs = run(feeds) if impl == "reference" else run_ort("MarkovDraft", _config(4, True, False), feeds)
    np.testing.assert_array_equal(outputs["draft_ids"], [[1, 2, 3, 4], [4, 0, 1, 2]])
    # draft_logits hold the corrected logits: base 0 + 10 at the successor of the previous token.
    np.testing.assert_array_equal(outputs["draft_logits"][0, 0], [0, 10, 0, 0, 0])
    np.testing.assert_array_equal(outputs["draft_logits"][1, 1], [10, 0, 0, 0, 0])
    np.testing.assert_array_equal(outputs["confidence"], np.ones((2, 4), F32))


@pytest.mark.parametrize("impl", ["reference", "onnxruntime"])
def test_without_markov_logits_pass_through_and_confidence_reads_hidden_only(impl):
    rng = np.random.default_rng(4)
    feeds = markov_feeds(rng, "greedy", _config(4, False, True), num_requests=2, vocab=11, hidden=3)
    feeds["confidence_weight"] = np.array([1.0, -2.0, 0.5], F32)
    feeds["confidence_bias"] = np.array([0.25], F32)
    outputs = run(feeds) if impl == "reference" else run_ort("MarkovDraft", _config(4, False, True), feeds)
    np.testing.assert_array_equal(outputs["draft_logits"], feeds["base_logits"])
    np.testing.assert_array_equal(outputs["draft_ids"], feeds["base_logits"].argmax(-1))
    h = feeds["hidden"].astype(np.float64)
    z = (h[..., 0] - 2 * h[..., 1] + 0.5 * h[..., 2] + 0.25) / feeds["confidence_temperature"]
    np.testing.assert_allclose(outputs["confidence"], 1 / (1 + np.exp(-z)), rtol=1e-5)


def test_confidence_input_is_hidden_then_w1_of_previous_token():
    feeds = _chain_feeds()
    feeds["confidence_weight"] = np.array([0, 0, 0, 1, 2, 3, 4, 5], F32)  # H = 3 zeros, then W1[prev] (one-hot)
    feeds["confidence_bias"] = np.array([-1.0], F32)
    feeds["confidence_temperature"] = np.array([1, 2, 4, 8], F32)
    prev = np.array([[0, 1, 2, 3], [3, 4, 0, 1]])  # anchor, then the drafts
    expected = 1 / (1 + np.exp(-prev / feeds["confidence_temperature"]))  # w·W1[prev] = prev + 1, b = -1
    np.testing.assert_allclose(run(feeds)["confidence"], expected, rtol=1e-6)
    np.testing.assert_allclose(run_ort("MarkovDraft", _config(4, True, True), feeds)["confidence"], expected, rtol=1e-6)


def test_greedy_rows_ignore_uniforms_in_a_mixed_batch():
    rng = np.random.default_rng(5)
    feeds = markov_feeds(rng, "mixed", _config(4, True, True), num_requests=6)
    other = dict(feeds, uniforms=rng.random(feeds["uniforms"].shape, dtype=F32))
    is_greedy = feeds["temperature"] == 0
    np.testing.assert_array_equal(run(feeds)["draft_ids"][is_greedy], run(other)["draft_ids"][is_greedy])


def test_first_draft_frequencies_match_the_warped_distribution():
    rng = np.random.default_rng(6)
    trials, vocab = 40_000, 6
    config = _config(1, True, False)
    feeds = markov_feeds(rng, "t1.3", config, num_requests=1, vocab=vocab)
    feeds = {k: (np.repeat(v, trials, axis=0) if k not in ("confidence_temperature", "markov_w1", "markov_w2") else v)
             for k, v in feeds.items()}
    feeds["uniforms"] = rng.random((trials, 1), dtype=F32)
    outputs = run(feeds)
    target = warp_probs(outputs["draft_logits"][0, 0], feeds["temperature"][0], feeds["top_k"][0], feeds["top_p"][0])
    frequencies = np.bincount(outputs["draft_ids"][:, 0], minlength=vocab) / trials
    assert 0.5 * np.abs(frequencies - target).sum() < 0.02  # TV; sampling noise is about 0.005 at 40k trials


@pytest.mark.parametrize("impl", ["reference", "onnxruntime"])
def test_inputs_are_never_modified(impl):
    config = _config(4, True, True)
    feeds = markov_feeds(np.random.default_rng(7), "mixed", config, num_requests=6)
    frozen = freeze(feeds)
    run(frozen) if impl == "reference" else run_ort("MarkovDraft", config, frozen)
    for name, array in feeds.items():
        np.testing.assert_array_equal(frozen[name], array, err_msg=name)


def _bad(feeds: dict, **changes) -> dict:
    return {**feeds, **changes}


@pytest.mark.parametrize("mutation, pattern", [
    (lambda f: _bad(f, hidden=np.zeros((2, 5, 8), F32)), r"'hidden'.*\[R, γ, H\].*γ=4.*\(2, 5, 8\)"),
    (lambda f: _bad(f, anchor_ids=f["anchor_ids"].astype(np.int32)), r"'anchor_ids'.*\[R\] int64.*int32"),
    (lambda f: _bad(f, confidence_weight=np.zeros(8, F32)), r"'confidence_weight'.*H=8.*r=5.*\(8,\)"),
    (lambda f: _bad(f, markov_w2=None), r"both or neither.*markov_w1"),
    (lambda f: _bad(f, uniforms=np.ones((2, 4), F32)), r"'uniforms'.*\[0, 1\)"),
    (lambda f: _bad(f, temperature=np.array([-1, 1], F32)), r"'temperature'"),
    (lambda f: _bad(f, anchor_ids=np.array([0, 50], I64)), r"'anchor_ids'.*\[0, V=50\)"),
    (lambda f: {k: v for k, v in f.items() if k != "uniforms"}, r"required input 'uniforms'"),
    (lambda f: _bad(f, top_k=[0, 0]), r"'top_k'.*numpy array"),
])
def test_errors_name_the_input_and_the_shapes(mutation, pattern):
    feeds = markov_feeds(np.random.default_rng(8), "t0.7", _config(4, True, True), num_requests=2)
    with pytest.raises(PluginError, match=pattern):
        run(mutation(feeds))


def test_function_api_rejects_mismatched_feeds():
    sampling = SamplingBatch(np.zeros(1, F32), np.zeros(1, I64), np.ones(1, F32))
    with pytest.raises(PluginError, match="'base_logits'"):
        markov_draft(np.zeros((1, 4), F32), np.zeros((1, 4, 2), F32), np.zeros(1, I64), sampling,
                     np.zeros((1, 4), F32), np.ones(4, F32), MarkovDraftWeights())


@pytest.mark.parametrize("config, pattern", [
    (dict(block_size=0, has_markov=True, has_confidence=True), "block_size"),
    (dict(block_size=4, has_markov=1, has_confidence=True), "has_markov"),
    (dict(block_size=4, has_markov=True), "expected keys"),
])
def test_bad_configuration(config, pattern):
    with pytest.raises(PluginError, match=pattern):
        MarkovDraftConfig.from_dict(config)


def test_make_node_checks_inputs_against_configuration():
    names = ["base_logits", "hidden", "anchor_ids", "temperature", "top_k", "top_p", "uniforms", "ct", "w1", "w2"]
    node = make_node(names, ["ids", "logits", "conf"], "/drafter/MarkovDraft", **_config(7, True, False))
    assert (node.domain, node.op_type, node.overload, len(node.input)) == ("dspark", "MarkovDraft", "g7_markov", 10)
    with pytest.raises(PluginError, match="requires input 'confidence_weight'"):
        make_node(names, ["ids", "logits", "conf"], "/d", **_config(7, True, True))
    with pytest.raises(PluginError, match="must leave empty input 'markov_w1'"):
        make_node(names, ["ids", "logits", "conf"], "/d", **_config(7, False, False))


def _config(block_size: int, has_markov: bool, has_confidence: bool) -> dict:
    return dict(block_size=block_size, has_markov=has_markov, has_confidence=has_confidence)


def test_function_body_has_one_if_and_five_nodes_per_greedy_slot():
    """γ = 7 with a Markov head and d2t: one If picks every slot (not one per slot), and the greedy branch does
    Gather(W1), MatMul, Add, ArgMax, Gather(d2t) per slot plus one Split and two Concats (and its constants)."""
    from dspark_export.plugins.markov_draft.onnx_function import make_function

    body = make_function(block_size=7, has_markov=True, has_confidence=True, has_d2t=True)
    ifs = [n for n in body.node if n.op_type == "If"]
    assert len(ifs) == 1
    then = next(a.g for a in ifs[0].attribute if a.name == "then_branch")
    work = [n.op_type for n in then.node if n.op_type != "Constant"]
    assert len(work) == 5 * 7 + 3
    assert sorted(set(work)) == ["Add", "ArgMax", "Concat", "Gather", "MatMul", "Split"]
