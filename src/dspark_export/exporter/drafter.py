"""Export a DSpark drafter (`modeling.drafter.DSparkDrafter`) to two graphs.

The drafter's context K/V do not depend on the block (DeepSpec spec §5.3), so the export splits
"context → per-layer K/V" (run once per committed row) from "block forward" (run once per step).

drafter_context.onnx (N committed rows):

| name | shape | dtype | meaning |
| --- | --- | --- | --- |
| in `aux_hidden` | [N, F] | float32 | target features of committed rows |
| in `position_ids` | [N] | int64 | their absolute positions |
| out `context_key.{l}` | [N, kvH, D] | float32 | RoPE(k_norm(k_proj(hidden_norm(fc(aux))))) of drafter layer l |
| out `context_value.{l}` | [N, kvH, D] | float32 | v_proj(hidden_norm(fc(aux))) |

drafter_block.onnx (R requests, γ = block size, P context cache length):

| name | shape | dtype | meaning |
| --- | --- | --- | --- |
| in `anchor_ids` | [R] | int64 | last committed token (slot 0 input) |
| in `start_positions` | [R] | int64 | absolute position of the anchor |
| in `context_lens` | [R] | int64 | valid context entries (== start_positions; fewer with a context window) |
| in `context_key.{l}` | [R, kvH, P, D] | float32 | drafter context key cache |
| in `context_value.{l}` | [R, kvH, P, D] | float32 | drafter context value cache |
| in `temperature` | [R] | float32 | 0 = greedy |
| in `top_k` | [R] | int64 | 0 = off |
| in `top_p` | [R] | float32 | 1 = off |
| in `uniforms` | [R, γ] | float32 | one uniform in [0, 1) per draft slot |
| in `confidence_temperature` | [γ] | float32 | STS temperature per position (ones = uncalibrated) |
| out `draft_ids` | [R, γ] | int64 | drafted tokens |
| out `draft_logits` | [R, γ, Vd] | float32 | Markov-corrected logits each draft was drawn from (before warping; over d2t with a draft vocabulary, Vd = V without) |
| out `confidence` | [R, γ] | float32 | σ(z_k / T_k), conditional acceptance probability |
| out `hidden` | [R, γ, H] | float32 | post-final-norm block hidden states |

The block is [anchor, mask × (γ-1)] at positions start..start+γ-1; it attends bidirectionally to
itself and to all context entries (paper §3.1; DeepSpec spec §1.3-1.4). It ends in one
`dspark::MarkovDraft` node (plugins/markov_draft); with a draft vocabulary d2t (and a Markov head) the
node runs over the N draft rows (LM head and W2 rows at d2t) and returns draft_logits over them.
With quantized layers the block's layers are built in a fused form (`_fused_block_layers`: merged
projections, shared masks, FusedMatMul; bitwise the same outputs); the float32 block stays standard ONNX
(the TensorRT lowering).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from ..errors import ConfigError
from ..plugins.cpu_ops import DOMAIN as CPU_DOMAIN, RAGGED_ATTENTION, ragged_attention_fits
from ..plugins.markov_draft import onnx_function as markov_fn
from ..plugins.markov_draft.schema import D2T_INITIALIZER
from ..plugins.markov_draft.schema import OUTSIDE_DRAFT_VOCAB as _OUTSIDE_DRAFT_VOCAB
from .builder import (NEG_INF, GraphBuilder, apply_rope, head_norm, linear, rms_norm, rope_cos_sin, rope_tables,
                      save_model, skip_rms_norm, swiglu_mlp, two_part_attention)
from .quantize import MS_DOMAIN, int8_row_scale, quantize_matmuls_w8a8, quantize_rows_int8

__all__ = ["DrafterGraphSpec", "build_drafter_graphs", "export_drafter", "check_d2t", "draft_vocab_head",
           "draft_vocab_logits",
           "quantize_drafter_layers", "drafter_context_io_contract", "drafter_block_io_contract", "LAYER_WEIGHTS"]

TARGET_EMBED = "model.embed_tokens.weight"


@dataclass(frozen=True)
class DrafterGraphSpec:
    """Static facts about exported drafter graphs, recorded in the manifest."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    feature_size: int
    block_size: int
    mask_token_id: int
    markov_rank: int
    has_confidence: bool
    lm_head_dtype: str = "float32"  #: "float32" (Gemm) or "int8" (see `int8_lm_head`)
    #: rows of the LM head: N of the draft vocabulary `d2t` (`draft_vocab_head`), 0 = the full vocabulary V
    draft_vocab_size: int = 0
    #: the drafter layers' linear weights: "float32", MatMulNBits "int8" / "int4", or "w8a8" (`quantize_drafter_layers`)
    layer_weights: str = "float32"

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def draft_logits_width(self) -> int:
        """Vd, the last axis of the block's ``draft_logits``: N with a draft vocabulary, else V."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterGraphSpec":
        """Raises: ConfigError: an unknown ``lm_head_dtype`` or ``layer_weights``, or a ``draft_vocab_size``
        outside [0, vocab_size] (older manifests have none of these: float32, full vocabulary)."""
        spec = cls(**d)
        if spec.lm_head_dtype not in LM_HEAD_DTYPES:
            raise ConfigError(f"drafter graph spec: lm_head_dtype expected one of {list(LM_HEAD_DTYPES)}, "
                              f"found {spec.lm_head_dtype!r}")
        if spec.layer_weights not in LAYER_WEIGHTS:
            raise ConfigError(f"drafter graph spec: layer_weights expected one of {list(LAYER_WEIGHTS)}, "
                              f"found {spec.layer_weights!r}")
        if isinstance(spec.draft_vocab_size, bool) or not isinstance(spec.draft_vocab_size, int) \
                or not 0 <= spec.draft_vocab_size <= spec.vocab_size:
            raise ConfigError(f"drafter graph spec: draft_vocab_size expected an integer in [0, vocab_size = "
                              f"{spec.vocab_size}], found {spec.draft_vocab_size!r}")
        return spec


def drafter_context_io_contract(spec: DrafterGraphSpec) -> dict:
    kv = ("N", spec.num_kv_heads, spec.head_dim)
    outs = []
    for layer in range(spec.num_layers):
        outs += [(f"context_key.{layer}", kv, "float32"), (f"context_value.{layer}", kv, "float32")]
    return {"inputs": [("aux_hidden", ("N", spec.feature_size), "float32"), ("position_ids", ("N",), "int64")],
            "outputs": outs}


def drafter_block_io_contract(spec: DrafterGraphSpec) -> dict:
    kv = ("R", spec.num_kv_heads, "P", spec.head_dim)
    g = spec.block_size
    inputs = [("anchor_ids", ("R",), "int64"), ("start_positions", ("R",), "int64"),
              ("context_lens", ("R",), "int64")]
    for layer in range(spec.num_layers):
        inputs += [(f"context_key.{layer}", kv, "float32"), (f"context_value.{layer}", kv, "float32")]
    inputs += [("temperature", ("R",), "float32"), ("top_k", ("R",), "int64"), ("top_p", ("R",), "float32"),
               ("uniforms", ("R", g), "float32"), ("confidence_temperature", (g,), "float32")]
    outputs = [("draft_ids", ("R", g), "int64"), ("draft_logits", ("R", g, spec.draft_logits_width), "float32"),
               ("confidence", ("R", g), "float32"), ("hidden", ("R", g, spec.hidden_size), "float32")]
    return {"inputs": inputs, "outputs": outputs}


LM_HEAD_DTYPES = ("float32", "int8")
#: drafter layer weight formats: float32, or ONNX Runtime's MatMulNBits (`quantize_drafter_layers`)
LAYER_WEIGHTS = ("float32", "int8", "int4", "w8a8")
#: draft logit of a token outside the draft vocabulary (the op contract's fill, see its schema)
OUTSIDE_DRAFT_VOCAB = _OUTSIDE_DRAFT_VOCAB


def _spec(drafter, lm_head_dtype: str = "float32", draft_vocab_size: int = 0,
          layer_weights: str = "float32") -> DrafterGraphSpec:
    c = drafter.config
    return DrafterGraphSpec(
        num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
        feature_size=c.hidden_size * len(c.target_layer_ids), block_size=c.block_size,
        mask_token_id=c.mask_token_id, markov_rank=c.markov_rank if drafter.markov_head is not None else 0,
        has_confidence=drafter.confidence_head is not None, lm_head_dtype=lm_head_dtype,
        draft_vocab_size=draft_vocab_size, layer_weights=layer_weights)


def check_d2t(d2t, vocab_size: int) -> np.ndarray:
    """Validate a draft vocabulary: ``d2t`` [N] int64, distinct target token ids in [0, V), 0 < N <= V.

    Raises:
        ConfigError: naming what is wrong (size, the first out-of-range or repeated id).
    """
    arr = np.asarray(d2t)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ConfigError(f"draft vocabulary d2t: expected a 1-D list of integer token ids, found dtype {arr.dtype} "
                          f"shape {list(arr.shape)}")
    n = arr.shape[0]
    if not 0 < n <= vocab_size:
        raise ConfigError(f"draft vocabulary d2t: expected 1 <= N <= vocab_size = {vocab_size} ids, found N = {n}")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        raise ConfigError(f"draft vocabulary d2t: token ids must be in [0, {vocab_size}); d2t[{bad[0]}] = "
                          f"{int(arr[bad[0]])} ({bad.size} out of range)")
    uniq, counts = np.unique(arr, return_counts=True)
    if uniq.size != n:
        raise ConfigError(f"draft vocabulary d2t: token ids must be distinct; {int(uniq[counts > 1][0])} repeats")
    return arr.astype(np.int64)


def draft_vocab_index(d2t: np.ndarray, vocab_size: int) -> np.ndarray:
    """t2d_index [V] int64: the draft row of each target token, N (the fill column) for tokens outside d2t."""
    index = np.full(vocab_size, len(d2t), np.int64)
    index[d2t] = np.arange(len(d2t))
    return index


def draft_vocab_logits(b: GraphBuilder, h: str, weight: np.ndarray, d2t: np.ndarray, lm_head_dtype: str) -> str:
    """Draft-row logits [n, N] of rows h [n, H] through the LM head's d2t rows only (fp32 Gemm or `int8_lm_head`)."""
    w = np.ascontiguousarray(np.asarray(weight, np.float32)[d2t])
    if lm_head_dtype == "int8":
        return int8_lm_head(b, h, w)
    return b.op("Gemm", [h, b.weight("lm_head.d2t.weight", w)], "lm_head", transB=1)


