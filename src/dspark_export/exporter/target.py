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
(O(N) per step). Quantized graphs (exact attention) also need P a positive multiple of KEY_CHUNK (128) and
max_r cache_lens[r] + Q ≤ P: they place the pass's keys at cache_lens[r] + j inside the cache's key axis
(`runtime.kv_cache.KVCache.feed` keeps both). RoPE angles are computed from `position_ids` in the graph, so any position up to
max_position_embeddings-1 is exact (no table baked at an export length).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from ..errors import ConfigError, ExportError
from ..plugins.cpu_ops import DOMAIN as CPU_DOMAIN, RAGGED_ATTENTION, ragged_attention_fits
from .builder import (NEG_INF, GraphBuilder, apply_rope, head_norm, linear, rms_norm, rope_cos_sin, rope_tables,
                      save_model, skip_rms_norm, swiglu_mlp, two_part_attention)
from .quantize import KEY_CHUNK, MS_DOMAIN, WeightFormat, gather_block_quantized, project

__all__ = ["TargetGraphSpec", "build_target_graph", "export_target", "target_io_contract", "ATTENTION_KERNELS"]

#: `build --attention-kernel`: what runs the quantized (fused) target's attention
ATTENTION_KERNELS = ("cpu", "onnx")

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
    weights: str = "fp32"  #: weight format (exporter/quantize.py: "fp32", "int4", "int8", "w8a8")

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


def _spec_from_model(model, tap_layer_ids, weights: str = "fp32") -> TargetGraphSpec:
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
                           cfg.hidden_size, cfg.vocab_size, cfg.max_position_embeddings, taps, weights)


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


def build_target_graph(model, tap_layer_ids, weights: str = "fp32", fused: bool | None = None,
                       attention: str = "onnx") -> tuple[onnx.ModelProto, TargetGraphSpec]:
    """Build the target graph from a transformers causal LM.

    Args:
        model: a `LlamaForCausalLM`/`Qwen2ForCausalLM`/`Qwen3ForCausalLM` (any dtype; weights are cast to fp32).
        tap_layer_ids: decoder layers whose raw outputs form `aux_hidden`, in order.
        weights: "fp32", "int4", "int8" or "w8a8" (exporter/quantize.py): the linear layers, LM head and embedding.
        fused: build the fused form (`_build_fused`: ONNX Runtime contrib ops, fewer nodes per layer).
            None = fused exactly when quantized, so the fp32 graph stays standard ONNX (the TensorRT path).
        attention: the fused form's attention: "onnx" (ONNX Runtime ops: `builder.two_part_attention`, or
            `_exact_attention` when quantized) or "cpu" (one `dspark.cpu::RaggedAttention` node a layer,
            `plugins/cpu_ops`: the same exact-order contract, reading only the live cache entries; head dims
            that are not a multiple of 16 up to 512 keep "onnx").
    Returns:
        (onnx.ModelProto, TargetGraphSpec).
    Raises:
        ExportError: unsupported activation or invalid taps.
        ConfigError: an unknown weight format or attention kernel.
    """
    fmt = WeightFormat(weights)
    if attention not in ATTENTION_KERNELS:
        raise ConfigError(f"target attention kernel: expected one of {list(ATTENTION_KERNELS)}, found {attention!r}")
    spec = _spec_from_model(model, tap_layer_ids, fmt.name)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    eps = float(model.config.rms_norm_eps)
    b = GraphBuilder("target")
    for name, shape, dtype in target_io_contract(spec)["inputs"]:
        b.input(name, dtype, shape)
    if fmt.quantized or fused:
        if fused is False:
            raise ExportError(f"target graph: weights {fmt.name} need the fused graph (its quantized ops are contrib ops)")
        return _build_fused(b, model, spec, sd, eps, fmt, attention), spec
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


def export_target(model, tap_layer_ids, path: Path, weights: str = "fp32",
                  attention: str = "onnx") -> tuple[list[Path], TargetGraphSpec]:
    """Build the target graph in weight format `weights` (fused forms: `attention`), write it to `path`
    (+ `path`.data); returns (files, spec)."""
    with torch.no_grad():
        proto, spec = build_target_graph(model, tap_layer_ids, weights, attention=attention)
    return save_model(proto, path), spec


