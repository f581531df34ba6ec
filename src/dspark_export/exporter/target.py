"""Export a transformers Llama/Qwen2/Qwen3 causal LM to the canonical ragged target graph.

One graph serves prefill, decode and ragged verification of R requests with different past
lengths and query lengths (docs/ARCHITECTURE.md, "target.onnx").

I/O contract (R requests, N packed tokens, Q padded query width, P cache length, M logit rows,
F = m·H tapped features, l = 0..L-1):

| name | shape | dtype | meaning |
| --- | --- | --- | --- |
| in `input_ids` | [N] | int64 | packed new tokens, request after request |
| in `position_ids` | [N] | int64 | absolute position of each packed token |
| in `query_start` | [R+1] | int64 | cumulative query lengths (request r owns rows query_start[r]..query_start[r+1]-1) |
| in `cache_lens` | [R] | int64 | valid past entries per request |
| in `pad_index` | [R, Q] | int64 | packed row of padded slot (r, j); any valid row where j ≥ q_r |
| in `logit_rows` | [M] | int64 | packed rows whose logits are returned |
| in `past_key.{l}` | [R, kvH, P, D] | float32 | key cache (RoPE applied); entries ≥ cache_lens[r] ignored |
| in `past_value.{l}` | [R, kvH, P, D] | float32 | value cache |
| out `logits` | [M, V] | float32 | logits of the rows asked for |
| out `aux_hidden` | [N, F] | float32 | raw outputs of the tapped layers (pre-final-norm), in tap order |
| out `new_key.{l}` | [N, kvH, D] | float32 | this step's keys (RoPE applied) |
| out `new_value.{l}` | [N, kvH, D] | float32 | this step's values |

The cache is read, never copied: the runtime writes `new_key/new_value` rows into its own buffers
(O(N) per step). RoPE angles are computed from `position_ids` in the graph, so any position up to
max_position_embeddings-1 is exact (no table baked at an export length).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from ..errors import ExportError
from .builder import (GraphBuilder, apply_rope, linear, rms_norm, rope_cos_sin, save_model,
                      swiglu_mlp, two_part_attention)

__all__ = ["TargetGraphSpec", "build_target_graph", "export_target", "target_io_contract"]

SUPPORTED_ACT = ("silu",)


@dataclass(frozen=True)
class TargetGraphSpec:
    """Static facts about an exported target graph, recorded in the manifest."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    tap_layer_ids: tuple[int, ...]

    @property
    def feature_size(self) -> int:
        return self.hidden_size * len(self.tap_layer_ids)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tap_layer_ids"] = list(self.tap_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TargetGraphSpec":
        return cls(**{**d, "tap_layer_ids": tuple(d["tap_layer_ids"])})


def target_io_contract(spec: TargetGraphSpec) -> dict[str, list[tuple[str, tuple, str]]]:
    """The module docstring's table as data: {"inputs": [(name, shape, dtype)], "outputs": [...]}."""
    kv = ("R", spec.num_kv_heads, "P", spec.head_dim)
    new_kv = ("N", spec.num_kv_heads, spec.head_dim)
    inputs = [("input_ids", ("N",), "int64"), ("position_ids", ("N",), "int64"),
              ("query_start", ("R+1",), "int64"), ("cache_lens", ("R",), "int64"),
              ("pad_index", ("R", "Q"), "int64"), ("logit_rows", ("M",), "int64")]
    outputs = [("logits", ("M", spec.vocab_size), "float32"),
               ("aux_hidden", ("N", spec.feature_size), "float32")]
    for layer in range(spec.num_layers):
        inputs += [(f"past_key.{layer}", kv, "float32"), (f"past_value.{layer}", kv, "float32")]
        outputs += [(f"new_key.{layer}", new_kv, "float32"), (f"new_value.{layer}", new_kv, "float32")]
    return {"inputs": inputs, "outputs": outputs}