def draft_vocab_head(b: GraphBuilder, h: str, weight: np.ndarray, d2t: np.ndarray, lm_head_dtype: str) -> str:
    """Draft logits [n, V] of rows h [n, H] through the LM head's d2t rows only, scattered back to V.

    ``logits_N = h · W[d2t]ᵀ`` ([n, N], fp32 Gemm or `int8_lm_head`), then
    ``ScatterElements(Expand(OUTSIDE_DRAFT_VOCAB, [n, V]), Expand(d2t, [n, N]), logits_N, axis=1)``:
    column d2t[j] holds logits_N[:, j], every other column the fill. (A constant-index Gather over
    ``[logits_N ; fill]`` gives the same tensor but cost 1.8 ms of CPU against 0.38 ms at n = 7, N = 4096.)
    Why: the block is bound by reading the [V, H] head; N rows read N/V of it (FR-Spec, Zhao et al. 2025,
    arXiv 2502.14856; EAGLE-3's d2t). Used without a Markov head (MarkovDraft then runs over V and the block
    gathers its draft logits back at d2t); q is exactly 0 outside d2t (the Markov bias is
    finite, exp(fill − max) underflows to 0), drafts always lie in d2t, and verification with this q stays
    lossless (Leviathan et al. 2023: any q works as long as the draft was drawn from it).
    """
    logits = draft_vocab_logits(b, h, weight, d2t, lm_head_dtype)
    name = "draft_vocab"
    rows = b.op("Slice", [b.op("Shape", [h], name), b.const([0]), b.const([1])], name)
    base = b.op("Expand", [b.const([[OUTSIDE_DRAFT_VOCAB]], "float32"),
                           b.op("Concat", [rows, b.const([weight.shape[0]])], name, axis=0)], name)
    d2t_row = b.op("Reshape", [b.weight(D2T_INITIALIZER, np.asarray(d2t, np.int64)), b.const([1, -1])], name)
    index = b.op("Expand", [d2t_row, b.op("Concat", [rows, b.const([len(d2t)])], name, axis=0)], name)
    return b.op("ScatterElements", [base, index, logits], name, axis=1)