# -- the fused graph ---------------------------------------------------------------------------------
# Same I/O contract, fewer nodes: the residual stream is [1, N, H] (ONNX Runtime's contrib ops want a
# batch axis), RMSNorm + residual add is one SkipSimplifiedLayerNormalization, RoPE one RotaryEmbedding per
# q and k over a [max_position_embeddings, D/2] table, q/k/v one projection + Split, gate/up one + Split,
# SiLU one QuickGelu (alpha 1), the attention's masks, shapes and split sizes are computed once for every
# layer, the 1/√D scale rides on FusedMatMul's alpha, and outputs are written by their last node (no
# Identity). Attention is the two-part ragged softmax of `builder.two_part_attention`, or with quantized
# weights `_exact_attention` (per-request past lengths; ONNX Runtime's GroupQueryAttention/MultiHeadAttention
# take neither a packed ragged batch with per-request past lengths nor a cache read in place).

def _to_output(b: GraphBuilder, op_type: str, inputs: list[str], output: str, dims: list, name: str,
               domain: str = "", **attrs) -> str:
    """A node whose only output is the graph output `output` (float32, `dims`)."""
    b.nodes.append(onnx.helper.make_node(op_type, inputs, [output], name=f"/{b.name}/{name}/{op_type}",
                                         domain=domain, **attrs))
    b.outputs.append(onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, dims))
    return output


