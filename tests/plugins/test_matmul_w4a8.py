"""dspark.cpu::MatMulW4A8 (plugins/matmul_w4a8): MatMulNBits' int4 arithmetic, row-local to the bit, in ONNX
Runtime; the rewrite of MatMulNBits graphs; bad input named."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dspark_export.errors import ConfigError
from dspark_export.exporter.quantize import WeightFormat, dequantize_blocks, quantize_blocks
from dspark_export.plugins import cpu_ops, matmul_w4a8

INT4 = WeightFormat("int4")


def _weights(k: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(k, n)).astype(np.float32) * 0.05
    packed, scales = quantize_blocks(w, INT4)
    return packed, scales


def _model(k: int, n: int, packed, scales, op: str = "MatMulW4A8") -> onnx.ModelProto:
    if op == "MatMulW4A8":
        node = helper.make_node(op, ["x", "B", "S"], ["y"], domain=matmul_w4a8.DOMAIN)
    else:
        node = helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                                block_size=32, accuracy_level=4)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
                              [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1),
                                                   helper.make_opsetid(matmul_w4a8.DOMAIN, 1)])


def _session(model: onnx.ModelProto, threads: int = 2) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    cpu_ops.register(so)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _rows(m: int, k: int, seed: int = 1) -> np.ndarray:
    """Activation rows with an outlier channel and an all-zero row, as LLM hidden states have."""
    x = np.random.default_rng(seed).normal(size=(m, k)).astype(np.float32)
    x[:, 3] *= 40.0
    if m > 2:
        x[2] = 0.0
    return x


def _reference(x: np.ndarray, packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The op's formula in float64 (cpu_ops/matmul_w4a8.cpp's header): int8 rows per block of 32, exact int sums, scaled."""
    n, kb, _ = packed.shape
    q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, kb, 32).astype(np.int64)      # [N, kb, 32]
    xb = x.reshape(x.shape[0], kb, 32).astype(np.float32)
    amax = np.abs(xb).max(-1)                                                                 # [M, kb]
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(xb * inv[..., None]).astype(np.int64)                                        # half to even
    sums = np.einsum("mbk,nbk->mnb", xq, q) - 8 * xq.sum(-1)[:, None, :]                      # [M, N, kb]
    xs = (amax / np.float32(127)).astype(np.float32)
    return (sums * (xs[:, None, :].astype(np.float64) * scales.astype(np.float32)[None])).sum(-1)


@pytest.mark.parametrize("k, n", [(64, 48), (576, 192), (96, 4096)])
def test_op_computes_matmulnbits_arithmetic(k, n):
    """Equal to the formula to float rounding, and to ONNX Runtime's MatMulNBits (accuracy_level 4) as closely:
    the two differ only in the order of the float sums over blocks."""
    packed, scales = _weights(k, n)
    x = _rows(9, k)
    ours = _session(_model(k, n, packed, scales)).run(None, {"x": x})[0]
    ref = _reference(x, packed, scales)
    theirs = _session(_model(k, n, packed, scales, "MatMulNBits")).run(None, {"x": x})[0]
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 1e-5 * scale
    assert np.abs(ours - theirs).max() <= 1e-5 * scale
    assert not ours[2].any()   # an all-zero row stays zero
    dense = x @ dequantize_blocks(packed, scales, INT4, k)
    assert np.abs(ours - dense).max() <= 0.02 * np.abs(dense).max()   # activations cost < 1 int8 step a block


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_output_is_bitwise_the_same_at_any_row_count(threads):
    """Rows 0..M-1 packed give row for row the bits each row gives alone, for M across the 8-row tiles and the
    32-row tasks (whose activations are quantized in parallel)."""
    k, n = 576, 1536
    packed, scales = _weights(k, n, seed=2)
    sess = _session(_model(k, n, packed, scales), threads)
    x = _rows(72, k, seed=3)
    alone = np.concatenate([sess.run(None, {"x": x[i:i + 1]})[0] for i in range(72)])
    for m in (2, 5, 8, 9, 16, 20, 33, 72):
        np.testing.assert_array_equal(sess.run(None, {"x": x[:m]})[0], alone[:m], err_msg=f"M = {m}")
    np.testing.assert_array_equal(sess.run(None, {"x": x[7:13]})[0], alone[7:13])