def quantize_drafter_layers(model: onnx.ModelProto, layer_weights: str, block_size: int = 32) -> onnx.ModelProto:
    """Replace every MatMul with a constant weight (fc, q/k/v/o, gate/up/down) by ONNX Runtime's MatMulNBits.

    Quantized by ONNX Runtime's own tool (`onnxruntime.quantization.matmul_nbits_quantizer`, RTN, blocks of
    `block_size` along the input dimension, symmetric: the default zero point, never the float zero points
    that fall on MatMulNBits' slow path) with ``accuracy_level = 4``: activations go to int8 per block of
    each row, so a request's drafts never depend on its batch mates. The LM head is a Gemm or
    MatMulInteger (`int8_lm_head`) and is left alone; the attention MatMuls have no constant weight.
    "w8a8" instead rewrites them as `quantize.matmul_w8a8` (int8 weights, per-row int8 activations, integer GEMM):
    row-local too, and its cost grows little with the block's rows.

    Args:
        model: a drafter graph from `build_context_graph` / `build_block_graph` (weights inline).
        layer_weights: one of LAYER_WEIGHTS; "float32" returns `model` unchanged.
    Raises:
        ConfigError: an unknown format.
    """
    if layer_weights not in LAYER_WEIGHTS:
        raise ConfigError(f"drafter layer weights: expected one of {list(LAYER_WEIGHTS)}, found {layer_weights!r}")
    if layer_weights == "float32":
        return model
    if layer_weights == "w8a8":
        return quantize_matmuls_w8a8(model)
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    bits = 4 if layer_weights == "int4" else 8
    quant_logger = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quant_logger.level
    quant_logger.setLevel(logging.WARNING)  # it logs one INFO line per MatMul
    try:
        cfg = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=4, bits=bits,
                                           op_types_to_quantize=("MatMul",))
        quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=block_size, is_symmetric=True,
                                         accuracy_level=4, algo_config=cfg, op_types_to_quantize=("MatMul",))
        quantizer.process()
    finally:
        quant_logger.setLevel(level)
    out = quantizer.model.model
    out.ir_version = model.ir_version
    return out


def int8_lm_head(b: GraphBuilder, h: str, weight: np.ndarray) -> str:
    """Draft logits [n, V] float32 of rows h [n, H] through an int8 LM head (standard ONNX ops).

    Each row is quantized on its own (so a request's logits never depend on its batch mates):
    ``s_i = max(max|h_i|, 1e-30) / 127``, ``h_u8 = clip(round(h_i / s_i) + 128, 0, 255)``,
    ``acc = MatMulInteger(h_u8, w_q, 128)`` (int32, uint8 × int8: the VNNI path), logits =
    ``acc · (s_i + 0·Σh_i) · scale_v`` (the 0·Σh_i term keeps a row holding NaN or ±inf non-finite, as
    the fp32 head would, so the runtime's non-finite check still catches it); weights from
    `quantize.quantize_rows_int8`. Why: at R = 1..16 the drafter block is bound by reading the [V, H] head (113 MB
    in fp32 for SmolLM2); int8 reads a quarter of it. On SmolLM2's shipped drafter the logits differ
    from the fp32 head's by at most 0.51 where they reach 15.7 in magnitude (profiler feeds, R = 8);
    losslessness is unaffected because verification uses these very logits as the draft distribution
    q. Every node is named ``.../lm_head_int8/...``; the TensorRT lowering replaces them by
    DequantizeLinear + MatMul (TensorRT has no MatMulInteger).
    """
    w_q, scale = quantize_rows_int8(weight)
    name = "lm_head_int8"
    row_scale = int8_row_scale(b, h, name)  # [n, 1]
    shifted = b.op("Add", [b.op("Round", [b.op("Div", [h, row_scale], name)], name), b.const(128.0, "float32")], name)
    h_u8 = b.op("Cast", [b.op("Clip", [shifted, b.const(0.0, "float32"), b.const(255.0, "float32")], name)], name,
                to=onnx.TensorProto.UINT8)
    acc = b.op("MatMulInteger", [h_u8, b.weight("lm_head_int8.weight", w_q), b.const(128, "uint8")], name)
    acc = b.op("Cast", [acc], name, to=onnx.TensorProto.FLOAT)
    finite_guard = b.op("Mul", [b.op("ReduceSum", [h, b.const([-1])], name, keepdims=1), b.const(0.0, "float32")], name)
    out_scale = b.op("Add", [row_scale, finite_guard], name)   # [n, 1]: NaN for a row holding NaN or ±inf
    return b.op("Mul", [b.op("Mul", [acc, out_scale], name), b.weight("lm_head_int8.scale", scale)], name)


