"""The fused drafter block (`exporter.drafter._fused_block_layers`) against the plain one on tiny models: the
default fused form gives the same bits with fewer nodes; the contrib form (SkipSimplifiedLayerNormalization,
RotaryEmbedding) the same greedy drafts and values to rounding; merged projections quantize to the same blocks."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from dspark_export.errors import ConfigError
from dspark_export.exporter.drafter import build_block_graph, build_context_graph

from test_draft_vocab import _block_feed, _run
from test_export_drafter import _drafter


def _session(model):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _blocks(drafter, layer_weights, fused=True, **kw):
    rope = (drafter.inv_freq.numpy(), float(drafter.attention_scaling))
    with torch.no_grad():
        ctx = build_context_graph(drafter, rope, layer_weights)
        plain = build_block_graph(drafter, rope, None, layer_weights=layer_weights, fused=False, **kw)
        fused = build_block_graph(drafter, rope, None, layer_weights=layer_weights, fused=fused, **kw)
    return _session(ctx), plain, fused


@pytest.mark.parametrize("fused", [True, "contrib"])
@pytest.mark.parametrize("layer_weights", ["float32", "int4", "w8a8"])
@pytest.mark.parametrize("d2t", [False, True], ids=["full", "d2t"])
def test_fused_block_equals_the_plain_one(tiny_target, layer_weights, d2t, fused):
    drafter = _drafter(tiny_target)
    vocab = drafter.config.vocab_size
    kw = {"lm_head_dtype": "int8", "d2t": np.random.default_rng(4).choice(vocab, 40, replace=False)} if d2t else {}
    s_ctx, plain, fused_graph = _blocks(drafter, layer_weights, fused, **kw)
    assert len(fused_graph.graph.node) < len(plain.graph.node)
    ops = {n.op_type for n in fused_graph.graph.node}
    assert "FusedMatMul" in ops and "QuickGelu" in ops
    assert ({"SkipSimplifiedLayerNormalization", "RotaryEmbedding"} <= ops) == (fused == "contrib")
    from dspark_export.exporter.drafter import _spec

    spec = _spec(drafter, kw.get("lm_head_dtype", "float32"), 40 if d2t else 0, layer_weights)
    s_plain, s_fused = _session(plain), _session(fused_graph)
    for temperature in (0.0, 0.8):
        for seed in range(3):
            feed = _block_feed(spec, s_ctx, temperature, seed)
            a, b = _run(s_plain, feed), _run(s_fused, feed)
            if fused is True:  # the same bits, sampled drafts included
                for name in a:
                    np.testing.assert_array_equal(b[name], a[name], err_msg=name)
                continue
            np.testing.assert_array_equal(b["draft_ids"], a["draft_ids"])
            np.testing.assert_allclose(b["draft_logits"], a["draft_logits"], rtol=0, atol=1e-4)
            np.testing.assert_allclose(b["confidence"], a["confidence"], rtol=0, atol=1e-5)
            np.testing.assert_allclose(b["hidden"], a["hidden"], rtol=0, atol=1e-4)


def test_fused_block_is_the_default_for_quantized_layers_only(tiny_llama):
    drafter = _drafter(tiny_llama)
    rope = (drafter.inv_freq.numpy(), float(drafter.attention_scaling))
    with torch.no_grad():
        ops = {w: {n.op_type for n in build_block_graph(drafter, rope, None, layer_weights=w).graph.node}
               for w in ("float32", "int8", "int4", "w8a8")}
    assert "FusedMatMul" not in ops["float32"] and "QuickGelu" not in ops["float32"]  # standard ONNX (TensorRT)
    assert "FusedMatMul" in ops["int4"] and "FusedMatMul" in ops["int8"] and "FusedMatMul" in ops["w8a8"]
    with pytest.raises(ConfigError, match="fused expected"):
        build_block_graph(drafter, rope, None, fused="yes")


def test_merged_projections_quantize_to_the_same_blocks(tiny_llama):
    """MatMulNBits quantizes each output column's blocks alone: q/k/v and gate/up merged hold the same bytes."""
    from onnx import numpy_helper

    drafter = _drafter(tiny_llama)
    _, plain, fused = _blocks(drafter, "int4")
    weights = lambda m: {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}  # noqa: E731
    wp, wf = weights(plain), weights(fused)
    cfg = drafter.config
    rows = {"q": cfg.num_attention_heads * cfg.head_dim, "k": cfg.num_key_value_heads * cfg.head_dim,
            "v": cfg.num_key_value_heads * cfg.head_dim}
    for i in range(cfg.num_hidden_layers):
        a = f"layers.{i}.self_attn"
        merged = wf[f"{a}.qkv_proj.weight_Q4"]
        parts = [wp[f"{a}.{t}_proj.weight_Q4"] for t in "qkv"]
        np.testing.assert_array_equal(merged, np.concatenate(parts, axis=0))
        assert sum(rows.values()) == merged.shape[0]
        m = f"layers.{i}.mlp"
        np.testing.assert_array_equal(wf[f"{m}.gate_up_proj.weight_Q4"],
                                      np.concatenate([wp[f"{m}.{t}_proj.weight_Q4"] for t in ("gate", "up")], axis=0))


@pytest.mark.parametrize("layer_weights", ["float32", "w8a8"])
def test_cpu_attention_block_drafts_as_the_onnx_one(tiny_target, layer_weights):
    """`attention="cpu"` (dspark.cpu::RaggedAttention, causal 0, one node a layer) against the fused block's ONNX
    attention: the same greedy drafts, values to float rounding (w8a8: up to its int8 activation steps)."""
    from dspark_export.exporter.drafter import _spec
    from dspark_export.plugins import cpu_ops

    drafter = _drafter(tiny_target)
    rope = (drafter.inv_freq.numpy(), float(drafter.attention_scaling))
    with torch.no_grad():
        s_ctx = _session(build_context_graph(drafter, rope, layer_weights))
        onnx_block = build_block_graph(drafter, rope, None, layer_weights=layer_weights, fused=True)
        cpu_block = build_block_graph(drafter, rope, None, layer_weights=layer_weights, fused=True, attention="cpu")
    assert sum(n.op_type == "RaggedAttention" for n in cpu_block.graph.node) == drafter.config.num_hidden_layers
    assert cpu_ops.graph_uses_cpu_ops(cpu_block) and not cpu_ops.graph_uses_cpu_ops(onnx_block)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    cpu_ops.register(so)
    s_cpu = ort.InferenceSession(cpu_block.SerializeToString(), so, providers=["CPUExecutionProvider"])
    spec = _spec(drafter, "float32", 0, layer_weights)
    tol = 1e-4 if layer_weights == "float32" else 0.05
    for seed in range(3):
        feed = _block_feed(spec, s_ctx, 0.0, seed)
        a, b = _run(_session(onnx_block), feed), _run(s_cpu, feed)
        np.testing.assert_allclose(b["hidden"], a["hidden"], rtol=0, atol=tol)
        if layer_weights == "float32":
            np.testing.assert_array_equal(b["draft_ids"], a["draft_ids"])