def test_portable_path_equals_the_vectorized_one_bitwise():
    if not matmul_w4a8.vectorized():
        pytest.skip("this CPU has no AVX512-VNNI: only the portable path runs here")
    packed, scales = _weights(576, 256, seed=4)
    x = _rows(41, 576, seed=5)
    x[5] = np.float32(1e-30)     # a tiny-but-nonzero block scale
    x[6, :32] = np.r_[127.0, np.arange(31) - 14.5]   # max 127: x·127/max lands on halves, ties round to even
    np.testing.assert_array_equal(matmul_w4a8.matmul_w4a8_numpy(x, packed, scales, portable=True),
                                  matmul_w4a8.matmul_w4a8_numpy(x, packed, scales))


def test_onnxruntime_op_equals_the_direct_entry_bitwise():
    packed, scales = _weights(128, 64, seed=6)
    x = _rows(4, 128, seed=7)
    np.testing.assert_array_equal(_session(_model(128, 64, packed, scales)).run(None, {"x": x})[0],
                                  matmul_w4a8.matmul_w4a8_numpy(x, packed, scales))


def test_leading_dimensions_are_kept():
    packed, scales = _weights(64, 32, seed=8)
    x = _rows(6, 64).reshape(2, 3, 64)
    model = _model(64, 32, packed, scales)
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["A", "B", 64]))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["A", "B", 32]))
    y = _session(model).run(None, {"x": x})[0]
    assert y.shape == (2, 3, 32)
    np.testing.assert_array_equal(y.reshape(6, 32), matmul_w4a8.matmul_w4a8_numpy(x.reshape(6, 64), packed, scales))