def _embed_name(sd: dict, key: str, target_embed: np.ndarray | None) -> str:
    """Name the frozen embedding/LM head after the target's when equal, so engines share one copy."""
    if target_embed is not None and np.array_equal(sd[key], target_embed):
        return TARGET_EMBED
    return key


def _kv_proj(b, sd, c, i: int, x: str, cos: str, sin: str, name: str) -> tuple[str, str]:
    """Drafter layer i's K (k_norm, RoPE) and V of rows x [T, H] -> ([T, kvH, D], [T, kvH, D])."""
    p = f"layers.{i}.self_attn"
    out = []
    for t in ("k", "v"):
        y = linear(b, x, f"{p}.{t}_proj.weight", sd[f"{p}.{t}_proj.weight"], f"{name}/{t}_proj",
                   sd.get(f"{p}.{t}_proj.bias"), f"{p}.{t}_proj.bias")
        y = b.op("Reshape", [y, b.const([-1, c.num_key_value_heads, c.head_dim])], f"{name}/{t}_proj")
        if t == "k":
            if f"{p}.k_norm.weight" in sd:
                y = rms_norm(b, y, b.weight(f"{p}.k_norm.weight", sd[f"{p}.k_norm.weight"]), c.rms_norm_eps,
                             f"{name}/k_norm")
            y = apply_rope(b, y, cos, sin, c.head_dim, f"{name}/k_rope")
        out.append(y)
    return out[0], out[1]


def build_context_graph(drafter, rope: tuple[np.ndarray, float], layer_weights: str = "float32") -> onnx.ModelProto:
    """drafter_context.onnx: aux rows -> per-layer context K/V (see the module table); `layer_weights` as in
    `quantize_drafter_layers` (fc, k_proj, v_proj)."""
    c, spec = drafter.config, _spec(drafter)
    sd = {k: v.detach().float().numpy() for k, v in drafter.state_dict().items()}
    b = GraphBuilder("drafter_context")
    for name, shape, dtype in drafter_context_io_contract(spec)["inputs"]:
        b.input(name, dtype, shape)
    h = linear(b, "aux_hidden", "fc.weight", sd["fc.weight"], "fc")
    h = rms_norm(b, h, b.weight("hidden_norm.weight", sd["hidden_norm.weight"]), c.rms_norm_eps, "hidden_norm")
    cos, sin = rope_cos_sin(b, "position_ids", *rope)
    for i in range(c.num_hidden_layers):
        k, v = _kv_proj(b, sd, c, i, h, cos, sin, f"layers.{i}/attn")
        b.output(k, f"context_key.{i}", "float32", ["N", c.num_key_value_heads, c.head_dim])
        b.output(v, f"context_value.{i}", "float32", ["N", c.num_key_value_heads, c.head_dim])
    return quantize_drafter_layers(b.model(doc="dspark-export drafter context graph"), layer_weights)


def _block_layer(b, sd, c, i: int, h: str, ctx: dict) -> str:
    """One drafter layer over the flattened block rows h [R·γ, H]."""
    name, p, eps = f"layers.{i}", f"layers.{i}.self_attn", c.rms_norm_eps
    nh, nkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    x = rms_norm(b, h, b.weight(f"layers.{i}.input_layernorm.weight", sd[f"layers.{i}.input_layernorm.weight"]),
                 eps, f"{name}/input_layernorm")
    q = linear(b, x, f"{p}.q_proj.weight", sd[f"{p}.q_proj.weight"], f"{name}/attn/q_proj",
               sd.get(f"{p}.q_proj.bias"), f"{p}.q_proj.bias")
    q = b.op("Reshape", [q, b.const([-1, nh, d])], f"{name}/attn/q_proj")
    if f"{p}.q_norm.weight" in sd:
        q = rms_norm(b, q, b.weight(f"{p}.q_norm.weight", sd[f"{p}.q_norm.weight"]), eps, f"{name}/attn/q_norm")
    q = apply_rope(b, q, ctx["cos"], ctx["sin"], d, f"{name}/attn/q_rope")
    k, v = _kv_proj(b, sd, c, i, x, ctx["cos"], ctx["sin"], f"{name}/attn")
    to4 = lambda t, heads: b.op("Reshape", [t, b.const([-1, c.block_size, heads, d])], f"{name}/attn/block")  # noqa: E731
    attn = two_part_attention(b, to4(q, nh), to4(k, nkv), to4(v, nkv), f"context_key.{i}",
                              f"context_value.{i}", "context_lens", (nh, nkv, d), False, f"{name}/attn")
    attn = b.op("Reshape", [attn, b.const([-1, nh * d])], f"{name}/attn")
    attn = linear(b, attn, f"{p}.o_proj.weight", sd[f"{p}.o_proj.weight"], f"{name}/attn/o_proj",
                  sd.get(f"{p}.o_proj.bias"), f"{p}.o_proj.bias")
    h = b.op("Add", [h, attn], f"{name}/attn_residual")
    key = f"layers.{i}.post_attention_layernorm.weight"
    x = rms_norm(b, h, b.weight(key, sd[key]), eps, f"{name}/post_attention_layernorm")
    return b.op("Add", [h, swiglu_mlp(b, x, sd, f"layers.{i}.mlp", f"{name}/mlp")], f"{name}/mlp_residual")