def _attention_context(b: GraphBuilder, spec: TargetGraphSpec, exact: bool = False) -> dict:
    """Masks, shapes and indices every layer's attention shares (computed once per pass); with `exact`, also
    the canonical key layout of `_exact_attention`."""
    nkv, g, d = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
    n = "attn_shared"
    rq = b.op("Shape", ["pad_index"], n)                                       # [R, Q]
    r_dim = b.op("Slice", [rq, b.const([0]), b.const([1])], n)
    q_dim = b.op("Slice", [rq, b.const([1]), b.const([2])], n)
    p_dim = b.op("Slice", [b.op("Shape", ["past_key.0"], n), b.const([2]), b.const([3])], n)
    zero, neg = b.const(0.0, "float32"), b.const(NEG_INF, "float32")
    lens = b.op("Reshape", ["cache_lens", b.const([-1, 1, 1, 1])], n)
    q_scalar = b.op("Squeeze", [q_dim, b.const([0])], n)
    rows = b.op("Range", [b.const(0), b.op("Mul", [q_scalar, b.const(g)], n), b.const(1)], n)
    i = b.op("Unsqueeze", [b.op("Mod", [rows, q_scalar], n), b.const([1])], n)  # [G·Q, 1] query offset
    j = b.op("Range", [b.const(0), q_scalar, b.const(1)], n)                     # [Q]
    ctx = {
        "q5": b.op("Concat", [rq, b.const([nkv, g, d])], n, axis=0),             # [R,Q,kvH,G,D]
        "kv4": b.op("Concat", [rq, b.const([nkv, d])], n, axis=0),               # [R,Q,kvH,D]
        "qg": b.op("Concat", [r_dim, b.const([nkv, -1, d])], n, axis=0),         # [R,kvH,G·Q,D]
        "unpad": b.op("Unsqueeze", [_unpad_index(b), b.const([0])], n),         # [1, N]
    }
    if not exact:
        p_idx = b.op("Range", [b.const(0), b.op("Squeeze", [p_dim, b.const([0])], n), b.const(1)], n)
        ctx["split"] = b.op("Concat", [p_dim, q_dim], n, axis=0)                 # [P, Q]
        ctx["past_bias"] = b.op("Where", [b.op("Less", [p_idx, lens], n), zero, neg], n)     # [R,1,1,P]
        ctx["causal_bias"] = b.op("Where", [b.op("LessOrEqual", [j, i], n), zero, neg], n)  # [G·Q, Q]
        return ctx
    # canonical layout: the cache's own P = C·KEY_CHUNK entries (contract: P a positive multiple of KEY_CHUNK and
    # max_r cache_lens[r] + Q ≤ P, which the runtime reserves before each pass), new key j of request r at
    # cache_lens[r] + j. "Hot" chunks hold new keys: chunk cache_lens[r] // KEY_CHUNK + i for i < H, H the widest
    # span; a request's chunks past its own span wrap (mod C) onto chunks before its first hot one (no new key
    # there, so recomputing them gives the same partial).
    chunk = b.const([KEY_CHUNK])
    c_dim = b.op("Div", [p_dim, chunk], n)                                      # [1] C
    c_scalar = b.op("Squeeze", [c_dim, b.const([0])], n)
    zero1, nkv_dim = b.const([0]), b.const([nkv])
    slot = b.op("Add", [lens, j], n)                                            # [R,1,1,Q]
    k_idx = b.op("Range", [b.const(0), b.op("Squeeze", [p_dim, b.const([0])], n), b.const(1)], n)   # [P]
    r_idx = b.op("Range", [b.const(0), b.op("Squeeze", [r_dim, b.const([0])], n), b.const(1)], n)
    h_idx = b.op("Range", [b.const(0), b.const(nkv), b.const(1)], n)
    first_hot = b.op("Div", ["cache_lens", b.const(KEY_CHUNK)], n)              # [R]
    offset = b.op("Mod", ["cache_lens", b.const(KEY_CHUNK)], n)                 # [R] cache_lens[r] - first_hot·CHUNK
    span = b.op("Div", [b.op("Add", [offset, b.op("Sub", [q_scalar, b.const(1)], n)], n), b.const(KEY_CHUNK)], n)
    h_scalar = b.op("Add", [b.op("ReduceMax", [span, b.const([0])], n, keepdims=0), b.const(1)], n)  # H
    hot = b.op("Mod", [b.op("Add", [b.op("Unsqueeze", [first_hot, b.const([1])], n),
                                    b.op("Range", [b.const(0), h_scalar, b.const(1)], n)], n), c_scalar], n)  # [R,H]
    h_dim = b.op("Unsqueeze", [h_scalar, b.const([0])], n)
    hot_shape = b.op("Concat", [r_dim, nkv_dim, h_dim, b.const([1])], n, axis=0)  # [R,kvH,H,1]
    new_shape = b.op("Concat", [r_dim, nkv_dim, q_dim, b.const([1])], n, axis=0)  # [R,kvH,Q,1]
    at = lambda t, shape, to: b.op("Expand", [b.op("Reshape", [t, b.const(shape)], n), to], n)  # noqa: E731
    hot_chunk = at(hot, [0, 1, -1, 1], hot_shape)
    gq = b.op("Mul", [q_dim, b.const([g])], n)
    ctx.update({
        "mask": b.op("Where", [b.op("LessOrEqual", [k_idx, b.op("Add", [lens, i], n)], n), zero, neg],
                     n),                                                        # [R,1,G·Q,P]
        "score_slot": b.op("Expand", [slot, b.op("Concat", [r_dim, nkv_dim, gq, q_dim], n, axis=0)], n),
        "hot_chunk": hot_chunk,                                                 # [R,kvH,H,1]
        "partial_slot": b.op("Concat", [at(r_idx, [-1, 1, 1, 1], hot_shape), at(h_idx, [1, -1, 1, 1], hot_shape),
                                        hot_chunk], n, axis=-1),               # [R,kvH,H,3]
        "value_slot": b.op("Concat", [at(r_idx, [-1, 1, 1, 1], new_shape), at(h_idx, [1, -1, 1, 1], new_shape),
                                      at(b.op("Add", [b.op("Reshape", [offset, b.const([-1, 1, 1, 1])], n), j], n),
                                         [0, 1, -1, 1], new_shape)], n, axis=-1),  # [R,kvH,Q,3] in the hot block
        "hot_rows": b.op("Concat", [r_dim, nkv_dim, b.const([-1, d])], n, axis=0),            # [R,kvH,H·CHUNK,D]
        "hot_chunks": b.op("Concat", [r_dim, nkv_dim, h_dim, b.const([KEY_CHUNK, d])], n, axis=0),
        "prob_chunks": b.op("Concat", [r_dim, nkv_dim, gq, b.const([-1, KEY_CHUNK])], n, axis=0),
        "value_chunks": b.op("Concat", [r_dim, nkv_dim, b.const([-1, KEY_CHUNK, d])], n, axis=0),
        "ones": b.op("ConstantOfShape", [b.op("Concat", [b.const([1]), c_dim], n, axis=0)],
                     n, value=onnx.helper.make_tensor("value", onnx.TensorProto.FLOAT, [1], [1.0])),  # [1, C]
    })
    return ctx


