"""Weight formats of the exported graphs: fp32, block-quantized int4 / int8 weights (ONNX Runtime's quantizer),
or w8a8: int8 weights and int8 activations quantized per row (`matmul_w8a8`).

An int4 or int8 linear layer is one ``com.microsoft::MatMulNBits`` node whose packed weights come from ONNX
Runtime's own block quantizer (``onnxruntime.quantization.matmul_nbits_quantizer.DefaultWeightOnlyQuantizer``,
the routine ``MatMulNBitsQuantizer`` runs on every MatMul; `quantize_blocks`):

- blocks of ``block_size`` = 32 input features, one fp32 scale per (output feature, block);
- symmetric, no zero-point input: the kernel uses its default 2^(bits-1) (8 for int4, 128 for int8). Float
  zero points put MatMulNBits on a slow path (20-80x, issue 19), so none are written;
- ``accuracy_level`` 4: the kernel quantizes each row of the activations to int8 per block on its own and
  accumulates in int32 (MLAS's CompInt8 path). Row-local, so a request's logits never depend on its batch
  mates (tested bitwise: tests/exporter/test_quantize.py). ``quantize_dynamic`` (DynamicQuantizeMatMul,
  one activation scale per tensor) is not used: it breaks that.

The embedding table is gathered with ``com.microsoft::GatherBlockQuantized`` from the same blocks (data
[V, H·bits/8] uint8, scales [V, H/32]): a tied LM head and the embedding share one quantized copy. The
gather's data is a second initializer over the very bytes of the head's MatMulNBits weight (same file,
offset and length; `VIEW_DOC`), because the two ops want different shapes for the same bytes.

w8a8 (SmoothQuant's "W8A8, per-token dynamic activations" without the smoothing): each weight column is int8
with one symmetric scale per output feature, each activation row is quantized on its own at run time, and the
product runs in ONNX Runtime's integer GEMM (``MatMulIntegerToFloat``, uint8 × int8: the VNNI path). The int32
sums are exact, so a row's output is bitwise the same alone or beside other rows, at any row count. Why: MatMulNBits
turns compute-bound beyond two rows (each verification row of the int4 target costs about a seventh of a
one-token pass), while the integer GEMM keeps its throughput; a verification block then costs little more than
one token (reports/quant/w8a8/). The embedding is gathered from int8 blocks (GatherBlockQuantized, bits 8); the
head keeps its own int8 copy in the GEMM's layout. The sums are exact where the CPU multiplies u8 × s8 without
saturating: x86 with AVX-VNNI, AVX512-VNNI or AMX, and ARM. On x86 CPUs with AVX2 but no VNNI, ONNX Runtime's
u8 × s8 kernel adds pairs of products in int16 (VPMADDUBSW), which saturates: still row-local, less accurate.
`build` warns there (`int8_gemm_saturates`).

Shapes (K input features, N output features, kb = K/32 blocks, blob = 32·bits/8 bytes):
``packed [N, kb, blob] uint8``, ``scales [N, kb] float32``; a weight W [K, N] dequantizes as
``W[k, n] ≈ scales[n, k // 32] · (q[n, k] - 2^(bits-1))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from ..errors import ConfigError
from .builder import MS_DOMAIN, GraphBuilder, linear

__all__ = ["WeightFormat", "WEIGHT_FORMATS", "DEFAULT_WEIGHTS", "KEY_CHUNK", "EXACT_MAX_KEYS", "aligned",
           "check_exact_context", "quantize_blocks", "dequantize_blocks", "matmul_nbits", "gather_block_quantized",
           "quantize_rows_int8", "int8_row_scale", "matmul_w8a8", "quantize_matmuls_w8a8", "int8_gemm_saturates", "project",
           "share_quantized_embedding", "VIEW_DOC", "MS_DOMAIN"]


#: weight formats `build --weights` accepts: name -> bits (None = float32, no quantization)
WEIGHT_FORMATS = {"int4": 4, "int8": 8, "w8a8": 8, "fp32": None}

#: the embedded default's format: int4, the fastest end to end (reports/quant/quant.md). Lossless because the
#: quantized graph's attention sums over keys in one fixed order (target.py, `_exact_attention`): a row's
#: logits are bitwise the same in a decode pass and in a verification block (tests/exporter/test_quantize.py).
DEFAULT_WEIGHTS = "int4"

KEY_CHUNK = 128   #: keys per partial P·V product of the quantized target's exact attention
                 #: (exporter/target.py, `_exact_attention`)


#: the most key entries the exact attention keeps exact: its second GEMM sums L / KEY_CHUNK chunk partials,
#: and MLAS never splits a reduction of KEY_CHUNK terms (longer ones it splits where its thread layout says)
EXACT_MAX_KEYS = KEY_CHUNK * KEY_CHUNK


def aligned(entries: int) -> int:
    """`entries` rounded up to a positive multiple of KEY_CHUNK: the KV buffer length every target feed uses
    (the exact attention reads the cache in KEY_CHUNK chunks in place; `runtime.kv_cache`)."""
    return max(1, -(-int(entries) // KEY_CHUNK)) * KEY_CHUNK


def check_exact_context(weights: str, max_context: int, largest_bucket: int) -> None:
    """Refuse a quantized build whose passes could attend more than EXACT_MAX_KEYS keys (a past of up to
    max_context - 1 entries plus a query of up to the largest bucket's rows).

    Raises:
        ConfigError: naming the limit and what to pass instead.
    """
    if weights != "fp32" and max_context + largest_bucket > EXACT_MAX_KEYS:
        raise ConfigError(f"max_context: {max_context} tokens plus the largest target bucket {largest_bucket} exceed "
                          f"the {EXACT_MAX_KEYS} keys the {weights} target's exact attention keeps exact (speculative "
                          f"output would no longer equal ar's); pass --max-context <= "
                          f"{EXACT_MAX_KEYS - largest_bucket} or --weights fp32")


#: doc_string of an initializer that is a view of another one's bytes (`builder.save_model` points it there)
VIEW_DOC = "dspark:view-of:"


@dataclass(frozen=True)
class WeightFormat:
    """How the target's linear layers, LM head and embedding are stored.

    Attributes:
        name: "int4", "int8", "w8a8" or "fp32".
        block_size: input features per quantization block (MatMulNBits' ``block_size``).
        accuracy_level: MatMulNBits' ``accuracy_level`` (4 = int8 activations per row and block).
    """

    name: str = "fp32"
    block_size: int = 32
    accuracy_level: int = 4

    def __post_init__(self):
        if self.name not in WEIGHT_FORMATS:
            raise ConfigError(f"weights: unknown weight format {self.name!r}; expected one of "
                              f"{sorted(WEIGHT_FORMATS)} (int4 and int8: MatMulNBits block-quantized weights, "
                              "w8a8: int8 weights and per-row int8 activations, fp32: plain float32)")

    @property
    def bits(self) -> int | None:
        return WEIGHT_FORMATS[self.name]

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def per_row_activations(self) -> bool:
        """w8a8: linear layers are `matmul_w8a8` (per-row int8 activations), not MatMulNBits."""
        return self.name == "w8a8"


def _quantizer(fmt: WeightFormat):
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 DefaultWeightOnlyQuantizer)

    return DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=fmt.block_size, is_symmetric=True, accuracy_level=fmt.accuracy_level, bits=fmt.bits))


def quantize_blocks(weight_kn: np.ndarray, fmt: WeightFormat) -> tuple[np.ndarray, np.ndarray]:
    """Block-quantize a MatMul weight W [K, N] with ONNX Runtime's quantizer.

    Returns:
        (packed [N, kb, blob] uint8, scales [N, kb] float32), MatMulNBits' B and scales (module docstring).
    """
    w = np.ascontiguousarray(weight_kn, dtype=np.float32)
    packed, scales, _ = _quantizer(fmt).qbits_block_quant(w)
    n, k = w.shape[1], w.shape[0]
    kb = -(-k // fmt.block_size)
    return packed.reshape(n, kb, -1), np.asarray(scales, np.float32).reshape(n, kb)


def dequantize_blocks(packed: np.ndarray, scales: np.ndarray, fmt: WeightFormat, k: int) -> np.ndarray:
    """The float32 weight W [K, N] that `quantize_blocks`' output stands for (the kernels' formula)."""
    n, kb, _ = packed.shape
    flat = packed.reshape(n, -1)
    if fmt.bits == 4:
        q = np.stack([flat & 0x0F, flat >> 4], axis=-1).reshape(n, -1)   # low nibble first
    else:
        q = flat
    q = q[:, :kb * fmt.block_size].astype(np.float32) - 2 ** (fmt.bits - 1)
    w = q.reshape(n, kb, fmt.block_size) * scales[:, :, None]
    return np.ascontiguousarray(w.reshape(n, -1)[:, :k].T)


def matmul_nbits(b, x: str, weight_name: str, weight_out_in: np.ndarray, fmt: WeightFormat, name: str,
                 bias: np.ndarray | None = None, bias_name: str | None = None) -> str:
    """x @ Wᵀ (+ bias) through MatMulNBits for a PyTorch Linear weight W [out, in]; x [..., in] -> [..., out].

    Initializers: ``{weight_name}_Q{bits}`` (packed) and ``{weight_name}_scales``, the names ONNX Runtime's
    ``MatMulNBitsQuantizer`` gives them. Reused when already added (a tied head after the embedding).
    """
    q_name, s_name = f"{weight_name}_Q{fmt.bits}", f"{weight_name}_scales"
    out_f, in_f = weight_out_in.shape
    if q_name not in b.initializers:
        packed, scales = quantize_blocks(np.asarray(weight_out_in, np.float32).T, fmt)
        b.weight(q_name, packed)
        b.weight(s_name, scales)
    inputs = [x, q_name, s_name]
    if bias is not None:
        inputs += ["", "", b.weight(bias_name, bias)]
    return b.op("MatMulNBits", inputs, name, domain=MS_DOMAIN, K=int(in_f), N=int(out_f), bits=fmt.bits,
                block_size=fmt.block_size, accuracy_level=fmt.accuracy_level)


def quantize_rows_int8(weight_out_in: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 weights with one scale per output feature.

    Args:
        weight_out_in: W [N, K] float32 (a PyTorch Linear weight, or an LM head [V, H]).

    Returns:
        (w_q [K, N] int8, transposed for MatMulInteger; scale [N] float32), with
        ``W ≈ w_q.T · scale[:, None]``, ``scale_n = max|W_n| / 127`` (1 for an all-zero row, whose w_q is then 0).
    """
    weight = np.asarray(weight_out_in, np.float32)
    peak = np.abs(weight).max(axis=1)
    scale = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
    w_q = np.clip(np.rint(weight / scale[:, None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(w_q.T), scale


def int8_row_scale(b, x: str, name: str) -> str:
    """The per-row int8 activation scale ``s_i = max(max|x_i|, 1e-30) / 127`` of x [..., n, K] -> [..., n, 1]
    (standard ONNX ops), shared by `matmul_w8a8` and the drafter's `int8_lm_head`."""
    peak = b.op("ReduceMax", [b.op("Abs", [x], name), b.const([-1])], name, keepdims=1)
    return b.op("Div", [b.op("Max", [peak, b.const(1e-30, "float32")], name), b.const(127.0, "float32")], name)


def matmul_w8a8(b, x: str, weight_name: str, weight_out_in: np.ndarray, name: str,
                bias: np.ndarray | None = None, bias_name: str | None = None, rows: str = "rows") -> str:
    """x @ Wᵀ (+ bias) for a PyTorch Linear weight W [out, in] in w8a8; x [..., n, in] -> [..., n, out].

    Per row i of x: ``s_i = max(max|x_i|, 1e-30) / 127``, ``x_u8 = QuantizeLinear(x_i, s_i, 128)`` (blocked
    quantization, one block per row); then ``com.microsoft::MatMulIntegerToFloat(x_u8, w_q, s_i, scale, 128)``
    = ``(Σ_k (x_u8 − 128)·w_q) · scale_n · s_i``, then + bias: exact int32 sums, then one float product per
    element, so a row's output does not depend on the other rows. Weights from `quantize_rows_int8`, stored as
    ``{weight_name}_W8`` (int8 [in, out]) and ``{weight_name}_W8_scales`` ([out]), reused when already added.
    The zero-point tensor (128 in the shape of s) is built once per `rows` key: linear layers fed the same
    rows share it. Like MatMulNBits' int8 activations, a NaN inside a row may not survive the quantization.
    """
    q_name, s_name = f"{weight_name}_W8", f"{weight_name}_W8_scales"
    if q_name not in b.initializers:
        w_q, scale = quantize_rows_int8(weight_out_in)
        b.weight(q_name, w_q)
        b.weight(s_name, scale)
    k = int(np.asarray(weight_out_in).shape[1])
    row_scale = int8_row_scale(b, x, name)   # [..., n, 1]
    zp_key = f"w8a8_zero_point/{rows}"
    zero_point = b.shared.get(zp_key)
    if zero_point is None:
        zero_point = b.op("Expand", [b.const(128, "uint8"), b.op("Shape", [row_scale], "w8a8_zero_point")],
                          "w8a8_zero_point")
        b.shared[zp_key] = zero_point
    x_u8 = b.op("QuantizeLinear", [x, row_scale, zero_point], name, axis=-1, block_size=k)
    y = b.op("MatMulIntegerToFloat", [x_u8, q_name, row_scale, s_name, b.const(128, "uint8")], name, domain=MS_DOMAIN)
    # not the op's own bias input: ONNX Runtime 1.32's CPU kernel scales it by the row scale
    return y if bias is None else b.op("Add", [y, b.weight(bias_name, np.asarray(bias, np.float32))], name)


def quantize_matmuls_w8a8(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite every MatMul of `model` with a constant 2-D weight [in, out] (a `builder.linear`) as `matmul_w8a8`,
    in place; returns `model`. The replaced float weights are dropped once nothing reads them. Linears reading
    the same input share its zero point. Node names keep the MatMul's scope (``/{graph}_w8a8/{scope}/{op}``), so
    profiles still attribute them to their layer."""
    inits = {t.name: t for t in model.graph.initializer}
    builders: dict[str, GraphBuilder] = {}
    nodes, replaced = [], set()
    for node in model.graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
        if weight is None or len(weight.dims) != 2:
            nodes.append(node)
            continue
        parts = node.name.split("/")   # "/{graph}/{scope...}/MatMul"
        graph, scope = (parts[1], "/".join(parts[2:-1])) if len(parts) > 3 else (model.graph.name, node.name)
        b = builders.setdefault(graph, GraphBuilder(f"{graph}_w8a8"))
        start = len(b.nodes)
        matmul_w8a8(b, node.input[0], node.input[1], onnx.numpy_helper.to_array(weight).T, scope,
                    rows=node.input[0])
        b.nodes[-1].output[0] = node.output[0]
        nodes.extend(b.nodes[start:])
        replaced.add(node.input[1])
    if not builders:
        return model
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    read = {i for n in model.graph.node for i in n.input}
    keep = [t for t in model.graph.initializer if t.name in read or t.name not in replaced]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    for b in builders.values():
        model.graph.initializer.extend(t for name, t in b.initializers.items() if name in read)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    return model


def int8_gemm_saturates() -> bool:
    """Whether this machine's u8 × s8 GEMM saturates (x86-64 without AVX-VNNI, AVX512-VNNI or AMX-INT8, read from
    /proc/cpuinfo); False where that cannot be told (another OS or architecture)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return False
    return flags is not None and not {"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags)


def project(b, x: str, weight_name: str, weight_out_in: np.ndarray, fmt: WeightFormat, name: str,
            bias: np.ndarray | None = None, bias_name: str | None = None, rows: str = "rows") -> str:
    """x @ Wᵀ (+ bias) in `fmt`: `matmul_w8a8` for w8a8 (`rows`: see there), `matmul_nbits` for int4 / int8,
    `builder.linear` (a float MatMul) for fp32."""
    if not fmt.quantized:
        return linear(b, x, weight_name, weight_out_in, name, bias, bias_name)
    if fmt.per_row_activations:
        return matmul_w8a8(b, x, weight_name, weight_out_in, name, bias, bias_name, rows)
    return matmul_nbits(b, x, weight_name, weight_out_in, fmt, name, bias, bias_name)


def gather_block_quantized(b, table_name: str, table: np.ndarray, ids: str, fmt: WeightFormat, name: str) -> str:
    """Rows ``ids`` of an embedding table [V, H] stored block-quantized; output [*ids.shape, H] float32.

    The table is quantized as the MatMulNBits weight of a head ``h @ tableᵀ`` (K = H, N = V), under the same
    names as `matmul_nbits` gives it, so a tied head reuses the blocks; the gather reads them through a
    [V, kb·blob] view of the packed bytes (`VIEW_DOC`).

    Raises:
        ConfigError: H is not a multiple of the block size (the gather's blocks must tile a row exactly).
    """
    vocab, hidden = table.shape
    if hidden % fmt.block_size:
        raise ConfigError(f"weights {fmt.name}: the embedding's hidden size {hidden} is not a multiple of the "
                          f"quantization block {fmt.block_size}; pass --weights fp32")
    q_name, s_name = f"{table_name}_Q{fmt.bits}", f"{table_name}_scales"
    if q_name not in b.initializers:
        packed, scales = quantize_blocks(np.asarray(table, np.float32).T, fmt)
        b.weight(q_name, packed)
        b.weight(s_name, scales)
    view = f"{q_name}.rows"
    if view not in b.initializers:
        packed = onnx.numpy_helper.to_array(b.initializers[q_name])
        b.weight(view, packed.reshape(vocab, -1))
        b.initializers[view].doc_string = VIEW_DOC + q_name
    return b.op("GatherBlockQuantized", [view, ids, s_name], name, domain=MS_DOMAIN, bits=fmt.bits,
                block_size=fmt.block_size, gather_axis=0, quantize_axis=1)


def share_quantized_embedding(model: onnx.ModelProto, table_name: str, table: np.ndarray,
                              fmt: WeightFormat) -> onnx.ModelProto:
    """Replace every ``Gather(table_name, ids)`` of `model` by a GatherBlockQuantized over the blocks the
    quantized target stores for the same table (same names and bytes, so `builder.save_model(share_from=
    target.onnx)` points them into the target's data file), and drop the float table if nothing else reads it.

    Why: the drafter's frozen embedding equals the target's and used to point into target.onnx.data; a
    quantized target no longer holds the float table there. The drafter then embeds its block tokens from
    the quantized table (its drafts change by the quantization step; verification is unaffected).
    """
    gathers = [n for n in model.graph.node if n.op_type == "Gather" and n.domain in ("", "ai.onnx")
               and n.input[0] == table_name]
    if not gathers or not fmt.quantized:
        return model
    b = GraphBuilder(model.graph.name)
    for node in gathers:
        gather_block_quantized(b, table_name, table, node.input[1], fmt, "embed_tokens")
        new = b.nodes[-1]
        node.op_type, node.domain = new.op_type, new.domain
        del node.input[:], node.attribute[:]
        node.input.extend(new.input)
        node.attribute.extend(new.attribute)
    have = {i.name for i in model.graph.initializer}
    model.graph.initializer.extend(t for name, t in b.initializers.items() if name not in have)
    if not any(table_name in n.input for n in model.graph.node):
        keep = [i for i in model.graph.initializer if i.name != table_name]
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MS_DOMAIN, 1))
    return model