# -- the fused block layers ------------------------------------------------------------------------
# The moves of the fused target graph (exporter/target.py `_build_fused`) that keep the block's outputs bitwise:
# the residual stream is [1, R·γ, H], q/k/v one projection + Split and gate/up one + Split (the merged weight
# holds the same columns, and MatMulNBits quantizes each column's blocks and each input row alone, so the
# products are the same bits), the context mask is computed once for every layer as an additive bias
# (s + 0 = s, s + (−1e30) = −1e30 in float32: what Where gave), the 1/√D scale rides on FusedMatMul's alpha
# and SiLU is QuickGelu (ONNX Runtime fuses the plain graph into both anyway), and γ is static, so the
# attention reshapes use constant shapes (no Shape/Concat per layer). RoPE and the norms stay the plain
# subgraphs (ONNX Runtime fuses the norms into SimplifiedLayerNormalization): SkipSimplifiedLayerNormalization
# and RotaryEmbedding over a float64-built table (`fused="contrib"`) move values by float rounding, and the
# int8 activations of MatMulNBits and of the int8 LM head turn some of those into a quantization step (on the
# shipped drafter: greedy draft logits up to 0.22 apart, 4 % of sampled drafts different; see
# reports/drafter/draft-vocab.md), so the default form does not use them.

def _fused_attention_context(b: GraphBuilder, c) -> dict:
    """What every layer's attention shares: the context mask as an additive bias [R, 1, 1, P] (0 where
    j < context_lens[r], −1e30 elsewhere) and the Split sizes [P, γ] of the scores."""
    n = "attn_shared"
    p_dim = b.op("Shape", ["context_key.0"], n, start=2, end=3)                  # [P]
    p_idx = b.op("Range", [b.const(0), b.op("Squeeze", [p_dim, b.const([0])], n), b.const(1)], n)
    lens = b.op("Reshape", ["context_lens", b.const([-1, 1, 1, 1])], n)
    bias = b.op("Where", [b.op("Less", [p_idx, lens], n), b.const(0.0, "float32"), b.const(NEG_INF, "float32")], n)
    return {"past_bias": bias, "split": b.op("Concat", [p_dim, b.const([c.block_size])], n, axis=0)}


def _fused_block_attention(b: GraphBuilder, c, i: int, q: str, k: str, v: str, actx: dict, name: str) -> str:
    """Block attention of q [1, R·γ, nH·D] over [context ; block] keys (bidirectional, DSpark §3.1) -> [1, R·γ, nH·D].

    Same graph as `builder.two_part_attention` with causal=False: queries grouped per KV head
    ([R, kvH, G·γ, D]), scores against the context cache and the block keys, one softmax over both.
    """
    nh, nkv, d, g = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.block_size
    grp = nh // nkv
    q5 = b.op("Transpose", [b.op("Reshape", [q, b.const([-1, g, nkv, grp, d])], name)], name, perm=[0, 2, 3, 1, 4])
    qg = b.op("Reshape", [q5, b.const([0, nkv, grp * g, d])], name)                 # [R, kvH, G·γ, D]
    kb = b.op("Transpose", [b.op("Reshape", [k, b.const([-1, g, nkv, d])], name)], name, perm=[0, 2, 1, 3])
    vb = b.op("Transpose", [b.op("Reshape", [v, b.const([-1, g, nkv, d])], name)], name, perm=[0, 2, 1, 3])
    scale = float(d ** -0.5)
    s_ctx = b.op("FusedMatMul", [qg, f"context_key.{i}"], name, domain=MS_DOMAIN, transB=1, alpha=scale)
    s_blk = b.op("FusedMatMul", [qg, kb], name, domain=MS_DOMAIN, transB=1, alpha=scale)
    scores = b.op("Concat", [b.op("Add", [s_ctx, actx["past_bias"]], name), s_blk], name, axis=-1)
    p_ctx, p_blk = b.op("Split", [b.op("Softmax", [scores], name, axis=-1), actx["split"]], name,
                        num_outputs=2, axis=-1)
    out = b.op("Add", [b.op("MatMul", [p_ctx, f"context_value.{i}"], name), b.op("MatMul", [p_blk, vb], name)],
               name)                                                                # [R, kvH, G·γ, D]
    out = b.op("Transpose", [b.op("Reshape", [out, b.const([0, nkv, grp, g, d])], name)], name, perm=[0, 3, 1, 2, 4])
    return b.op("Reshape", [out, b.const([1, -1, nh * d])], name)


def _norm_residual(b: GraphBuilder, h: str, delta: str, weight: str, eps: float, name: str, exact: bool):
    """(rms_norm(h + delta) · w, h + delta): one SkipSimplifiedLayerNormalization, or with `exact` the plain
    Add + `rms_norm` (which ONNX Runtime fuses into SimplifiedLayerNormalization, as in `_block_layer`)."""
    if not exact:
        return skip_rms_norm(b, h, delta, weight, eps, name)
    total = b.op("Add", [h, delta], f"{name}/residual")
    return rms_norm(b, total, weight, eps, name), total