def test_wrong_input_width_is_named():
    packed, scales = _weights(64, 32)
    model = _model(64, 32, packed, scales)
    model.graph.input[0].CopyFrom(helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", "K"]))
    with pytest.raises(Exception, match=r"MatMulW4A8.*K = 64.*found 96"):
        _session(model).run(None, {"x": np.zeros((1, 96), np.float32)})
    with pytest.raises(ConfigError, match=r"packed \[N, K/32, 16\]"):
        matmul_w4a8.matmul_w4a8_numpy(np.zeros((1, 96), np.float32), packed, scales)


def test_rewrite_takes_only_what_the_op_computes():
    """use_w4a8 renames int4 / block-32 / accuracy_level-4 MatMulNBits without zero points; int8 ones stay."""
    packed, scales = _weights(64, 32)
    model = _model(64, 32, packed, scales, "MatMulNBits")
    int8 = helper.make_node("MatMulNBits", ["y", "B8", "S8"], ["z"], domain="com.microsoft", K=32, N=16, bits=8,
                            block_size=32, accuracy_level=4)
    model.graph.node.append(int8)
    assert not cpu_ops.graph_uses_cpu_ops(model)
    assert matmul_w4a8.use_w4a8(model) == 1
    assert [(n.op_type, n.domain) for n in model.graph.node] == [("MatMulW4A8", matmul_w4a8.DOMAIN),
                                                                 ("MatMulNBits", "com.microsoft")]
    assert cpu_ops.graph_uses_cpu_ops(model)
    assert matmul_w4a8.use_w4a8(model) == 0


def test_weights_fed_as_inputs_are_read_on_every_call():
    """B and scales that are graph inputs (not initializers) may change between calls: the kernel packs them per
    call instead of caching the first call's packing."""
    k, n = 64, 32
    node = helper.make_node("MatMulW4A8", ["x", "B", "S"], ["y"], domain=matmul_w4a8.DOMAIN)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k]),
                                            helper.make_tensor_value_info("B", TensorProto.UINT8, [n, k // 32, 16]),
                                            helper.make_tensor_value_info("S", TensorProto.FLOAT, [n, k // 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(matmul_w4a8.DOMAIN, 1)])
    session = _session(model)
    x = _rows(3, k)
    for seed in range(3):
        packed, scales = _weights(k, n, seed)
        [y] = session.run(None, {"x": x, "B": packed, "S": scales})
        np.testing.assert_array_equal(y, matmul_w4a8.matmul_w4a8_numpy(x, packed, scales))


# -- swiglu: a SiLU-gated MLP's gate/up projection, Split, QuickGelu and Mul in one node ---------------------------

def _swiglu_model(k: int, n: int, packed, scales, fused: bool) -> onnx.ModelProto:
    """x → gate/up product [M, n] → silu(first half) · second half → [M, n/2]: one node, or the exporter's chain."""
    half = n // 2
    if fused:
        nodes = [helper.make_node("MatMulW4A8", ["x", "B", "S"], ["y"], domain=matmul_w4a8.DOMAIN, swiglu=1)]
    else:
        nodes = [helper.make_node("MatMulW4A8", ["x", "B", "S"], ["gu"], domain=matmul_w4a8.DOMAIN),
                 helper.make_node("Split", ["gu", "sizes"], ["g", "u"], axis=-1),
                 helper.make_node("QuickGelu", ["g"], ["a"], domain="com.microsoft", alpha=1.0),
                 helper.make_node("Mul", ["a", "u"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", half])],
                              [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "S"),
                               numpy_helper.from_array(np.array([half, half], np.int64), "sizes")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1),
                                                   helper.make_opsetid(matmul_w4a8.DOMAIN, 1)])


def _silu_times(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) · u in float64, with the logistic as (1 + tanh(g/2)) / 2 (no overflow for large |g|)."""
    return g * 0.5 * (1.0 + np.tanh(0.5 * g)) * u


def test_swiglu_is_silu_of_the_gate_times_the_up_half():
    """Against float64 silu over the op's own product, on both paths (the same bits), alone or packed, and in ONNX
    Runtime; gates far past ±88 (exp clamped) stay finite."""
    k, n = 576, 192
    packed, scales = _weights(k, n, seed=9)
    x = _rows(37, k, seed=10)
    x[4] *= 1e3                                                      # |gate| in the thousands
    product = matmul_w4a8.matmul_w4a8_numpy(x, packed, scales).astype(np.float64)
    g, u = product[:, :n // 2], product[:, n // 2:]
    fused = matmul_w4a8.matmul_w4a8_numpy(x, packed, scales, swiglu=True)
    assert np.abs(g[4]).max() > 500 and np.isfinite(fused).all()
    np.testing.assert_allclose(fused, _silu_times(g, u), rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(matmul_w4a8.matmul_w4a8_numpy(x, packed, scales, portable=True, swiglu=True), fused)
    sess = _session(_swiglu_model(k, n, packed, scales, fused=True))
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], fused)
    alone = np.concatenate([sess.run(None, {"x": x[i:i + 1]})[0] for i in range(len(x))])
    np.testing.assert_array_equal(alone, fused)


def test_fuse_swiglu_folds_the_chain_and_keeps_the_outputs():
    """The exporter's chain becomes one node; its outputs agree with the chain's to float rounding (ONNX Runtime's
    QuickGelu uses its own logistic approximation, a few 1e-6 off) and are no further from float64 silu."""
    k, n = 128, 96
    packed, scales = _weights(k, n, seed=11)
    model = _swiglu_model(k, n, packed, scales, fused=False)
    x = _rows(9, k, seed=12)
    chain = _session(model).run(None, {"x": x})[0]
    assert matmul_w4a8.fuse_swiglu(model) == 1
    assert [n.op_type for n in model.graph.node] == ["MatMulW4A8"]
    assert matmul_w4a8.fuse_swiglu(model) == 0
    fused = _session(model).run(None, {"x": x})[0]
    np.testing.assert_allclose(fused, chain, rtol=1e-5, atol=5e-6)
    np.testing.assert_array_equal(fused, matmul_w4a8.matmul_w4a8_numpy(x, packed, scales, swiglu=True))
    product = matmul_w4a8.matmul_w4a8_numpy(x, packed, scales).astype(np.float64)
    g, u = product[:, :n // 2], product[:, n // 2:]
    exact = _silu_times(g, u)
    assert np.abs(fused - exact).max() <= np.abs(chain - exact).max()   # no less accurate than QuickGelu's


def test_fuse_swiglu_leaves_chains_it_cannot_fold():
    """Another alpha, unequal halves, or an intermediate something else reads stay as they are."""
    k, n = 64, 64
    packed, scales = _weights(k, n, seed=13)
    other_alpha = _swiglu_model(k, n, packed, scales, fused=False)
    other_alpha.graph.node[2].attribute[0].f = 1.702
    uneven = _swiglu_model(k, n, packed, scales, fused=False)
    uneven.graph.initializer[2].CopyFrom(numpy_helper.from_array(np.array([16, 48], np.int64), "sizes"))
    read_elsewhere = _swiglu_model(k, n, packed, scales, fused=False)
    read_elsewhere.graph.output.append(helper.make_tensor_value_info("g", TensorProto.FLOAT, ["M", n // 2]))
    for model in (other_alpha, uneven, read_elsewhere):
        assert matmul_w4a8.fuse_swiglu(model) == 0 and len(model.graph.node) == 4


def test_swiglu_needs_two_whole_tile_halves():
    packed, scales = _weights(64, 48)
    with pytest.raises(Exception, match=r"swiglu: N must be a multiple of 32.*found 48"):
        _session(_swiglu_model(64, 48, packed, scales, fused=True)).run(None, {"x": _rows(1, 64)})
    with pytest.raises(ConfigError, match=r"packed \[N, K/32, 16\]"):
        matmul_w4a8.matmul_w4a8_numpy(_rows(1, 64), packed, scales, swiglu=True)
