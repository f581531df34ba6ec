"""Target graph: I/O contract and parity with transformers (prefill, decode, verify, mixed batches)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from transformers import DynamicCache

from dspark_export.engines.packing import Segment, pack_segments
from dspark_export.errors import ExportError
from dspark_export.exporter.target import build_target_graph, target_io_contract

TAPS = (1, 2)


def _session(model, taps=TAPS):
    proto, spec = build_target_graph(model, taps)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"]), spec, proto


def _hf_reference(model, seq: torch.Tensor, past: int, taps=TAPS):
    """Logits / tapped features of rows past.. of `seq`, and the HF KV cache after `past` tokens."""
    with torch.no_grad():
        full = model(seq[None], output_hidden_states=True)
        cache = DynamicCache()
        if past:
            model(seq[None, :past], cache=cache, use_cache=True)
    # hidden_states[0] is the embedding output (tap -1), hidden_states[t + 1] layer t's raw output
    feats = torch.cat([full.hidden_states[t + 1][0, past:] for t in taps], -1).numpy()
    return full.logits[0, past:].numpy(), feats, cache


def _run_mixed(model, requests, positions_offset=0, seed=0, taps=TAPS):
    """requests: [(past_len, query_len)]; returns max abs logits / feature error over all rows."""
    sess, spec, _ = _session(model, taps)
    rng = np.random.default_rng(seed)
    R, P = len(requests), max(p for p, _ in requests) + 3
    keys = [np.zeros((R, spec.num_kv_heads, P, spec.head_dim), np.float32) for _ in range(spec.num_layers)]
    values = [np.zeros_like(k) for k in keys]
    segments, refs = [], []
    for r, (p, q) in enumerate(requests):
        seq = torch.tensor(rng.integers(0, spec.vocab_size, p + q))
        logits, feats, cache = _hf_reference(model, seq, p, taps)
        for layer in range(spec.num_layers if p else 0):
            keys[layer][r, :, :p] = cache.layers[layer].keys[0].numpy()
            values[layer][r, :, :p] = cache.layers[layer].values[0].numpy()
        segments.append(Segment(r, seq[p:].numpy(), p))
        refs.append((logits, feats))
    total = sum(q for _, q in requests)
    packed = pack_segments(segments, R, np.array([p for p, _ in requests]), total + 3)  # 3 padding rows
    feed = dict(packed.feed)
    for layer in range(spec.num_layers):
        feed[f"past_key.{layer}"], feed[f"past_value.{layer}"] = keys[layer], values[layer]
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
    err_l = err_f = 0.0
    for r, (p, q) in enumerate(requests):
        a, la = packed.row_start[r], packed.logit_start[r]
        err_l = max(err_l, np.abs(out["logits"][la:la + q] - refs[r][0]).max())
        err_f = max(err_f, np.abs(out["aux_hidden"][a:a + q] - refs[r][1]).max())
    return err_l, err_f


@pytest.mark.parametrize("requests", [
    [(0, 6)],                        # prompt with empty past
    [(9, 1)],                        # one token with past
    [(5, 8)],                        # k+1 tokens with past (verification)
    [(0, 5), (7, 1), (3, 4), (10, 8)],  # mixed: prefill, decode, verify in one pass
], ids=["prefill", "decode", "verify", "mixed"])
def test_parity_with_transformers(tiny_target, requests):
    err_l, err_f = _run_mixed(tiny_target, requests)
    assert err_l < 1e-4 and err_f < 1e-4, (err_l, err_f)


def test_embedding_tap_minus_one_is_the_embedding_output(tiny_target):
    """DeepSpec's target_layer_ids may hold -1, the embedding output (its eval reads hidden_states[0]): the
    graph's aux_hidden starts with it, equal to transformers' on every row of a mixed batch."""
    err_l, err_f = _run_mixed(tiny_target, [(0, 5), (7, 1), (3, 4)], taps=(-1, 1))
    assert err_l < 1e-4 and err_f < 1e-4, (err_l, err_f)
    with pytest.raises(ExportError, match=r"tap_layer_ids.*\{-1\}"):
        build_target_graph(tiny_target, [-2, 1])


def test_positions_up_to_max_position_embeddings(tiny_llama):
    """RoPE angles come from position_ids: a request at the last positions matches HF exactly."""
    sess, spec, _ = _session(tiny_llama)
    n = spec.max_position_embeddings
    seq = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    logits, _, cache = _hf_reference(tiny_llama, seq, n - 2)
    keys = [c.keys.numpy() for c in cache.layers]
    vals = [c.values.numpy() for c in cache.layers]
    packed = pack_segments([Segment(0, seq[n - 2:].numpy(), n - 2)], 1, np.array([n - 2]), 2)
    feed = dict(packed.feed)
    for layer in range(spec.num_layers):
        feed[f"past_key.{layer}"], feed[f"past_value.{layer}"] = keys[layer], vals[layer]
    out = sess.run(["logits"], feed)[0]
    assert np.abs(out - logits).max() < 1e-4


def test_graph_matches_contract_table(tiny_qwen3):
    _, spec, proto = _session(tiny_qwen3)
    onnx.checker.check_model(proto, full_check=True)
    contract = target_io_contract(spec)

    def dims(vi):
        return tuple(d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim)

    names = {"float32": onnx.TensorProto.FLOAT, "int64": onnx.TensorProto.INT64}
    for kind, values in (("inputs", proto.graph.input), ("outputs", proto.graph.output)):
        got = [(v.name, dims(v), v.type.tensor_type.elem_type) for v in values]
        want = [(n, tuple(s), names[t]) for n, s, t in contract[kind]]
        assert got == want
    # the module docstring's table lists every non-layer name
    from dspark_export.exporter import target as mod
    for name, _, _ in contract["inputs"] + contract["outputs"]:
        assert f"`{name.split('.')[0]}" in mod.__doc__


def test_last_layer_tap_is_refused(tiny_llama):
    with pytest.raises(ExportError, match=r"tap_layer_ids.*\[0, 2\]"):
        build_target_graph(tiny_llama, [1, 3])