def _fused_block_layers(b: GraphBuilder, sd: dict, c, h: str, pos: str, rope: tuple[np.ndarray, float],
                        exact: bool = True, attention: str = "onnx") -> str:
    """Every drafter layer and the final norm over the block rows h [1, R·γ, H] (positions pos [1, R·γ]) in the
    fused form (see the comment above) -> the post-final-norm rows [R·γ, H]. `exact` = False uses
    SkipSimplifiedLayerNormalization and RotaryEmbedding (over [max_position + γ, D/2] tables: a block reaches
    γ - 1 past its last context position). `attention` "cpu": one `dspark.cpu::RaggedAttention` node a layer
    (causal 0: every block row sees the context and the whole block; head dims a multiple of 16 up to 512),
    else `_fused_block_attention`."""
    b.opsets[MS_DOMAIN] = 1
    nh, nkv, d, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
    cpu_attention = attention == "cpu" and ragged_attention_fits(d)
    if cpu_attention:
        b.opsets[CPU_DOMAIN] = 1
        requests = b.op("Squeeze", [b.op("Shape", ["anchor_ids"], "block_starts"), b.const([0])], "block_starts")
        block_starts = b.op("Mul", [b.op("Range", [b.const(0), b.op("Add", [requests, b.const(1)], "block_starts"),
                                                   b.const(1)], "block_starts"), b.const(c.block_size)],
                            "block_starts")                                          # [R+1]: r·γ
    if exact:
        cos, sin = rope_cos_sin(b, b.op("Reshape", [pos, b.const([-1])], "rope"), *rope)
    else:  # named apart from the target's tables (another row count): `save_model(share_from=...)` keeps both
        cos, sin = rope_tables(*rope, c.max_position_embeddings + c.block_size)
        cos, sin = b.weight("drafter_block.rope.cos_cache", cos), b.weight("drafter_block.rope.sin_cache", sin)
    actx = None if cpu_attention else _fused_attention_context(b, c)
    delta = None
    for i in range(c.num_hidden_layers):
        p, a, m, name = f"layers.{i}", f"layers.{i}.self_attn", f"layers.{i}.mlp", f"layers.{i}"
        w_in = b.weight(f"{p}.input_layernorm.weight", sd[f"{p}.input_layernorm.weight"])
        if delta is None:
            x = rms_norm(b, h, w_in, eps, f"{name}/input_layernorm")
        else:
            x, h = _norm_residual(b, h, delta, w_in, eps, f"{name}/input_layernorm", exact)
        biases = [sd.get(f"{a}.{t}_proj.bias") for t in "qkv"]
        if any(x_ is not None for x_ in biases) and not all(x_ is not None for x_ in biases):
            raise ConfigError(f"drafter {a}: expected a bias on all of q/k/v_proj or none")
        qkv = linear(b, x, f"{a}.qkv_proj.weight", np.concatenate([sd[f"{a}.{t}_proj.weight"] for t in "qkv"]),
                     f"{name}/attn/qkv_proj", None if biases[0] is None else np.concatenate(biases),
                     f"{a}.qkv_proj.bias")
        q, k, v = b.op("Split", [qkv, b.const([nh * d, nkv * d, nkv * d])], f"{name}/attn/qkv_split",
                       num_outputs=3, axis=-1)
        if f"{a}.q_norm.weight" in sd:
            q = head_norm(b, q, sd, f"{a}.q_norm.weight", nh, d, eps, f"{name}/attn/q_norm")
        if f"{a}.k_norm.weight" in sd:
            k = head_norm(b, k, sd, f"{a}.k_norm.weight", nkv, d, eps, f"{name}/attn/k_norm")
        if exact:  # [R·γ, heads, D]: the attention's reshapes read the same element order
            q = apply_rope(b, b.op("Reshape", [q, b.const([-1, nh, d])], f"{name}/attn/q_proj"), cos, sin, d,
                           f"{name}/attn/q_rope")
            k = apply_rope(b, b.op("Reshape", [k, b.const([-1, nkv, d])], f"{name}/attn/k_proj"), cos, sin, d,
                           f"{name}/attn/k_rope")
        else:
            q = b.op("RotaryEmbedding", [q, pos, cos, sin], f"{name}/attn/q_rope", domain=MS_DOMAIN)
            k = b.op("RotaryEmbedding", [k, pos, cos, sin], f"{name}/attn/k_rope", domain=MS_DOMAIN)
        if cpu_attention:
            rows = lambda t, heads: b.op("Reshape", [t, b.const([1, -1, heads * d])], f"{name}/attn")  # noqa: E731
            attn = b.op(RAGGED_ATTENTION, [rows(q, nh), rows(k, nkv), rows(v, nkv), f"context_key.{i}",
                                            f"context_value.{i}", block_starts, "context_lens"], f"{name}/attn",
                        domain=CPU_DOMAIN, scale=float(d ** -0.5), causal=0)
        else:
            attn = _fused_block_attention(b, c, i, q, k, v, actx, f"{name}/attn")
        attn = linear(b, attn, f"{a}.o_proj.weight", sd[f"{a}.o_proj.weight"], f"{name}/attn/o_proj",
                      sd.get(f"{a}.o_proj.bias"), f"{a}.o_proj.bias")
        w_post = b.weight(f"{p}.post_attention_layernorm.weight", sd[f"{p}.post_attention_layernorm.weight"])
        x, h = _norm_residual(b, h, attn, w_post, eps, f"{name}/post_attention_layernorm", exact)
        inter = sd[f"{m}.gate_proj.weight"].shape[0]
        gu = linear(b, x, f"{m}.gate_up_proj.weight",
                    np.concatenate([sd[f"{m}.gate_proj.weight"], sd[f"{m}.up_proj.weight"]]), f"{name}/mlp/gate_up_proj")
        gate, up = b.op("Split", [gu, b.const([inter, inter])], f"{name}/mlp/split", num_outputs=2, axis=-1)
        act = b.op("QuickGelu", [gate], f"{name}/mlp/act", domain=MS_DOMAIN, alpha=1.0)
        delta = linear(b, b.op("Mul", [act, up], f"{name}/mlp"), f"{m}.down_proj.weight", sd[f"{m}.down_proj.weight"],
                       f"{name}/mlp/down_proj")
    normed, _ = _norm_residual(b, h, delta, b.weight("norm.weight", sd["norm.weight"]), eps, "norm", exact)
    return b.op("Reshape", [normed, b.const([-1, c.hidden_size])], "norm")