def _fused_attention(b: GraphBuilder, spec: TargetGraphSpec, q: str, k: str, v: str, layer: int, actx: dict,
                     name: str) -> str:
    """Ragged attention of q [1,N,nH·D], k, v [1,N,kvH·D] -> [1,N,nH·D]: the two-part softmax of
    `builder.two_part_attention`, or `_exact_attention` when the context was built with `exact`."""
    nh, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    g = nh // nkv
    pad = lambda t: b.op("Gather", [t, "pad_index"], name, axis=1)  # noqa: E731  [1,R,Q,·]
    q5 = b.op("Transpose", [b.op("Reshape", [pad(q), actx["q5"]], name)], name, perm=[0, 2, 3, 1, 4])
    qg = b.op("Reshape", [q5, actx["qg"]], name)                                    # [R,kvH,G·Q,D]
    kp = b.op("Transpose", [b.op("Reshape", [pad(k), actx["kv4"]], name)], name, perm=[0, 2, 1, 3])
    vp = b.op("Transpose", [b.op("Reshape", [pad(v), actx["kv4"]], name)], name, perm=[0, 2, 1, 3])
    scale = float(d ** -0.5)
    s_past = b.op("FusedMatMul", [qg, f"past_key.{layer}"], name, domain=MS_DOMAIN, transB=1, alpha=scale)
    s_new = b.op("FusedMatMul", [qg, kp], name, domain=MS_DOMAIN, transB=1, alpha=scale)
    if "mask" in actx:
        out = _exact_attention(b, s_past, s_new, vp, f"past_value.{layer}", actx, name)
    else:
        scores = b.op("Concat", [b.op("Add", [s_past, actx["past_bias"]], name),
                                 b.op("Add", [s_new, actx["causal_bias"]], name)], name, axis=-1)  # [R,kvH,G·Q,P+Q]
        probs = b.op("Softmax", [scores], name, axis=-1)
        p_past, p_new = b.op("Split", [probs, actx["split"]], name, num_outputs=2, axis=-1)
        out = b.op("Add", [b.op("MatMul", [p_past, f"past_value.{layer}"], name), b.op("MatMul", [p_new, vp], name)],
                   name)                                                           # [R,kvH,G·Q,D]
    out = b.op("Reshape", [out, b.const([0, nkv, g, -1, d])], name)
    out = b.op("Transpose", [out], name, perm=[0, 3, 1, 2, 4])                      # [R,Q,kvH,G,D]
    out = b.op("Reshape", [out, b.const([-1, nh * d])], name)
    return b.op("Gather", [out, actx["unpad"]], f"{name}/unpad", axis=0)            # [1,N,nH·D]


def _exact_attention(b: GraphBuilder, s_past: str, s_new: str, v_new: str, past_value: str, actx: dict,
                     name: str) -> str:
    """Softmax(scores)·V with every sum over keys taken in one fixed order per row: the same bits for a row
    whether its keys sit in the cache (a one-token decode pass) or in this pass (a verification block), with
    any cache capacity P, batch-mates or thread count, up to EXACT_MAX_KEYS = KEY_CHUNK² keys (builds refuse
    longer quantized contexts: `quantize.check_exact_context`).

    Why: MatMulNBits (accuracy_level 4) quantizes its input rows to int8, so a float-rounding difference
    between a decode row and the same row in a block becomes a quantization step and greedy speculative output
    leaves `ar`'s. How: keys are laid out by cache index over the cache's P entries (the new scores scattered
    to cache_lens[r] + j; masked entries weigh exactly 0, so entries past the live context add +0 and P does
    not change the bits); ONNX Runtime's Softmax reduces a row the same way for any such length; P·V runs as
    one GEMM per KEY_CHUNK keys (MLAS never splits a K of 128, so each output is one FMA chain in key order)
    and the chunks are summed by a second GEMM (ones · partials, one chain while there are at most KEY_CHUNK
    chunks: beyond, MLAS splits that sum where the thread layout says). The chunk GEMMs read the cache in
    place; only the hot chunks (those holding new keys: H per request, 1 for a decode row) are gathered, get
    the new values scattered in and are multiplied again, and their partials replace the cache's. Both GEMMs
    use alpha ≠ 1, which keeps MLAS off its M = 1 kernel (a different summation order) when a head group has
    one query row; the powers of two cancel exactly.
    Contract: P a positive multiple of KEY_CHUNK and max_r cache_lens[r] + Q ≤ P (`runtime.kv_cache`).
    Shapes: s_past [R,kvH,G·Q,P], s_new [R,kvH,G·Q,Q] (scaled scores), v_new [R,kvH,Q,D] -> [R,kvH,1,G·Q·D]
    (the [R,kvH,G·Q,D] values in that order; the caller's one Reshape takes either form).
    """
    scores = b.op("ScatterElements", [s_past, actx["score_slot"], s_new], name, axis=-1)   # [R,kvH,G·Q,P]
    probs = b.op("Softmax", [b.op("Add", [scores, actx["mask"]], name)], name, axis=-1)
    probs = b.op("Transpose", [b.op("Reshape", [probs, actx["prob_chunks"]], name)], name,
                 perm=[0, 1, 3, 2, 4])                                                  # [R,kvH,C,G·Q,KEY_CHUNK]
    values = b.op("Reshape", [past_value, actx["value_chunks"]], name)                 # [R,kvH,C,KEY_CHUNK,D]
    partial = b.op("FusedMatMul", [probs, values], name, domain=MS_DOMAIN, alpha=0.5)  # [R,kvH,C,G·Q,D]
    hot = b.op("Reshape", [b.op("GatherND", [values, actx["hot_chunk"]], name, batch_dims=2), actx["hot_rows"]], name)
    hot = b.op("Reshape", [b.op("ScatterND", [hot, actx["value_slot"], v_new], name), actx["hot_chunks"]], name)
    hot = b.op("FusedMatMul", [b.op("GatherND", [probs, actx["hot_chunk"]], name, batch_dims=2), hot], name,
               domain=MS_DOMAIN, alpha=0.5)                                             # [R,kvH,H,G·Q,D]
    partial = b.op("ScatterND", [partial, actx["partial_slot"], hot], name)
    partial = b.op("Reshape", [partial, b.const([0, 0, 0, -1])], name)                 # [R,kvH,C,G·Q·D]
    return b.op("FusedMatMul", [actx["ones"], partial], name, domain=MS_DOMAIN, alpha=2.0)  # [R,kvH,1,G·Q·D]


