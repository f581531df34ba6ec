"""plugins/common/sampling.py (numpy warp and sample) and its ONNX twin plugins/common/onnx_sampling.py."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from dspark_export.errors import PluginError
from dspark_export.plugins.common.sampling import SamplingBatch, check_sampling_values, sample_from_probs, warp_probs
from dspark_export.plugins.common.onnx_builder import NodeBuilder, opset_imports
from dspark_export.plugins.common.onnx_sampling import emit_sample, emit_warp_probs
from plugin_cases import SAMPLING_CASES, random_logits, sampling_feeds

F32, I64 = np.float32, np.int64


def _warp(logits, temperature, top_k=0, top_p=1.0):
    rows = logits.shape[0]
    return warp_probs(logits, np.full(rows, temperature, F32), np.full(rows, top_k, I64), np.full(rows, top_p, F32))


def test_greedy_is_one_hot_at_first_argmax():
    logits = np.array([[1.0, 3.0, 3.0, -2.0]], F32)
    np.testing.assert_array_equal(_warp(logits, 0.0, top_k=1, top_p=0.1), [[0, 1, 0, 0]])


def test_temperature_scales_before_softmax():
    logits = np.array([[0.0, 1.0, 2.0]], F32)
    expected = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    np.testing.assert_allclose(_warp(logits, 0.5), expected, rtol=1e-6)


def test_top_k_keeps_values_tied_with_the_kth():
    logits = np.array([[1.0, 4.0, 2.0, 2.0, 0.0]], F32)
    probs = _warp(logits, 1.0, top_k=2)
    assert (probs[0] > 0).tolist() == [False, True, True, True, False]
    np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-6)


def test_top_k_off_and_larger_than_vocab_keep_everything():
    logits = random_logits(np.random.default_rng(0), (2, 7))
    np.testing.assert_allclose(_warp(logits, 1.0, top_k=0), _warp(logits, 1.0, top_k=100), rtol=1e-6)
    assert np.all(_warp(logits, 1.0, top_k=0) > 0)


def test_top_p_stable_sort_exclusive_cumsum_and_top1():
    # probs 0.3, 0.2, 0.3, 0.2: stable descending order is tokens 0, 2, 1, 3; exclusive cumsum 0, .3, .6, .8.
    logits = np.log(np.array([[0.3, 0.2, 0.3, 0.2]], F32))
    assert (_warp(logits, 1.0, top_p=0.55)[0] > 0).tolist() == [True, False, True, False]
    assert (_warp(logits, 1.0, top_p=0.65)[0] > 0).tolist() == [True, True, True, False]
    assert (_warp(logits, 1.0, top_p=0.25)[0] > 0).tolist() == [True, False, False, False]  # tie: lower index first
    assert (_warp(logits, 1.0, top_p=0.0)[0] > 0).tolist() == [True, False, False, False]
    np.testing.assert_allclose(_warp(logits, 1.0, top_p=0.55), [[0.5, 0, 0.5, 0]], rtol=1e-6)


def test_top_p_one_is_off():
    # exp(-81) is a normal float32; the exclusive cumsum before it rounds to 1, so only "1 = off" keeps it.
    logits = np.array([[0.0, -80.0, 1.0]], F32)
    assert np.all(_warp(logits, 1.0, top_p=1.0) > 0)


def test_sample_first_index_with_cumsum_above_u_times_total():
    probs = np.array([[0.1, 0.2, 0.3, 0.4]] * 5, F32)
    u = np.array([0.0, 0.099, 0.1, 0.35, 0.9999], F32)
    np.testing.assert_array_equal(sample_from_probs(probs, u), [0, 0, 1, 2, 3])


def test_sample_never_picks_zero_probability_tokens():
    probs = np.array([[0.0, 0.5, 0.0, 0.5, 0.0]] * 3, F32)  # unnormalised rows also work: u scales by the total
    u = np.array([0.0, 0.5, np.nextafter(F32(1), F32(0))], F32)
    np.testing.assert_array_equal(sample_from_probs(probs, u), [1, 3, 3])
    np.testing.assert_array_equal(sample_from_probs(probs * 3, u), [1, 3, 3])


def test_sample_frequencies_match_probs():
    rng = np.random.default_rng(1)
    probs = np.array([0.05, 0.25, 0.1, 0.6], F32)
    ids = sample_from_probs(np.broadcast_to(probs, (40_000, 4)), rng.random(40_000, dtype=F32))
    frequencies = np.bincount(ids, minlength=4) / ids.size
    assert 0.5 * np.abs(frequencies - probs).sum() < 0.02


def test_warp_and_sample_do_not_modify_inputs():
    logits = random_logits(np.random.default_rng(2), (3, 9))
    params = sampling_feeds("mixed", 3)
    for array in (logits, *params.values()):
        array.setflags(write=False)
    probs = warp_probs(logits, params["temperature"], params["top_k"], params["top_p"])
    probs.setflags(write=False)
    sample_from_probs(probs, np.full(3, 0.5, F32))


@pytest.mark.parametrize("name, value", [("temperature", -0.1), ("top_k", -1), ("top_p", 1.5), ("uniforms", 1.0)])
def test_check_sampling_values_rejects_out_of_range(name, value):
    arrays = dict(temperature=np.ones(2, F32), top_k=np.zeros(2, I64), top_p=np.ones(2, F32),
                  uniforms=np.zeros((2, 3), F32))
    arrays[name] = arrays[name].copy()
    arrays[name].flat[0] = value
    params = SamplingBatch(arrays["temperature"], arrays["top_k"], arrays["top_p"])
    with pytest.raises(PluginError, match=name):
        check_sampling_values("dspark::Test", params, arrays["uniforms"])


def _sampling_session() -> ort.InferenceSession:
    b = NodeBuilder("/test/")
    probs = emit_warp_probs(b, "logits", "temperature", "top_k", "top_p")
    b.op_into("probs", "Identity", probs)
    b.op_into("ids", "Identity", emit_sample(b, probs, "u"))
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info(n, t, s) for n, t, s in [
        ("logits", f32, ["n", "V"]), ("temperature", f32, ["n"]), ("top_k", i64, ["n"]), ("top_p", f32, ["n"]),
        ("u", f32, ["n"])]]
    outputs = [helper.make_tensor_value_info("probs", f32, ["n", "V"]), helper.make_tensor_value_info("ids", i64, ["n"])]
    model = helper.make_model(helper.make_graph(b.nodes, "sampling", inputs, outputs), opset_imports=opset_imports(),
                              ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("has_ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_onnx_sampling_matches_numpy(case, has_ties):
    rng = np.random.default_rng(3)
    logits = random_logits(rng, (12, 37), has_ties)
    params = sampling_feeds(case, 12)
    u = rng.random(12, dtype=F32)
    probs, ids = _sampling_session().run(None, dict(logits=logits, u=u, **params))
    expected = warp_probs(logits, params["temperature"], params["top_k"], params["top_p"])
    is_sampled = params["temperature"] > 0  # the ONNX helper warps greedy rows at T=1; the op takes their argmax
    np.testing.assert_allclose(probs[is_sampled], expected[is_sampled], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(ids[is_sampled], sample_from_probs(expected, u)[is_sampled])


def _top_p_session(head: int) -> ort.InferenceSession:
    from dspark_export.plugins.common.onnx_sampling import _emit_top_p

    b = NodeBuilder("/test/")
    b.op_into("kept", "Identity", _emit_top_p(b, "probs", "top_p", head=head))
    f32 = TensorProto.FLOAT
    model = helper.make_model(helper.make_graph(
        b.nodes, "top_p", [helper.make_tensor_value_info("probs", f32, ["n", "V"]),
                           helper.make_tensor_value_info("top_p", f32, ["n"])],
        [helper.make_tensor_value_info("kept", f32, ["n", "V"])]), opset_imports=opset_imports(), ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("flat_row", [False, True], ids=["head-decides", "full-sort"])
def test_top_p_sorts_only_the_head_when_it_decides_and_gives_the_full_sorts_bits(flat_row):
    """The top-p filter sorts the first `head` values when, in every row, they already sum to top_p (nothing after
    them can be kept) and the whole row otherwise (a flat row): either way bit for bit what sorting all V values
    gives, and the numpy reference's distribution; ties and top_p >= 1 rows included."""
    from dspark_export.plugins.common.sampling import _apply_top_p

    rng = np.random.default_rng(5)
    logits = random_logits(rng, (6, 64), True) * 4
    if flat_row:
        logits[2] = rng.normal(size=64).astype(F32) * 0.01     # its first 8 values hold ~1/8 of the mass
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).astype(F32)
    top_p = np.array([0.5, 0.9, 0.9, 1.0, 0.3, 0.95], F32)
    head_sums = np.sort(probs, -1)[:, ::-1][:, :8].sum(-1)
    assert (head_sums[[0, 1, 4, 5]] >= top_p[[0, 1, 4, 5]]).all() and (head_sums[2] < top_p[2]) == flat_row
    kept = _top_p_session(8).run(None, {"probs": probs, "top_p": top_p})[0]
    full = _top_p_session(64).run(None, {"probs": probs, "top_p": top_p})[0]
    np.testing.assert_array_equal(kept, full)
    np.testing.assert_allclose(kept, _apply_top_p(probs, top_p), rtol=1e-6, atol=1e-7)