def _block_inputs(b: GraphBuilder, c, spec, batch_axis: bool = False) -> tuple[str, str]:
    """Block token ids and positions, both flattened to [R·γ] (to [1, R·γ] with `batch_axis`)."""
    g = c.block_size
    for name, shape, dtype in drafter_block_io_contract(spec)["inputs"]:
        b.input(name, dtype, shape)
    anchor = b.op("Unsqueeze", ["anchor_ids", b.const([1])], "block_ids")
    masks = b.op("Expand", [b.const([[c.mask_token_id]]),
                            b.op("Concat", [b.op("Shape", ["anchor_ids"], "block_ids"), b.const([g - 1])],
                                 "block_ids", axis=0)], "block_ids")
    flat = b.const([1, -1] if batch_axis else [-1])
    ids = b.op("Reshape", [b.op("Concat", [anchor, masks], "block_ids", axis=1), flat], "block_ids")
    start = b.op("Unsqueeze", ["start_positions", b.const([1])], "block_positions")
    pos = b.op("Add", [start, b.const(np.arange(g).reshape(1, g))], "block_positions")
    return ids, b.op("Reshape", [pos, flat], "block_positions")


def build_block_graph(drafter, rope: tuple[np.ndarray, float], target_embed: np.ndarray | None,
                      lm_head_dtype: str = "float32", d2t=None, layer_weights: str = "float32",
                      fused: bool | str | None = None, attention: str = "onnx") -> onnx.ModelProto:
    """drafter_block.onnx: anchors + context cache -> drafts, draft logits, confidence.

    Args:
        d2t: the draft vocabulary [N] (target token ids; `check_d2t`), or None for the full vocabulary.
        layer_weights: the drafter layers' weight format (`quantize_drafter_layers`).
        fused: the layers' form: False = `_block_layer`; True = `_fused_block_layers` (merged projections, shared
            masks, FusedMatMul: bitwise the same outputs, fewer nodes); "contrib" = that plus
            SkipSimplifiedLayerNormalization and RotaryEmbedding (fewer nodes still, outputs moved by rounding,
            which MatMulNBits' int8 activations can turn into a quantization step). None = True exactly when
            the layers are quantized (MatMulNBits already ties the graph to ONNX Runtime), so the float32
            block stays standard ONNX for the TensorRT lowering.
        attention: the fused forms' attention: "onnx" or "cpu" (`_fused_block_layers`).
    Raises:
        ConfigError: `lm_head_dtype` is not one of `LM_HEAD_DTYPES`, a bad `d2t`, `layer_weights` or `fused`.
    """
    if lm_head_dtype not in LM_HEAD_DTYPES:
        raise ConfigError(f"drafter LM head dtype: expected one of {list(LM_HEAD_DTYPES)}, found {lm_head_dtype!r}")
    c = drafter.config
    if d2t is not None:
        d2t = np.sort(check_d2t(d2t, c.vocab_size))  # MarkovDraft's d2t is strictly ascending
    spec = _spec(drafter, lm_head_dtype, 0 if d2t is None else len(d2t), layer_weights)
    op_d2t = d2t if spec.markov_rank > 0 else None  # MarkovDraft over the draft vocabulary (needs W1 for V)
    sd = {k: v.detach().float().numpy() for k, v in drafter.state_dict().items()}
    if fused not in (None, False, True, "contrib"):
        raise ConfigError(f"drafter block form: fused expected None, False, True or 'contrib', found {fused!r}")
    if fused is None:
        fused = layer_weights != "float32"
    b = GraphBuilder("drafter_block")
    ids, pos = _block_inputs(b, c, spec, batch_axis=fused)
    embed = b.weight(_embed_name(sd, "embed_tokens.weight", target_embed), sd["embed_tokens.weight"])
    h = b.op("Gather", [embed, ids], "embed_tokens", axis=0)
    if fused:
        h = _fused_block_layers(b, sd, c, h, pos, rope, exact=fused != "contrib", attention=attention)
    else:
        cos, sin = rope_cos_sin(b, pos, *rope)
        for i in range(c.num_hidden_layers):
            h = _block_layer(b, sd, c, i, h, {"cos": cos, "sin": sin})
        h = rms_norm(b, h, b.weight("norm.weight", sd["norm.weight"]), c.rms_norm_eps, "norm")
    if op_d2t is not None:
        logits = draft_vocab_logits(b, h, sd["lm_head.weight"], op_d2t, lm_head_dtype)  # [R·γ, N]: no scatter
    elif d2t is not None:
        logits = draft_vocab_head(b, h, sd["lm_head.weight"], d2t, lm_head_dtype)
    elif lm_head_dtype == "int8":
        logits = int8_lm_head(b, h, sd["lm_head.weight"])
    else:
        head = b.weight(_embed_name(sd, "lm_head.weight", target_embed), sd["lm_head.weight"])
        logits = b.op("Gemm", [h, head], "lm_head", transB=1)
    hidden3 = b.op("Reshape", [h, b.const([-1, c.block_size, c.hidden_size])], "hidden")
    rows = c.vocab_size if op_d2t is None else len(op_d2t)
    logits3 = b.op("Reshape", [logits, b.const([-1, c.block_size, rows])], "base_logits")
    op_inputs = [logits3, hidden3, "anchor_ids", "temperature", "top_k", "top_p", "uniforms",
                 "confidence_temperature"]
    op_inputs += _head_weights(b, sd, spec, op_d2t)
    outs = [f"/drafter_block/markov_draft/{n}" for n in ("draft_ids", "draft_logits", "confidence")]
    config = dict(block_size=c.block_size, has_markov=spec.markov_rank > 0, has_confidence=spec.has_confidence)
    if op_d2t is not None:
        config["has_d2t"] = True
    b.add_function(markov_fn.make_function(**config))
    b.nodes.append(markov_fn.make_node(op_inputs, outs, "/drafter_block/markov_draft/MarkovDraft", **config))
    if d2t is not None and op_d2t is None:   # no Markov head: the op ran over V; draft_logits is over d2t
        d2t_name = b.weight(D2T_INITIALIZER, np.asarray(d2t, np.int64))
        outs[1] = b.op("Gather", [outs[1], d2t_name], "draft_logits_d2t", axis=2)
    for (name, shape, dtype), value in zip(drafter_block_io_contract(spec)["outputs"], outs + [hidden3]):
        b.output(value, name, dtype, shape)
    return quantize_drafter_layers(b.model(doc="dspark-export drafter block graph"), layer_weights)