def _build_fused(b: GraphBuilder, model, spec: TargetGraphSpec, sd: dict, eps: float,
                 fmt: WeightFormat, attention: str = "onnx") -> onnx.ModelProto:
    """The fused target graph (see the comment above `_to_output`), weights in `fmt`, attention by `attention`."""
    b.opsets[MS_DOMAIN] = 1
    nh, nkv, d, hid = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    ids = b.op("Unsqueeze", ["input_ids", b.const([0])], "embed_tokens")
    embed_key = "model.embed_tokens.weight"
    if fmt.quantized:
        h = gather_block_quantized(b, embed_key, sd[embed_key], ids, fmt, "embed_tokens")
    else:
        h = b.op("Gather", [b.weight(embed_key, sd[embed_key]), ids], "embed_tokens", axis=0)
    pos = b.op("Unsqueeze", ["position_ids", b.const([0])], "rope")
    inv_freq, scaling = _rope(model)
    cos, sin = rope_tables(inv_freq, scaling, spec.max_position_embeddings)
    cos, sin = b.weight("rope.cos_cache", cos), b.weight("rope.sin_cache", sin)
    attention = "cpu" if attention == "cpu" and ragged_attention_fits(d) else "onnx"
    if attention == "cpu":
        b.opsets[CPU_DOMAIN] = 1
    else:
        actx = _attention_context(b, spec, exact=fmt.quantized)
    taps, delta = [], None
    for i in range(spec.num_layers):
        p, name = f"model.layers.{i}", f"layers.{i}"
        w_in = b.weight(f"{p}.input_layernorm.weight", sd[f"{p}.input_layernorm.weight"])
        if delta is None:
            x = rms_norm(b, h, w_in, eps, f"{name}/input_layernorm")
        else:
            x, h = skip_rms_norm(b, h, delta, w_in, eps, f"{name}/input_layernorm")
            if i - 1 in spec.tap_layer_ids:
                taps.append(h)
        a = f"{p}.self_attn"
        w_qkv = np.concatenate([sd[f"{a}.{t}_proj.weight"] for t in "qkv"], axis=0)
        biases = [sd.get(f"{a}.{t}_proj.bias") for t in "qkv"]
        bias = np.concatenate(biases) if all(x_ is not None for x_ in biases) else None
        if bias is None and any(x_ is not None for x_ in biases):
            raise ExportError(f"{a}: expected a bias on all of q/k/v_proj or none")
        qkv = project(b, x, f"{a}.qkv_proj.weight", w_qkv, fmt, f"{name}/attn/qkv_proj", bias, f"{a}.qkv_proj.bias")
        q, k, v = b.op("Split", [qkv, b.const([nh * d, nkv * d, nkv * d])], f"{name}/attn/qkv_split",
                       num_outputs=3, axis=-1)
        if f"{a}.q_norm.weight" in sd:
            q = head_norm(b, q, sd, f"{a}.q_norm.weight", nh, d, eps, f"{name}/attn/q_norm")
            k = head_norm(b, k, sd, f"{a}.k_norm.weight", nkv, d, eps, f"{name}/attn/k_norm")
        q = b.op("RotaryEmbedding", [q, pos, cos, sin], f"{name}/attn/q_rope", domain=MS_DOMAIN)
        k = b.op("RotaryEmbedding", [k, pos, cos, sin], f"{name}/attn/k_rope", domain=MS_DOMAIN)
        _to_output(b, "Reshape", [k, b.const([-1, nkv, d])], f"new_key.{i}", ["N", nkv, d], f"{name}/new_key")
        _to_output(b, "Reshape", [v, b.const([-1, nkv, d])], f"new_value.{i}", ["N", nkv, d], f"{name}/new_value")
        if attention == "cpu":
            attn = b.op(RAGGED_ATTENTION, [q, k, v, f"past_key.{i}", f"past_value.{i}", "query_start", "cache_lens"],
                        f"{name}/attn", domain=CPU_DOMAIN, scale=float(d ** -0.5))   # [1, N, nH·D]
        else:
            attn = _fused_attention(b, spec, q, k, v, i, actx, f"{name}/attn")
        o_key = f"{a}.o_proj"
        attn = project(b, attn, f"{o_key}.weight", sd[f"{o_key}.weight"], fmt, f"{name}/attn/o_proj",
                        sd.get(f"{o_key}.bias"), f"{o_key}.bias")
        w_post = b.weight(f"{p}.post_attention_layernorm.weight", sd[f"{p}.post_attention_layernorm.weight"])
        x, h = skip_rms_norm(b, h, attn, w_post, eps, f"{name}/post_attention_layernorm")
        m = f"{p}.mlp"
        inter = sd[f"{m}.gate_proj.weight"].shape[0]
        w_gu = np.concatenate([sd[f"{m}.gate_proj.weight"], sd[f"{m}.up_proj.weight"]], axis=0)
        gu = project(b, x, f"{m}.gate_up_proj.weight", w_gu, fmt, f"{name}/mlp/gate_up_proj")
        gate, up = b.op("Split", [gu, b.const([inter, inter])], f"{name}/mlp/split", num_outputs=2, axis=-1)
        act = b.op("QuickGelu", [gate], f"{name}/mlp/act", domain=MS_DOMAIN, alpha=1.0)
        delta = project(b, b.op("Mul", [act, up], f"{name}/mlp"), f"{m}.down_proj.weight",
                        sd[f"{m}.down_proj.weight"], fmt, f"{name}/mlp/down_proj")
    rows = lambda t: b.op("Gather", [t, "logit_rows"], "logit_rows", axis=1)  # noqa: E731  [1,M,H]
    w_norm = b.weight("model.norm.weight", sd["model.norm.weight"])
    normed, _ = skip_rms_norm(b, rows(h), rows(delta), w_norm, eps, "norm")
    normed = b.op("Reshape", [normed, b.const([-1, hid])], "norm")
    tied = "lm_head.weight" not in sd or np.array_equal(sd["lm_head.weight"], sd[embed_key])
    head_key = embed_key if tied else "lm_head.weight"
    if fmt.quantized:
        project(b, normed, head_key, sd[head_key], fmt, "lm_head", rows="logit_rows")
        b.nodes[-1].output[0] = "logits"
        b.outputs.append(onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["M", spec.vocab_size]))
    else:
        _to_output(b, "Gemm", [normed, b.weight(head_key, sd[head_key])], "logits", ["M", spec.vocab_size],
                   "lm_head", transB=1)
    aux = b.op("Concat", taps, "aux_hidden", axis=-1) if len(taps) > 1 else taps[0]
    _to_output(b, "Reshape", [aux, b.const([-1, spec.feature_size])], "aux_hidden", ["N", spec.feature_size],
               "aux_hidden")
    # graph outputs in contract order: logits, aux_hidden, then new_key.l / new_value.l per layer
    order = [n for n, _, _ in target_io_contract(spec)["outputs"]]
    by_name = {o.name: o for o in b.outputs}
    del b.outputs[:]
    b.outputs.extend(by_name[n] for n in order)
    return b.model(doc=f"dspark-export target graph, fused, weights {fmt.name} (docs/ARCHITECTURE.md: target.onnx)")
