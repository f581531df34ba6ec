"""Drafter graphs: contract tables and parity with the PyTorch drafter + the MarkovDraft reference."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from dspark_export.exporter.drafter import (build_drafter_graphs, drafter_block_io_contract,
                                            drafter_context_io_contract)
from dspark_export.modeling.config import DrafterConfig
from dspark_export.modeling.drafter import init_drafter
from dspark_export.modeling.target import wrap_target
from dspark_export.plugins.common.sampling import SamplingBatch
from dspark_export.plugins.markov_draft.reference import MarkovDraftWeights, markov_draft

GAMMA = 4


def _drafter(target_model, markov_rank=8, confidence=True, seed=0, with_markov=True):
    target = wrap_target(target_model, source="tiny")
    cfg = DrafterConfig.from_target(target.config, num_draft_layers=2, target_layer_ids=(1, 2), block_size=GAMMA,
                                    markov_rank=markov_rank, enable_confidence_head=confidence,
                                    confidence_head_with_markov=with_markov)
    drafter = init_drafter(target, cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # widen the init so drafts and confidences vary
        for name, p in drafter.named_parameters():
            if p.requires_grad and p.dim() >= 1:
                p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + torch.randn(p.shape, generator=g) * 0.2)
    return drafter.eval()


def _sessions(drafter):
    rope = (drafter.inv_freq.numpy(), float(drafter.attention_scaling))
    ctx, block, spec = build_drafter_graphs(drafter, rope)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    mk = lambda m: ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])  # noqa: E731
    return mk(ctx), mk(block), spec, ctx, block


def _run(sess, feed):
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))


@pytest.mark.parametrize("markov_rank,confidence,with_markov", [
    (8, True, True), (0, False, True), (8, False, True), (8, True, False), (0, True, True)],
    ids=["dspark", "dflash", "markov-only", "confidence-without-markov-input", "confidence-no-markov"])
def test_drafter_graphs_match_pytorch(tiny_target, markov_rank, confidence, with_markov):
    drafter = _drafter(tiny_target, markov_rank, confidence, with_markov=with_markov)
    s_ctx, s_block, spec, _, _ = _sessions(drafter)
    rng = np.random.default_rng(0)
    lens = np.array([5, 0, 9])
    R, P, L = len(lens), 12, spec.num_layers
    keys = [np.zeros((R, spec.num_kv_heads, P, spec.head_dim), np.float32) for _ in range(L)]
    vals = [np.zeros_like(k) for k in keys]
    for r, n in enumerate(lens):
        aux = rng.standard_normal((n, spec.feature_size)).astype(np.float32)
        pos = np.arange(n)
        if n == 0:
            continue
        out = _run(s_ctx, {"aux_hidden": aux, "position_ids": pos})
        with torch.no_grad():
            ref = drafter.context_kv(torch.from_numpy(aux), torch.from_numpy(pos))
        for i in range(L):
            np.testing.assert_allclose(out[f"context_key.{i}"], ref[i][0].numpy(), atol=1e-5)
            np.testing.assert_allclose(out[f"context_value.{i}"], ref[i][1].numpy(), atol=1e-5)
            keys[i][r, :, :n] = out[f"context_key.{i}"].transpose(1, 0, 2)
            vals[i][r, :, :n] = out[f"context_value.{i}"].transpose(1, 0, 2)
    anchors = np.array([7, 100, 3])
    sampling = SamplingBatch(np.array([0.0, 0.8, 1.2], np.float32), np.array([0, 5, 0]),
                              np.array([1.0, 1.0, 0.9], np.float32))
    uniforms = rng.random((R, GAMMA), dtype=np.float32)
    sts = np.array([1.0, 1.5, 0.7, 2.0], np.float32)
    feed = {"anchor_ids": anchors, "start_positions": lens, "context_lens": lens,
            "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "uniforms": uniforms, "confidence_temperature": sts}
    for i in range(L):
        feed[f"context_key.{i}"], feed[f"context_value.{i}"] = keys[i], vals[i]
    out = _run(s_block, feed)
    with torch.no_grad():
        hidden, base = drafter.forward_block(torch.from_numpy(anchors), torch.from_numpy(lens),
                                             [(torch.from_numpy(k), torch.from_numpy(v)) for k, v in zip(keys, vals)],
                                             torch.from_numpy(lens))
    np.testing.assert_allclose(out["hidden"], hidden.numpy(), atol=1e-4)
    sd = {k: v.detach().numpy() for k, v in drafter.state_dict().items()}
    w = sd["confidence_head.proj.weight"].reshape(-1) if confidence else None
    if confidence and markov_rank and not with_markov:
        w = np.concatenate([w, np.zeros(markov_rank, np.float32)])
    weights = MarkovDraftWeights(
        sd.get("markov_head.markov_w1.weight"), sd.get("markov_head.markov_w2.weight"),
        w, sd["confidence_head.proj.bias"] if confidence else None)
    ref = markov_draft(base.numpy(), hidden.numpy(), anchors, sampling, uniforms, sts, weights)
    np.testing.assert_array_equal(out["draft_ids"], ref.draft_ids)
    np.testing.assert_allclose(out["draft_logits"], ref.draft_logits, atol=1e-4)
    np.testing.assert_allclose(out["confidence"], ref.confidence, atol=1e-5)
    if confidence:  # the graph's confidence is the drafter's own head, σ(z / T_k)
        prev = torch.from_numpy(np.concatenate([anchors[:, None], ref.draft_ids[:, :-1]], 1))
        with torch.no_grad():
            z = drafter.confidence_logits(hidden, prev).numpy()
        np.testing.assert_allclose(out["confidence"], 1 / (1 + np.exp(-z / sts)), atol=1e-5)


def test_drafter_graphs_match_contract_tables(tiny_qwen3):
    drafter = _drafter(tiny_qwen3)
    *_, spec, ctx, block = _sessions(drafter)
    names = {"float32": onnx.TensorProto.FLOAT, "int64": onnx.TensorProto.INT64}

    def dims(vi):
        return tuple(d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim)

    for proto, contract in ((ctx, drafter_context_io_contract(spec)), (block, drafter_block_io_contract(spec))):
        onnx.checker.check_model(proto, full_check=True)
        for kind, values in (("inputs", proto.graph.input), ("outputs", proto.graph.output)):
            assert [(v.name, dims(v), v.type.tensor_type.elem_type) for v in values] == \
                   [(n, tuple(s), names[t]) for n, s, t in contract[kind]]
    from dspark_export.exporter import drafter as mod
    for name, _, _ in drafter_block_io_contract(spec)["inputs"] + drafter_block_io_contract(spec)["outputs"]:
        assert f"`{name.split('.')[0]}" in mod.__doc__


def test_int8_lm_head_tracks_fp32_and_is_batch_invariant(tiny_target):
    """The int8 head (per-row activation scales, per-vocabulary weight scales): base logits within a few per cent
    of the fp32 head's range, and a request's logits do not depend on which other requests share its batch."""
    from dspark_export.exporter.builder import GraphBuilder
    from dspark_export.exporter.drafter import int8_lm_head
    from dspark_export.exporter.quantize import quantize_rows_int8

    drafter = _drafter(tiny_target)
    weight = drafter.lm_head.weight.detach().numpy()
    w_q, scale = quantize_rows_int8(weight)
    assert w_q.dtype == np.int8 and w_q.shape == weight.T.shape and np.abs(w_q).max() == 127
    np.testing.assert_allclose(w_q.T * scale[:, None], weight, atol=float(scale.max()) / 2 + 1e-7)
    b = GraphBuilder("head")
    b.input("h", "float32", ["n", weight.shape[1]])
    b.output(int8_lm_head(b, "h", weight), "logits", "float32", ["n", weight.shape[0]])
    sess = ort.InferenceSession(b.model().SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    h = rng.standard_normal((5, weight.shape[1])).astype(np.float32)
    h[2] *= 100.0   # a loud row must not coarsen the others' quantization
    h[4] = 0.0
    (got,) = sess.run(None, {"h": h})
    exact = h @ weight.T
    for i in range(5):
        assert np.abs(got[i] - exact[i]).max() <= 0.03 * np.abs(exact[i]).max() + 1e-6, i
    for i in range(5):
        (alone,) = sess.run(None, {"h": h[i:i + 1]})
        np.testing.assert_array_equal(alone[0], got[i])
    assert not got[4].any()
    h[1, 3] = np.nan   # one NaN (or inf) element: the whole row is non-finite, as with the fp32 head
    h[3, 0] = np.inf
    (bad,) = sess.run(None, {"h": h})
    assert not np.isfinite(bad[1]).any() and not np.isfinite(bad[3]).any()
    np.testing.assert_array_equal(bad[[0, 2, 4]], got[[0, 2, 4]])   # and no other row changes


def test_block_graph_lm_head_dtype_choices(tiny_target):
    drafter = _drafter(tiny_target)
    rope = (drafter.inv_freq.numpy(), float(drafter.attention_scaling))
    from dspark_export.exporter.drafter import build_block_graph

    graphs = {d: build_block_graph(drafter, rope, None, d) for d in ("float32", "int8")}
    ops = {d: {n.op_type for n in g.graph.node} for d, g in graphs.items()}
    assert "MatMulInteger" in ops["int8"] and "MatMulInteger" not in ops["float32"] and "Gemm" not in ops["int8"]
    with pytest.raises(Exception, match="int4"):
        build_block_graph(drafter, rope, None, "int4")
