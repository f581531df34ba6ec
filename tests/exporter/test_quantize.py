"""Quantized target engines (exporter/quantize.py, the fused target graph): weights, parity, batch invariance,
speculative == autoregressive on the quantized engines, the drafter's shared embedding, bad input."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from dspark_export.engines.packing import Segment, pack_segments
from dspark_export.errors import ConfigError
from dspark_export.exporter.quantize import (WeightFormat, dequantize_blocks, quantize_blocks)
from dspark_export.exporter.target import build_target_graph as _build_target_graph
from dspark_export.plugins import cpu_ops, matmul_w4a8

TAPS = (1, 2)
QUANT = ("int4", "int8", "w8a8")
BLOCK_QUANT = ("int4", "int8")   # MatMulNBits formats
W4A8 = "int4-w4a8"               # the int4 graph with its MatMulNBits nodes run by dspark.cpu::MatMulW4A8
DEFAULT = "int4-w4a8-cpu-attention"  # that, with dspark.cpu::RaggedAttention: the default build's target


def build_target_graph(model, taps, weights, fused=None):
    """`exporter.target.build_target_graph`, plus W4A8 (the int4 graph as `build --int4-kernel w4a8
    --attention-kernel onnx` saves it) and DEFAULT (as `build` saves it)."""
    if weights not in (W4A8, DEFAULT):
        return _build_target_graph(model, taps, weights, fused)
    proto, spec = _build_target_graph(model, taps, "int4", fused, attention="cpu" if weights == DEFAULT else "onnx")
    assert matmul_w4a8.use_w4a8(proto) > 0
    assert any(n.op_type == "RaggedAttention" for n in proto.graph.node) == (weights == DEFAULT)
    return proto, spec


def _session(proto, threads: int = 2) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    cpu_ops.register_for(so, proto)
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feed(spec, segments, num_slots, lens, bucket, past, seed=0) -> dict:
    """A packed target feed; `past[l]` = (keys, values) [S, kvH, P, D] shared by every call of a test."""
    feed = dict(pack_segments(segments, num_slots, np.asarray(lens, np.int64), bucket).feed)
    for layer, (k, v) in enumerate(past):
        feed[f"past_key.{layer}"], feed[f"past_value.{layer}"] = k, v
    return feed


def _run(sess, feed) -> dict:
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))


def _past(spec, num_slots, capacity, seed=0):
    rng = np.random.default_rng(seed)
    shape = (num_slots, spec.num_kv_heads, capacity, spec.head_dim)
    return [(rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32))
            for _ in range(spec.num_layers)]


# -- the quantizer ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("weights", BLOCK_QUANT)
def test_blocks_are_onnxruntime_quantizers_own(weights):
    """quantize_blocks gives byte for byte what MatMulNBitsQuantizer writes for a MatMul (block 32, symmetric,
    accuracy_level 4), and no zero points (the kernel's default; float zero points are its slow path)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    fmt = WeightFormat(weights)
    w = np.random.default_rng(0).normal(size=(96, 40)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, 96])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, 40])],
                              initializer=[numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    q = MatMulNBitsQuantizer(model, algo_config=DefaultWeightOnlyQuantConfig(
        block_size=32, is_symmetric=True, accuracy_level=4, bits=fmt.bits))
    q.process()
    out = q.model.model
    [node] = [n for n in out.graph.node if n.op_type == "MatMulNBits"]
    assert len(node.input) == 3  # A, B, scales: no zero points
    inits = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    packed, scales = quantize_blocks(w, fmt)
    assert np.array_equal(inits[node.input[1]].reshape(packed.shape), packed)
    assert np.array_equal(inits[node.input[2]].reshape(scales.shape), scales)


@pytest.mark.parametrize("weights", BLOCK_QUANT)
def test_dequantized_weights_are_within_one_step(weights):
    fmt = WeightFormat(weights)
    w = np.random.default_rng(1).normal(size=(128, 24)).astype(np.float32)
    packed, scales = quantize_blocks(w, fmt)
    err = np.abs(dequantize_blocks(packed, scales, fmt, w.shape[0]) - w)      # [K, N]
    step = np.repeat(np.abs(scales).T, fmt.block_size, axis=0)               # one step per (block, n)
    assert (err <= step * (1 + 1e-6)).all()
    assert err.max() > 0  # really quantized


# -- the exported graph ----------------------------------------------------------------------------------

def _tied(model):
    """The same tiny model with its LM head tied to the embedding (SmolLM2's layout)."""
    import copy

    tied = copy.deepcopy(model)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    return tied


def _source_of(name: str, sd: dict) -> np.ndarray:
    """The state_dict weight [out, in] a MatMulNBits initializer `..._Q{bits}` was quantized from."""
    base = re.sub(r"_(Q\d|W8)$", "", name)
    if base.endswith(".qkv_proj.weight"):
        p = base[: -len(".qkv_proj.weight")]
        return np.concatenate([sd[f"{p}.{t}_proj.weight"] for t in "qkv"])
    if base.endswith(".gate_up_proj.weight"):
        p = base[: -len(".gate_up_proj.weight")]
        return np.concatenate([sd[f"{p}.gate_proj.weight"], sd[f"{p}.up_proj.weight"]])
    return sd[base]


@pytest.mark.parametrize("weights", BLOCK_QUANT)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_every_linear_head_and_embedding_is_quantized_within_one_step(tiny_target, weights, tie):
    model = _tied(tiny_target) if tie else tiny_target
    fmt = WeightFormat(weights)
    proto, spec = build_target_graph(model, TAPS, weights)
    onnx.checker.check_model(proto)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    ops = [n.op_type for n in proto.graph.node]
    weight_readers = [n.op_type for n in proto.graph.node
                      if any(i in inits and inits[i].ndim == 2 and inits[i].size > 1024 for i in n.input)]
    assert "MatMul" not in weight_readers and "Gemm" not in weight_readers
    assert ops.count("MatMulNBits") == 4 * spec.num_layers + 1          # qkv, o, gate_up, down + head
    [gather] = [n for n in proto.graph.node if n.op_type == "GatherBlockQuantized"]
    assert not any(n.op_type in ("Gather", "Gemm") and n.input[0] in inits and inits[n.input[0]].dtype == np.float32
                   and inits[n.input[0]].size >= spec.vocab_size * spec.hidden_size for n in proto.graph.node)
    for node in proto.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (fmt.bits, 32, 4)
        assert len([i for i in node.input[3:5] if i]) == 0   # no zero points, no g_idx
        w = _source_of(node.input[1], sd)
        deq = dequantize_blocks(inits[node.input[1]], inits[node.input[2]], fmt, w.shape[1])
        step = np.repeat(np.abs(inits[node.input[2]]).T, 32, axis=0)[: w.shape[1]]
        assert (np.abs(deq - w.T) <= step * (1 + 1e-6)).all(), node.name
    # the gather reads the same bytes as the head when tied; its rows dequantize to the table within a step
    view = inits[gather.input[0]]
    head = [n for n in proto.graph.node if n.name.endswith("/lm_head/MatMulNBits")][0]
    assert (gather.input[2] == head.input[2]) == tie
    table = sd["model.embed_tokens.weight"]
    sess = _session(helper.make_model(
        helper.make_graph([gather], "g",
                          [helper.make_tensor_value_info(gather.input[1], onnx.TensorProto.INT64, [None])],
                          [helper.make_tensor_value_info(gather.output[0], onnx.TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(view, gather.input[0]),
                                       numpy_helper.from_array(inits[gather.input[2]], gather.input[2])]),
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]))
    rows = sess.run(None, {gather.input[1]: np.arange(spec.vocab_size, dtype=np.int64)})[0]
    step = np.repeat(np.abs(inits[gather.input[2]]), 32, axis=1)
    assert (np.abs(rows - table) <= step * (1 + 1e-6)).all()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_w8a8_linears_and_head_are_int8_per_output_feature(tiny_target, tie):
    """w8a8: every linear layer and the head is one MatMulIntegerToFloat over int8 weights [in, out] whose per-output
    scales put each weight within half a step of its source; the activations are quantized by a per-row
    QuantizeLinear (one block per row, zero point 128); the embedding is gathered from int8 blocks within a step."""
    model = _tied(tiny_target) if tie else tiny_target
    proto, spec = build_target_graph(model, TAPS, "w8a8")
    onnx.checker.check_model(proto)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    ops = [n.op_type for n in proto.graph.node]
    assert "MatMulNBits" not in ops and ops.count("MatMulIntegerToFloat") == 4 * spec.num_layers + 1
    assert not any(n.op_type in ("MatMul", "Gemm") and any(i in inits and inits[i].ndim == 2 for i in n.input)
                   for n in proto.graph.node)
    producers = {o: n for n in proto.graph.node for o in n.output}
    for node in proto.graph.node:
        if node.op_type != "MatMulIntegerToFloat":
            continue
        w_q, scale = inits[node.input[1]], inits[node.input[3]]
        assert w_q.dtype == np.int8 and scale.shape == (w_q.shape[1],) and inits[node.input[4]] == 128
        w = _source_of(node.input[1], sd)                                           # [out, in]
        assert (np.abs(w_q.T * scale[:, None] - w) <= scale[:, None] * (0.5 + 1e-5)).all(), node.name
        quant = producers[node.input[0]]
        attrs = {a.name: helper.get_attribute_value(a) for a in quant.attribute}
        assert quant.op_type == "QuantizeLinear" and attrs["block_size"] == w.shape[1] and attrs["axis"] == -1
        assert quant.input[1] == node.input[2]   # the row scales it quantized with are the ones it multiplies by
    [gather] = [n for n in proto.graph.node if n.op_type == "GatherBlockQuantized"]
    assert {a.name: helper.get_attribute_value(a) for a in gather.attribute}["bits"] == 8


def test_w8a8_matmul_is_per_row_quantization_times_int8_weights():
    """`matmul_w8a8` against its formula in numpy (rows of very different magnitude, a zero row, a bias), and a
    row's output bitwise the same alone and among other rows."""
    from dspark_export.exporter.builder import GraphBuilder
    from dspark_export.exporter.quantize import matmul_w8a8, quantize_rows_int8

    rng = np.random.default_rng(2)
    w, bias = rng.normal(size=(24, 40)).astype(np.float32), rng.normal(size=24).astype(np.float32)
    b = GraphBuilder("g")
    b.input("x", "float32", ["n", 40])
    b.output(matmul_w8a8(b, "x", "w", w, "lin", bias, "bias"), "y", "float32", ["n", 24])
    sess = _session(b.model())
    x = rng.normal(size=(5, 40)).astype(np.float32) * np.array([[1e-3], [1.0], [50.0], [0.0], [7.0]], np.float32)
    y = sess.run(None, {"x": x})[0]
    w_q, scale = quantize_rows_int8(w)
    s = np.maximum(np.abs(x).max(axis=1, keepdims=True), 1e-30) / 127
    x_q = np.clip(np.rint(x / s), -128, 127)
    expected = (x_q @ w_q.astype(np.float32)) * s * scale + bias
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_array_equal(y[3], bias)     # a zero row
    for i in range(5):
        np.testing.assert_array_equal(sess.run(None, {"x": x[i:i + 1]})[0][0], y[i])


def _mixed(spec, bucket_pad=3):
    rng = np.random.default_rng(0)
    segs = [Segment(0, rng.integers(0, spec.vocab_size, 5), 7), Segment(1, rng.integers(0, spec.vocab_size, 1), 0),
            Segment(2, rng.integers(0, spec.vocab_size, 8), 12), Segment(3, rng.integers(0, spec.vocab_size, 1), 19)]
    return segs, [7, 0, 12, 19], sum(len(s.token_ids) for s in segs) + bucket_pad


def test_fused_float_graph_equals_the_standard_one(tiny_target):
    """The fused graph (contrib ops, fewer nodes) computes what the standard graph computes, to float rounding,
    on a mixed prefill/decode/verify batch and at the last positions (the RoPE table's end)."""
    std, spec = build_target_graph(tiny_target, TAPS, "fp32")
    fused, _ = build_target_graph(tiny_target, TAPS, "fp32", fused=True)
    assert len(fused.graph.node) < 0.65 * len(std.graph.node)
    segs, lens, bucket = _mixed(spec)
    past = _past(spec, 4, 24)
    feed = _feed(spec, segs, 4, lens, bucket, past)
    a, b = _run(_session(std), feed), _run(_session(fused), feed)
    assert set(a) == set(b)
    for name in a:
        assert a[name].shape == b[name].shape and np.abs(a[name] - b[name]).max() < 1e-4, name
    n = spec.max_position_embeddings
    last = [Segment(0, np.array([3, 4]), n - 2)]
    past = _past(spec, 1, n)
    feed = _feed(spec, last, 1, [n - 2], 2, past)
    a, b = _run(_session(std), feed), _run(_session(fused), feed)
    assert np.abs(a["logits"] - b["logits"]).max() < 1e-4


@pytest.mark.parametrize("weights", (*QUANT, W4A8, DEFAULT))
def test_quantized_graph_tracks_the_float_one(tiny_target, weights):
    std, spec = build_target_graph(tiny_target, TAPS, "fp32")
    quant, _ = build_target_graph(tiny_target, TAPS, weights)
    segs, lens, bucket = _mixed(spec)
    past = _past(spec, 4, 128)   # the quantized graph reads the cache in KEY_CHUNK chunks
    feed = _feed(spec, segs, 4, lens, bucket, past)
    a, b = _run(_session(std), feed), _run(_session(quant), feed)
    corr = np.corrcoef(a["logits"].ravel(), b["logits"].ravel())[0, 1]
    assert np.isfinite(b["logits"]).all() and corr > (0.95 if weights.startswith("int4") else 0.999), corr


@pytest.mark.parametrize("weights", ["int4", W4A8, DEFAULT, "int8", "w8a8", "fp32-fused"])
def test_a_rows_outputs_do_not_depend_on_its_batch_mates(tiny_llama, weights):
    """Request 0 alone (bucket 1 and padded to 8) and packed beside three others (prefill, verify and decode rows
    with large activations) gives the same logits, features and K/V to float rounding: every kernel is row-local
    (MatMulNBits accuracy_level 4 quantizes each activation row on its own)."""
    fmt, fused = (weights, None) if weights != "fp32-fused" else ("fp32", True)
    proto, spec = build_target_graph(tiny_llama, TAPS, fmt, fused)
    sess = _session(proto)
    rng = np.random.default_rng(3)
    past = _past(spec, 4, 128)
    mine = Segment(0, np.array([17]), 9)
    others = [Segment(1, rng.integers(0, spec.vocab_size, 8), 20),
              Segment(2, rng.integers(0, spec.vocab_size, 12), 0), Segment(3, rng.integers(0, spec.vocab_size, 1), 30)]
    alone = _run(sess, _feed(spec, [mine], 4, [9, 20, 0, 30], 1, past))
    padded = _run(sess, _feed(spec, [mine], 4, [9, 20, 0, 30], 8, past))
    packed = _run(sess, _feed(spec, [mine] + others, 4, [9, 20, 0, 30], 32, past))
    for out in (padded, packed):
        if weights in (*QUANT, W4A8, DEFAULT):  # exact attention sums (target.py): bitwise, not just to rounding
            for name in ("logits", "aux_hidden", "new_key.3"):
                np.testing.assert_array_equal(out[name][0], alone[name][0])
        assert np.abs(out["logits"][0] - alone["logits"][0]).max() <= 1e-5 * max(1.0, np.abs(alone["logits"]).max())
        assert np.abs(out["aux_hidden"][0] - alone["aux_hidden"][0]).max() <= 1e-5
        assert np.abs(out["new_key.3"][0] - alone["new_key.3"][0]).max() <= 1e-5


# (start, block capacity, decode capacity, block threads, decode threads, batch mate's past length in the block
# run / decode runs): the second layout has more than 256 keys (MLAS splits long GEMM reductions by thread
# layout), different capacities and thread counts per run, a batch mate far past the request, and a block whose
# new keys straddle a KEY_CHUNK boundary (start 124 + 7 rows)
LAYOUTS = {"short": (13, 128, 256, 2, 2, 4, 4), "straddle": (124, 256, 384, 2, 2, 4, 4),
           "long-other-capacity-threads": (300, 384, 640, 2, 1, 4, 500)}


@pytest.fixture(scope="module")
def tiny_mha():
    """One query head per key/value head (G = 1), D = 64: a decode pass's head group is a single GEMM row."""
    from tests.conftest import make_tiny_target

    return make_tiny_target("llama", seed=3, num_key_value_heads=4, head_dim=64)


@pytest.mark.parametrize("weights", (*QUANT, W4A8, DEFAULT))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_mha"])
def test_verification_rows_equal_decode_rows_bitwise(request, model, weights, layout):
    """One verification block of q tokens gives, row for row, the very logits, features and K/V that q one-token
    decode passes give over the same cache (each writing its key/value before the next), whatever the cache
    capacity and thread count of either run: the keys split differently between cache and pass, and only
    exact attention sums make the rows bitwise equal. Without this, MatMulNBits' int8 activation rows turn
    float-rounding differences into quantization steps and greedy speculative output leaves `ar`'s."""
    start, block_capacity, decode_capacity, block_threads, decode_threads, mate_block, mate_decode = LAYOUTS[layout]
    proto, spec = build_target_graph(request.getfixturevalue(model), TAPS, weights)
    rng = np.random.default_rng(5)
    q = 7
    full = _past(spec, 2, max(block_capacity, decode_capacity), seed=1)
    past = lambda cap: [(np.ascontiguousarray(k[:, :, :cap]), np.ascontiguousarray(v[:, :, :cap]))  # noqa: E731
                        for k, v in full]
    tokens = rng.integers(0, spec.vocab_size, q)
    mate = rng.integers(0, spec.vocab_size, 3)    # a batch mate in both runs: 3 rows beside the block, 1 beside
    block = _run(_session(proto, block_threads),  # a decode row (so a G = 1 decode pass has one-row head groups)
                 _feed(spec, [Segment(0, tokens, start), Segment(1, mate, mate_block)], 2, [start, mate_block], 16,
                       past(block_capacity)))
    sess, cache = _session(proto, decode_threads), past(decode_capacity)
    for j in range(q):
        segments = [Segment(0, tokens[j:j + 1], start + j), Segment(1, mate[:1], mate_decode)]
        out = _run(sess, _feed(spec, segments, 2, [start + j, mate_decode], 2, cache))
        for name in ("logits", "aux_hidden"):
            np.testing.assert_array_equal(out[name][0], block[name][j], err_msg=f"{name} row {j}")
        for layer, (k, v) in enumerate(cache):
            np.testing.assert_array_equal(out[f"new_key.{layer}"][0], block[f"new_key.{layer}"][j])
            k[0, :, start + j], v[0, :, start + j] = out[f"new_key.{layer}"][0], out[f"new_value.{layer}"][0]


# -- engine directories ----------------------------------------------------------------------------------

BUCKETS = dict(target_buckets=(1, 2, 4, 8, 16, 32, 64), request_buckets=(1, 2, 4), max_context=96,
               profile_context=16, profile_repeats=2, block_size=4, markov_rank=8)
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41], [100] * 11, [7, 3, 9, 200, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module", params=(*QUANT, "int4-matmulnbits"))
def quant_engine_dir(request, build_tiny_engine_dir):
    # drafter layers in w8a8 as the shipped drafter builds them, so spec == ar covers both quantized graphs;
    # int4 runs on both kernels (`--int4-kernel`: the default w4a8 and ONNX Runtime's MatMulNBits), and the
    # MatMulNBits build also keeps standard ops for MarkovDraft's greedy slots and the target's attention
    # (`--markov-draft-kernel onnx --attention-kernel onnx`)
    weights, _, kernel = request.param.partition("-")
    onnx_ops = "onnx" if kernel else "cpu"
    return weights, build_tiny_engine_dir(f"engines-{request.param}", weights=weights, drafter_weights="w8a8",
                                          int4_kernel=kernel or "w4a8", markov_draft_kernel=onnx_ops,
                                          attention_kernel=onnx_ops, **BUCKETS)


@pytest.fixture(scope="module")
def float_engine_dir(build_tiny_engine_dir):
    return build_tiny_engine_dir("engines-fp32", weights="fp32", **BUCKETS)


def _generate(rt, policy, prompts=PROMPTS, max_new=24):
    from dspark_export.runtime.request import SamplingParams

    rt.set_policy(policy)
    return rt.generate_ids(prompts, [SamplingParams(max_new_tokens=max_new) for _ in prompts])


def test_builds_refuse_contexts_beyond_the_exact_attention():
    """Past EXACT_MAX_KEYS keys the chunk sum is no longer one MLAS reduction: a quantized build with a longer
    context is refused by name (what to pass instead); fp32 has no such limit."""
    from dspark_export.exporter.quantize import EXACT_MAX_KEYS, check_exact_context

    check_exact_context("int4", EXACT_MAX_KEYS - 256, 256)
    check_exact_context("fp32", 2 * EXACT_MAX_KEYS, 256)
    with pytest.raises(ConfigError, match=r"max_context: 16200 .* --max-context <= 16128 or --weights fp32"):
        check_exact_context("int4", 16200, 256)


def test_profile_records_the_attended_keys(quant_engine_dir, float_engine_dir):
    """The layout each bucket was timed at records the key entries the pass attends: the KV capacity, as the
    runtime's cache holds it (`quantize.aligned`: a multiple of KEY_CHUNK with room for the past and the
    padded query width), for fp32 and the quantized graphs alike."""
    import json

    from dspark_export.exporter.quantize import aligned

    weights, engine_dir = quant_engine_dir
    for folder in (engine_dir, float_engine_dir):
        sps = json.loads((folder / "profile" / "sps.json").read_text())
        ctx = sps["context_len"]
        for row in sps["target"]:
            assert row["P"] == aligned(max(ctx + sps["block_size"] + 1, ctx + row["Q"])), (folder.name, row)
        for row in sps["attention"]["layouts"]:
            assert row["P"] % 128 == 0, row
        if sps["attention"].get("live_entries_only"):   # RaggedAttention: padding costs nothing, no layout fit
            assert sps["attention"]["layouts"] == [] and sps["attention"]["ms_per_slot_entry"] == 0
            assert "dspark.cpu::RaggedAttention" in json.loads((folder / "manifest.json").read_text())["plugins"]
        else:
            assert len({row["P"] for row in sps["attention"]["layouts"]}) >= 2   # the fit needs two capacities


@pytest.mark.parametrize("policy", ["fixed:4", "fixed:1", "threshold:0.4", "dspark", "dspark-async"])
def test_greedy_speculative_equals_ar_on_quantized_engines(quant_engine_dir, policy):
    from dspark_export.runtime.api import Runtime

    _, engine_dir = quant_engine_dir
    rt = Runtime.open(engine_dir, policy="ar")
    ar = _generate(rt, "ar")
    assert sum(len(r.token_ids) for r in ar) > 40
    assert [r.token_ids for r in _generate(rt, policy)] == [r.token_ids for r in ar]
    solo = [_generate(rt, policy, [p])[0].token_ids for p in PROMPTS]
    assert solo == [r.token_ids for r in ar]


def test_quantized_engine_directory(quant_engine_dir, float_engine_dir):
    """The manifest records the format, the drafter embeds from the target's quantized table (pointing into
    target.onnx.data, no float copy anywhere) and the directory is smaller than the float one."""
    from onnx.external_data_helper import uses_external_data

    from dspark_export.engines.manifest import Manifest

    weights, engine_dir = quant_engine_dir
    m = Manifest.load(engine_dir)
    assert m.data["graphs"]["target"]["spec"]["weights"] == weights
    w4a8 = weights == "int4" and m.data["build_config"]["int4_kernel"] == "w4a8"
    cpu_attention = m.data["build_config"]["attention_kernel"] == "cpu"
    assert ("dspark.cpu::RaggedAttention" in m.data["plugins"]) == cpu_attention
    assert cpu_ops.graph_uses_cpu_ops(engine_dir / "graphs" / "target.onnx") == (w4a8 or cpu_attention)
    assert ("dspark.cpu::MatMulW4A8" in m.data["plugins"]) == w4a8
    cpu_greedy = m.data["build_config"]["markov_draft_kernel"] == "cpu"
    assert ("dspark.cpu::MarkovDraftGreedy" in m.data["plugins"]) == cpu_greedy
    assert cpu_ops.graph_uses_cpu_ops(engine_dir / "graphs" / "drafter_block.onnx") == (cpu_greedy or w4a8)
    block = onnx.load(str(engine_dir / "graphs" / "drafter_block.onnx"), load_external_data=False)
    [gather] = [n for n in block.graph.node if n.op_type == "GatherBlockQuantized"]
    shared = {i.name: {e.key: e.value for e in i.external_data} for i in block.graph.initializer
              if uses_external_data(i)}
    assert shared[gather.input[0]]["location"] == "target.onnx.data"
    assert shared[gather.input[2]]["location"] == "target.onnx.data"
    for graph in ("target", "drafter_block"):
        names = {i.name for i in onnx.load(str(engine_dir / "graphs" / f"{graph}.onnx"),
                                           load_external_data=False).graph.initializer}
        assert "model.embed_tokens.weight" not in names
    size = lambda d: sum(f.stat().st_size for f in d.rglob("*.data"))  # noqa: E731
    assert size(engine_dir) < 0.6 * size(float_engine_dir)


# -- choices and bad input -------------------------------------------------------------------------------

def test_unknown_int4_kernel_is_named(tmp_path, capsys):
    from dspark_export.cli import main
    from dspark_export.pipeline import BuildConfig

    with pytest.raises(ConfigError, match=r"int4_kernel.*\['w4a8', 'matmulnbits'\].*'mlas'"):
        BuildConfig(out=tmp_path / "x", int4_kernel="mlas")
    with pytest.raises(SystemExit):
        main(["build", "--out", str(tmp_path / "y"), "--int4-kernel", "mlas"])
    assert "--int4-kernel" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_unknown_weight_format_is_named(tmp_path):
    from dspark_export.pipeline import BuildConfig

    with pytest.raises(ConfigError, match=r"'int3'.*\['fp32', 'int4', 'int8', 'w8a8'\]"):
        WeightFormat("int3")
    with pytest.raises(ConfigError, match="q4_0"):
        BuildConfig(out=tmp_path / "x", weights="q4_0")


def test_cli_refuses_an_unknown_weight_format(capsys):
    from dspark_export.cli import main

    with pytest.raises(SystemExit) as e:
        main(["build", "--out", "x", "--weights", "q4"])
    assert e.value.code == 2 and "q4" in capsys.readouterr().err


def test_imported_drafter_keeps_a_float_target_unless_asked(tmp_path):
    from dspark_export.exporter.quantize import DEFAULT_WEIGHTS
    from dspark_export.pipeline import BuildConfig, resolved_weights

    assert resolved_weights(BuildConfig(out=tmp_path / "a")) == DEFAULT_WEIGHTS
    assert resolved_weights(BuildConfig(out=tmp_path / "a", drafter="untrained")) == DEFAULT_WEIGHTS
    assert resolved_weights(BuildConfig(out=tmp_path / "a", drafter="/ckpt/deepspec")) == "fp32"
    assert resolved_weights(BuildConfig(out=tmp_path / "a", drafter="/ckpt/deepspec", weights="int8")) == "int8"


def test_gguf_type_we_cannot_dequantize_is_named(tmp_path):
    """A GGUF holding a tensor in a type the gguf package cannot dequantize (Q8_1) is refused before loading,
    naming the tensor, the type and what to pass instead."""
    import gguf

    from dspark_export.modeling.target import load_target

    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
    w.add_tensor("token_embd.weight", np.zeros((4, 64 // block * size), np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"'token_embd.weight'.*Q8_1.*Q8_0"):
        load_target(path)


@pytest.mark.parametrize("weights, op", [("int4", "MatMulNBits"), (W4A8, "MatMulW4A8"), (DEFAULT, "MatMulW4A8"),
                                        ("w8a8", "MatMulIntegerToFloat")])
def test_tensorrt_lowering_refuses_a_quantized_graph_by_name(tiny_llama, weights, op):
    from dspark_export.engines.trt.lowering import lower_model
    from dspark_export.errors import BuildError

    proto, _ = build_target_graph(tiny_llama, TAPS, weights)
    with pytest.raises(BuildError, match=rf"{op}.*w8a8.*--weights fp32"):
        lower_model(proto, "target")


def test_engine_features_on_quantized_engines_equal_a_pass_over_a_longer_cache(quant_engine_dir):
    """`EngineFeatures` (the drafter's training features) runs the quantized target over an empty cache of
    aligned(T) entries (its exact attention places the T new keys inside the cache's key axis); the features
    equal, bit for bit, a pass over a cache one chunk longer, for sequences inside one chunk and across one."""
    from dspark_export.engines.target_features import EngineFeatures
    from dspark_export.exporter.quantize import aligned

    _, engine_dir = quant_engine_dir
    source = EngineFeatures(engine_dir, threads=1)
    runner = source.session
    for T in sorted({1, 60, min(200, source.max_tokens)}):
        tokens = np.random.default_rng(T).integers(0, 256, T)
        aux, last = source.features(tokens)
        rows = np.arange(T, dtype=np.int64)
        empty = np.zeros((1, source._kv_heads, aligned(T) + 128, source._head_dim), np.float32)
        feed = {"input_ids": tokens.astype(np.int64), "position_ids": rows, "query_start": np.array([0, T]),
                "cache_lens": np.zeros(1, np.int64), "pad_index": rows[None, :], "logit_rows": rows,
                **{f"past_{kv}.{l}": empty for l in range(source._layers) for kv in ("key", "value")}}
        np.testing.assert_array_equal(runner.run(["aux_hidden"], feed)[0], aux)
        assert aux.shape[0] == T and last.shape == (T, source.hidden_size)


def test_int8_gemm_saturation_is_read_from_the_cpu_flags(monkeypatch, tmp_path):
    """`int8_gemm_saturates`: x86-64 without a VNNI/AMX-INT8 flag saturates, with one it does not; other
    architectures are not judged."""
    import builtins
    import platform

    from dspark_export.exporter import quantize

    real_open = builtins.open

    def cpuinfo(flags):
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        return lambda p, *a, **k: real_open(path if p == "/proc/cpuinfo" else p, *a, **k)

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(builtins, "open", cpuinfo("fpu sse avx2 avx512f"))
    assert quantize.int8_gemm_saturates()
    monkeypatch.setattr(builtins, "open", cpuinfo("fpu avx2 avx512f avx512_vnni"))
    assert not quantize.int8_gemm_saturates()
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert not quantize.int8_gemm_saturates()


@pytest.mark.parametrize("policy", ["ar", "fixed:4", "dspark-async"])
def test_prefill_beside_decode_rows_shares_one_pass_with_ragged_attention(quant_engine_dir, policy):
    """Continuous batching on the quantized engines: a prompt admitted while another request decodes is
    prefilled in the same target pass when the target's attention is `dspark.cpu::RaggedAttention` (it reads
    each request's own rows and live entries, so nothing pads), and in a pass of its own over a trimmed slot
    with the ONNX-op attention (`EngineStages.split_passes`). Either way every request's output equals its
    solo `ar` run."""
    from dspark_export.runtime.api import Runtime
    from dspark_export.runtime.generator import Generator
    from dspark_export.runtime.policies import parse_policy
    from dspark_export.runtime.request import SamplingParams

    _, engine_dir = quant_engine_dir
    rt = Runtime.open(engine_dir, policy="ar")
    ragged = rt.engines.ragged_attention("target")
    assert ragged == ("matmulnbits" not in str(engine_dir))       # that build keeps the ONNX-op attention
    prompts = [[40, 41], [100] * 11, list(range(3, 30)), [7, 3, 9, 200]]
    solo = [_generate(rt, "ar", [p])[0].token_ids for p in prompts]
    gen = Generator(rt.engines, parse_policy(policy), max_slots=2)
    passes, real = [], gen.stages.infer

    def infer(runner, feed):
        if runner.key.graph == "target":
            passes[-1].append(len(feed["cache_lens"]))
        return real(runner, feed)

    gen.stages.infer = infer
    ids = [gen.submit(p, SamplingParams(max_new_tokens=24)) for p in prompts]
    mixed = 0
    while gen.has_work():
        admitted = bool(gen.batch.waiting) or any(not s.decoding for s in gen.batch.active())
        decoding = any(s.decoding for s in gen.batch.active())
        passes.append([])
        gen.step()
        mixed += admitted and decoding
    assert mixed >= 2
    if ragged:
        assert all(len(p) <= 1 for p in passes), passes          # every step: at most one pass, over every slot
    else:
        assert [2, 1] in passes, passes                          # a long chunk: shared pass + its own slot
    assert [gen.result(i).token_ids for i in ids] == solo