def _head_weights(b: GraphBuilder, sd: dict, spec: DrafterGraphSpec, d2t: np.ndarray | None = None) -> list[str]:
    """MarkovDraft's optional inputs, in schema order ('' for an absent optional input); with ``d2t`` (sorted),
    W2's rows at d2t and d2t itself."""
    names = []
    if spec.markov_rank > 0:
        names.append(b.weight("markov_head.markov_w1.weight", sd["markov_head.markov_w1.weight"]))
        # nn.Linear(r, V) stores W2 as [V, r], the op's layout.
        w2 = sd["markov_head.markov_w2.weight"]
        names.append(b.weight("markov_head.markov_w2.weight", w2) if d2t is None else
                     b.weight("markov_head.markov_w2.d2t.weight", np.ascontiguousarray(w2[d2t])))
    else:
        names += ["", ""]
    if spec.has_confidence:
        w = sd["confidence_head.proj.weight"].reshape(-1)
        if spec.markov_rank > 0 and w.shape[0] == spec.hidden_size:
            # confidence_head_with_markov=False: the head reads h_k only; zero weights on W1[prev]
            # make the op's [h_k ; W1[prev]] input compute exactly that.
            w = np.concatenate([w, np.zeros(spec.markov_rank, np.float32)])
        names.append(b.weight("confidence_head.proj.weight", w))
        names.append(b.weight("confidence_head.proj.bias", sd["confidence_head.proj.bias"].reshape(1)))
    else:
        names += ["", ""]
    names.append("" if d2t is None else b.weight(D2T_INITIALIZER, np.asarray(d2t, np.int64)))
    while names and names[-1] == "":
        names.pop()
    return names


def build_drafter_graphs(drafter, rope, target_embed=None, lm_head_dtype: str = "float32", d2t=None,
                         layer_weights: str = "float32", attention: str = "onnx"):
    """Returns (context ModelProto, block ModelProto, DrafterGraphSpec); arguments as in `build_block_graph`.

    Raises:
        ConfigError: a bad `lm_head_dtype`, `d2t` or `layer_weights` (named).
    """
    if layer_weights not in LAYER_WEIGHTS:
        raise ConfigError(f"drafter layer weights: expected one of {list(LAYER_WEIGHTS)}, found {layer_weights!r}")
    with torch.no_grad():
        block = build_block_graph(drafter, rope, target_embed, lm_head_dtype, d2t, layer_weights,
                                  attention=attention)
        return (build_context_graph(drafter, rope, layer_weights), block,
                _spec(drafter, lm_head_dtype, 0 if d2t is None else len(d2t), layer_weights))


def export_drafter(drafter, rope, out_dir: Path, target_embed=None,
                   target_graph: Path | None = None, lm_head_dtype: str = "float32",
                   target_weights: str = "fp32", d2t=None, layer_weights: str = "float32",
                   attention: str = "onnx") -> tuple[list[Path], DrafterGraphSpec]:
    """Write drafter_context.onnx and drafter_block.onnx (+ .data) into `out_dir`.

    Args:
        drafter: a `DSparkDrafter`.
        rope: (inv_freq [D/2] float32, attention_scaling) of the target (the drafter shares its RoPE).
        target_embed: the target's embedding matrix [V, H]; equal drafter embeddings/LM heads are
            named after it so engines hold one copy.
        target_graph: the saved target.onnx in `out_dir`; shared weights then point into its data
            file instead of being written twice.
        lm_head_dtype: "float32" (the target's head, shared) or "int8" (`int8_lm_head`).
        target_weights: the target's weight format; when quantized, the block embeds its tokens from the
            target's quantized table (`quantize.share_quantized_embedding`) instead of a float copy.
        d2t: draft vocabulary [N] (`draft_vocab_head`), None = the full vocabulary.
        layer_weights: "float32", "int8", "int4" or "w8a8" drafter layers (`quantize_drafter_layers`).
        attention: the block's attention in its fused forms, "onnx" or "cpu" (`build_block_graph`).
    """
    ctx, block, spec = build_drafter_graphs(drafter, rope, target_embed, lm_head_dtype, d2t, layer_weights,
                                            attention)
    if target_embed is not None:
        from .quantize import WeightFormat, share_quantized_embedding

        block = share_quantized_embedding(block, TARGET_EMBED, target_embed, WeightFormat(target_weights))
    out_dir = Path(out_dir)
    files = save_model(ctx, out_dir / "drafter_context.onnx", target_graph)
    files += save_model(block, out_dir / "drafter_block.onnx", target_graph)
    return files, spec