def _spec_from_model(model, tap_layer_ids) -> TargetGraphSpec:
    cfg = model.config
    act = getattr(cfg, "hidden_act", "silu")
    if act not in SUPPORTED_ACT:
        raise ExportError(f"target hidden_act: expected one of {SUPPORTED_ACT}, found {act!r}")
    n_layers = cfg.num_hidden_layers
    taps = tuple(int(t) for t in tap_layer_ids)
    if any(not -1 <= t < n_layers - 1 for t in taps) or list(taps) != sorted(set(taps)):
        raise ExportError(f"tap_layer_ids: expected strictly increasing ids in {{-1}} ∪ [0, {n_layers - 2}] (-1: the "
                          f"embedding output; the last layer's output is post-norm in HF and never tapped), found "
                          f"{list(taps)}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return TargetGraphSpec(n_layers, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                           cfg.hidden_size, cfg.vocab_size, cfg.max_position_embeddings, taps)


def _rope(model) -> tuple[np.ndarray, float]:
    rotary = model.model.rotary_emb
    return rotary.inv_freq.detach().float().numpy(), float(getattr(rotary, "attention_scaling", 1.0))


def _unpad_index(b: GraphBuilder) -> str:
    """[N] flat padded index r·Q + j of each packed row n (r = its request, j = its offset)."""
    n = b.op("Shape", ["input_ids"], "unpad")
    rows = b.op("Range", [b.const(0), b.op("Squeeze", [n, b.const([0])], "unpad"), b.const(1)], "unpad")
    ends = b.op("Slice", ["query_start", b.const([1]), b.const([2 ** 62])], "unpad")  # [R]
    # request of row n = number of requests whose end ≤ n
    le = b.op("LessOrEqual", [b.op("Unsqueeze", [ends, b.const([0])], "unpad"),
                              b.op("Unsqueeze", [rows, b.const([1])], "unpad")], "unpad")  # [N,R]
    req = b.op("ReduceSum", [b.op("Cast", [le], "unpad", to=onnx.TensorProto.INT64), b.const([1])],
               "unpad", keepdims=0)
    offset = b.op("Sub", [rows, b.op("Gather", ["query_start", req], "unpad", axis=0)], "unpad")
    q_width = b.op("Slice", [b.op("Shape", ["pad_index"], "unpad"), b.const([1]), b.const([2])], "unpad")
    return b.op("Add", [b.op("Mul", [req, q_width], "unpad"), offset], "unpad")


def _layer(b, sd, spec: TargetGraphSpec, i: int, h: str, ctx: dict, eps: float) -> tuple[str, str, str]:
    """One decoder layer on packed rows h [N, H]; returns (h, new_key, new_value)."""
    p, name = f"model.layers.{i}", f"layers.{i}"
    nh, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    x = rms_norm(b, h, b.weight(f"{p}.input_layernorm.weight", sd[f"{p}.input_layernorm.weight"]), eps,
                 f"{name}/input_layernorm")
    proj = {}
    for t, heads in (("q", nh), ("k", nkv), ("v", nkv)):
        key = f"{p}.self_attn.{t}_proj"
        y = linear(b, x, f"{key}.weight", sd[f"{key}.weight"], f"{name}/attn/{t}_proj",
                   sd.get(f"{key}.bias"), f"{key}.bias")
        y = b.op("Reshape", [y, b.const([-1, heads, d])], f"{name}/attn/{t}_proj")
        norm_key = f"{p}.self_attn.{t}_norm.weight"
        if t != "v" and norm_key in sd:  # Qwen3 per-head RMSNorm before RoPE
            y = rms_norm(b, y, b.weight(norm_key, sd[norm_key]), eps, f"{name}/attn/{t}_norm")
        if t != "v":
            y = apply_rope(b, y, ctx["cos"], ctx["sin"], d, f"{name}/attn/{t}_rope")
        proj[t] = y
    pad = lambda t: b.op("Gather", [proj[t], "pad_index"], f"{name}/attn/pad_{t}", axis=0)  # noqa: E731
    attn = two_part_attention(b, pad("q"), pad("k"), pad("v"), f"past_key.{i}", f"past_value.{i}",
                              "cache_lens", (nh, nkv, d), True, f"{name}/attn")
    attn = b.op("Reshape", [attn, b.const([-1, nh * d])], f"{name}/attn")
    attn = b.op("Gather", [attn, ctx["unpad"]], f"{name}/attn/unpad", axis=0)
    o_key = f"{p}.self_attn.o_proj"
    attn = linear(b, attn, f"{o_key}.weight", sd[f"{o_key}.weight"], f"{name}/attn/o_proj",
                  sd.get(f"{o_key}.bias"), f"{o_key}.bias")
    h = b.op("Add", [h, attn], f"{name}/attn_residual")
    x = rms_norm(b, h, b.weight(f"{p}.post_attention_layernorm.weight", sd[f"{p}.post_attention_layernorm.weight"]),
                 eps, f"{name}/post_attention_layernorm")
    h = b.op("Add", [h, swiglu_mlp(b, x, sd, f"{p}.mlp", f"{name}/mlp")], f"{name}/mlp_residual")
    return h, proj["k"], proj["v"]


def build_target_graph(model, tap_layer_ids) -> tuple[onnx.ModelProto, TargetGraphSpec]:
    """Build the target graph from a transformers causal LM (fp32).

    Args:
        model: a `LlamaForCausalLM`/`Qwen2ForCausalLM`/`Qwen3ForCausalLM` (any dtype; weights are cast to fp32).
        tap_layer_ids: decoder layers whose raw outputs form `aux_hidden`, in order.
    Returns:
        (onnx.ModelProto, TargetGraphSpec).
    Raises:
        ExportError: unsupported activation or invalid taps.
    """
    spec = _spec_from_model(model, tap_layer_ids)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    eps = float(model.config.rms_norm_eps)
    b = GraphBuilder("target")
    for name, shape, dtype in target_io_contract(spec)["inputs"]:
        b.input(name, dtype, shape)
    embed = b.weight("model.embed_tokens.weight", sd["model.embed_tokens.weight"])
    h = b.op("Gather", [embed, "input_ids"], "embed_tokens", axis=0)
    inv_freq, scaling = _rope(model)
    cos, sin = rope_cos_sin(b, "position_ids", inv_freq, scaling)
    ctx = {"cos": cos, "sin": sin, "unpad": _unpad_index(b)}
    taps, new_kv = ([h] if -1 in spec.tap_layer_ids else []), []   # -1: the embedding output (DeepSpec)
    for i in range(spec.num_layers):
        h, k, v = _layer(b, sd, spec, i, h, ctx, eps)
        new_kv.append((k, v))
        if i in spec.tap_layer_ids:
            taps.append(h)
    aux = b.op("Concat", taps, "aux_hidden", axis=-1) if len(taps) > 1 else taps[0]
    rows = b.op("Gather", [h, "logit_rows"], "logit_rows", axis=0)
    normed = rms_norm(b, rows, b.weight("model.norm.weight", sd["model.norm.weight"]), eps, "norm")
    tied = "lm_head.weight" not in sd or np.array_equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    head = embed if tied else b.weight("lm_head.weight", sd["lm_head.weight"])
    logits = b.op("Gemm", [normed, head], "lm_head", transB=1)
    b.output(logits, "logits", "float32", ["M", spec.vocab_size])
    b.output(aux, "aux_hidden", "float32", ["N", spec.feature_size])
    for i, (k, v) in enumerate(new_kv):
        b.output(k, f"new_key.{i}", "float32", ["N", spec.num_kv_heads, spec.head_dim])
        b.output(v, f"new_value.{i}", "float32", ["N", spec.num_kv_heads, spec.head_dim])
    return b.model(doc="dspark-export target graph (docs/ARCHITECTURE.md: target.onnx)"), spec


def export_target(model, tap_layer_ids, path: Path) -> tuple[list[Path], TargetGraphSpec]:
    """Build the target graph and write it to `path` (+ `path`.data). Returns (files, spec)."""
    with torch.no_grad():
        proto, spec = build_target_graph(model, tap_layer_ids)
    return save_model(proto, path), spec
