"""dspark.cpu::MatMulW4A8: MatMulNBits' int4 product with cheap extra rows, as an ONNX Runtime custom op (CPU).

The op reads MatMulNBits' own inputs (bits 4, block 32, symmetric: B [N, K/32, 16] uint8, scales [N, K/32]
float32) and computes what MatMulNBits at ``accuracy_level`` 4 computes (int8 activations per row and block of
32, exact int32 block sums), so an engine switches kernels by renaming nodes (`use_w4a8`). What differs is the
cost of rows: the kernel unpacks each 16-column weight block once and reuses it for up to 8
rows, so the LM head's extra row costs about a quarter of MatMulNBits' and the SmolLM2 target's 8-token pass
1.8 one-token passes instead of 2.4 (reports/quant/w4a8/). A row's output is bitwise the same alone or packed
with others, at any row count and thread count.

The kernel is `cpu_ops/matmul_w4a8.cpp`, in the dspark.cpu library (`plugins.cpu_ops`: compiled on first use,
cached). It uses AVX512-VNNI where the CPU has it and a portable path with the same results otherwise.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np
import onnx

from ...errors import ConfigError
from ..cpu_ops import DOMAIN, library

__all__ = ["DOMAIN", "OP", "use_w4a8", "fuse_swiglu", "to_w4a8", "INT4_KERNELS", "matmul_w4a8_numpy", "vectorized"]

OP = "MatMulW4A8"
#: `build --int4-kernel`: which kernel runs the int4 linear layers (target and drafter)
INT4_KERNELS = ("w4a8", "matmulnbits")


def _eligible(node: onnx.NodeProto) -> bool:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    inputs = list(node.input)
    return (node.op_type == "MatMulNBits" and attrs.get("bits") == 4 and attrs.get("block_size") == 32
            and attrs.get("accuracy_level") == 4 and attrs.get("N", 0) % 16 == 0 and len(inputs) == 3
            and attrs.get("K", 0) % 32 == 0)


def use_w4a8(model: onnx.ModelProto) -> int:
    """Rename every MatMulNBits node MatMulW4A8 computes (int4, block 32, accuracy_level 4, no zero points or
    bias, N a multiple of 16) in place; returns how many. Inputs and initializers stay as they are."""
    count = 0
    for node in model.graph.node:
        if _eligible(node):
            node.op_type, node.domain = OP, DOMAIN
            del node.attribute[:]
            count += 1
    if count and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return count


def fuse_swiglu(model: onnx.ModelProto) -> int:
    """Fold each MatMulW4A8 → Split (two equal halves, last axis) → QuickGelu(alpha 1) on the first half → Mul by
    the second (a SiLU-gated MLP's gate/up projection) into the MatMulW4A8 node with ``swiglu=1``, in place;
    returns how many. Why: the three elementwise nodes each read and write the [rows, N] product once more and
    run a parallel section of their own (~3 µs a layer at one row, ~0.3 ms at 160 rows on 2 cores). Only a
    chain whose intermediate outputs nothing else reads (graph outputs included) is folded."""
    nodes = list(model.graph.node)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in model.graph.output}
    inits = {t.name: t for t in model.graph.initializer}

    def only(name: str) -> onnx.NodeProto | None:
        users = consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in outputs else None

    def split_sizes(node: onnx.NodeProto) -> list[int] | None:   # the exporter's sizes are initializers
        src = inits.get(node.input[1]) if len(node.input) > 1 else None
        return onnx.numpy_helper.to_array(src).tolist() if src is not None else None

    removed, count = set(), 0
    for mm in nodes:
        if mm.op_type != OP or mm.domain != DOMAIN or any(a.name == "swiglu" for a in mm.attribute):
            continue
        split = only(mm.output[0])
        if split is None or split.op_type != "Split" or len(split.output) != 2:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in split.attribute}
        sizes = split_sizes(split)
        if attrs.get("axis", 0) != -1 or sizes is None or len(sizes) != 2 or sizes[0] != sizes[1] or sizes[0] % 16:
            continue
        act, mul = only(split.output[0]), only(split.output[1])
        if act is None or act.op_type != "QuickGelu" or only(act.output[0]) is not mul or mul is None \
                or mul.op_type != "Mul" or sorted(mul.input) != sorted([act.output[0], split.output[1]]):
            continue
        if {a.name: onnx.helper.get_attribute_value(a) for a in act.attribute}.get("alpha", 1.0) != 1.0:
            continue
        mm.output[0] = mul.output[0]
        mm.attribute.append(onnx.helper.make_attribute("swiglu", 1))
        removed.update(id(n) for n in (split, act, mul))
        count += 1
    if count:
        kept = [n for n in model.graph.node if id(n) not in removed]
        del model.graph.node[:]
        model.graph.node.extend(kept)
    return count


def to_w4a8(model: onnx.ModelProto) -> int:
    """`build --int4-kernel w4a8`'s rewrite: `use_w4a8`, then `fuse_swiglu`; returns the nodes changed."""
    return use_w4a8(model) + fuse_swiglu(model)


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    lib = library()
    p = ctypes.c_void_p
    lib.dspark_w4a8_matmul.argtypes = [p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p, p, p, ctypes.c_int,
                                       ctypes.c_int]
    lib.dspark_w4a8_matmul.restype = None
    lib.dspark_w4a8_vectorized.restype = ctypes.c_int
    return lib


def vectorized() -> bool:
    """Whether this CPU runs the AVX512-VNNI path (else the portable one, same results)."""
    return bool(_lib().dspark_w4a8_vectorized())


def matmul_w4a8_numpy(x: np.ndarray, packed: np.ndarray, scales: np.ndarray, portable: bool = False,
                      swiglu: bool = False) -> np.ndarray:
    """The op on numpy arrays (tests, benchmarks): x [M, K] float32, packed [N, K/32, 16] uint8, scales
    [N, K/32] float32 -> [M, N] float32, or with ``swiglu`` [M, N/2]: silu(first half) · second half."""
    x = np.ascontiguousarray(x, np.float32)
    packed = np.ascontiguousarray(packed, np.uint8)
    scales = np.ascontiguousarray(scales, np.float32)
    n, kb, blob = packed.shape
    if blob != 16 or n % (32 if swiglu else 16) or x.ndim != 2 or x.shape[1] != kb * 32 or scales.size != n * kb:
        raise ConfigError(f"{OP}: expected x [M, K], packed [N, K/32, 16] with N % 16 == 0 and scales [N, K/32]; "
                          f"found x {x.shape}, packed {packed.shape}, scales {scales.shape}")
    y = np.empty((x.shape[0], n // 2 if swiglu else n), np.float32)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    _lib().dspark_w4a8_matmul(ptr(x), x.shape[0], kb * 32, n, ptr(packed), ptr(scales), ptr(y), int(portable),
                              int(swiglu))
    return y
