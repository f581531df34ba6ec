"""ONNX twins of ``common.warp_probs`` and ``common.sample_from_probs``, built from standard ops.

Rows are flattened: logits [n, V] float32 with per-row parameters [n]. The sorting paths run only
when some row asks for them (an ``If`` on "any top_k > 0" and another on "any top_p < 1"), so a batch
with no filtering pays no sort of V per row. Greedy rows are sampled at temperature 1 and the caller
replaces them by the argmax with a ``Where``.

    temperature ─> Where(T > 0, T, 1) ─┐
    logits [n, V] ─────────────────── Div ─> If(any top_k > 0: top-k mask) ─> softmax
                                               ─> If(any top_p < 1: top-p filter, renormalise) ─> probs [n, V]
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from dspark_export.plugins.common.onnx_builder import NodeBuilder, make_if

F32, I64 = np.float32, np.int64
INT64_MAX = np.iinfo(np.int64).max


def emit_warp_probs(b: NodeBuilder, logits: str, temperature: str, top_k: str, top_p: str) -> str:
    """Emit the warp of ``logits`` [n, V] float32 by temperature [n] f32, top_k [n] i64, top_p [n] f32.

    Returns:
        probs: [n, V] float32 (rows at temperature 0 are warped at temperature 1; see the module docstring).
    """
    safe_temperature = b.op("Where", b.op("Greater", temperature, b.const(0, F32)), temperature, b.const(1, F32))
    scaled = b.op("Div", logits, unsqueeze_last(b, safe_temperature))
    top_k_branch = b.branch("top_k/")
    masked = make_if(
        b, emit_any(b, b.op("Greater", top_k, b.const(0, I64))),
        (top_k_branch, _emit_top_k(top_k_branch, scaled, top_k)), (b.branch("no_top_k/"), scaled), TensorProto.FLOAT,
    )
    probs = emit_softmax(b, masked)
    top_p_branch = b.branch("top_p/")
    return make_if(
        b, emit_any(b, b.op("Less", top_p, b.const(1, F32))),
        (top_p_branch, _emit_top_p(top_p_branch, probs, top_p)), (b.branch("no_top_p/"), probs), TensorProto.FLOAT,
    )


def emit_sample(b: NodeBuilder, probs: str, uniforms: str) -> str:
    """Emit ``sample_from_probs``: probs [n, V] float32, uniforms [n] float32 → ids [n] int64."""
    cumulative = b.op("CumSum", probs, b.const(1, I64))
    last = b.const([-1], I64)
    total = b.op("Slice", cumulative, last, b.const([INT64_MAX], I64), b.const([1], I64))  # [n, 1]
    threshold = b.op("Mul", unsqueeze_last(b, uniforms), total)
    below = b.op("Cast", b.op("LessOrEqual", cumulative, threshold), to=TensorProto.INT64)
    count = b.op("ReduceSum", below, last, keepdims=0)
    is_positive = b.op("Cast", b.op("Greater", probs, b.const(0, F32)), to=TensorProto.FLOAT)
    last_positive = b.op("ArgMax", is_positive, axis=-1, keepdims=0, select_last_index=1)
    return b.op("Min", count, last_positive)


def emit_argmax(b: NodeBuilder, logits: str) -> str:
    """Greedy choice: logits [n, V] float32 → ids [n] int64, first index on ties."""
    return b.op("ArgMax", logits, axis=-1, keepdims=0, select_last_index=0)


def emit_softmax(b: NodeBuilder, x: str) -> str:
    """Softmax over the last axis in float32 after subtracting the row max (as ``common._softmax``)."""
    axes = b.const([-1], I64)
    exp = b.op("Exp", b.op("Sub", x, b.op("ReduceMax", x, axes, keepdims=1)))
    return b.op("Div", exp, b.op("ReduceSum", exp, axes, keepdims=1))


def emit_greedy_masks(b: NodeBuilder, temperature: str) -> tuple[str, str]:
    """(is_greedy [n] bool: temperature <= 0, all_greedy: a scalar bool, True when every row is greedy or n = 0)."""
    is_greedy = b.op("LessOrEqual", temperature, b.const(0, F32))
    return is_greedy, b.op("Not", emit_any(b, b.op("Not", is_greedy)))


def emit_any(b: NodeBuilder, mask: str) -> str:
    """A scalar bool: whether any element of the bool tensor ``mask`` is true (False when empty)."""
    count = b.op("ReduceSum", b.op("Cast", mask, to=TensorProto.INT64), keepdims=0)
    return b.op("Greater", count, b.const(0, I64))


def unsqueeze_last(b: NodeBuilder, x: str) -> str:
    return b.op("Unsqueeze", x, b.const([-1], I64))


def _emit_top_k(b: NodeBuilder, scaled: str, top_k: str) -> str:
    """-inf below each row's k-th largest value; sorts only max(top_k) values per row (clamped to [1, V])."""
    one = b.const([1], I64)
    vocab = b.op("Shape", scaled, start=1, end=2)
    width = b.op("Max", b.op("Min", b.op("ReduceMax", top_k, keepdims=1), vocab), one)  # [1]
    values, _ = b.op("TopK", scaled, width, num_outputs=2, axis=-1, largest=1, sorted=1)
    kth_index = b.op("Min", b.op("Max", b.op("Sub", top_k, b.const(1, I64)), b.const(0, I64)), b.op("Sub", width, one))
    kth = b.op("GatherElements", values, unsqueeze_last(b, kth_index), axis=1)  # [n, 1]
    is_off = unsqueeze_last(b, b.op("LessOrEqual", top_k, b.const(0, I64)))
    keep = b.op("Or", b.op("GreaterOrEqual", scaled, kth), is_off)
    return b.op("Where", keep, scaled, b.const(-np.inf, F32))


#: values the top-p filter sorts first (`_emit_top_p`); the full sort of V runs only when they hold < top_p
TOP_P_HEAD = 1024


def _emit_top_p(b: NodeBuilder, probs: str, top_p: str, head: int = TOP_P_HEAD) -> str:
    """Stable descending sort (TopK breaks ties by lower index), exclusive CumSum < top_p, top-1 kept.

    Why two paths: sorting V = 49,152 values per row dominated a batched sampling step. The first min(head, V)
    sorted values decide every kept token whenever their sum reaches top_p (the cumulative sum only grows, so
    nothing after them is kept): then only they are sorted. CumSum adds left to right, so their prefix sums
    are the full sort's, bit for bit; otherwise (some row's head sums below its top_p) the full sort runs.
    Rows with top_p >= 1 keep every token either way.
    """
    vocab = b.op("Shape", probs, start=1, end=2)
    width = b.op("Min", vocab, b.const([head], I64))
    head_probs, head_order = b.op("TopK", probs, width, num_outputs=2, axis=-1, largest=1, sorted=1)
    head_exclusive = b.op("CumSum", head_probs, b.const(1, I64), exclusive=1)
    last = b.const([-1], I64)
    head_sum = b.op("Add", b.op("Slice", head_exclusive, last, b.const([INT64_MAX], I64), b.const([1], I64)),
                    b.op("Slice", head_probs, last, b.const([INT64_MAX], I64), b.const([1], I64)))   # [n, 1]
    keeps_all = unsqueeze_last(b, b.op("GreaterOrEqual", top_p, b.const(1, F32)))
    decided = b.op("Or", b.op("GreaterOrEqual", head_sum, unsqueeze_last(b, top_p)), keeps_all)
    head_branch, full_branch = b.branch("head/"), b.branch("full/")
    kept_head = _emit_kept(head_branch, head_probs, head_exclusive, top_p, width)
    zeros = head_branch.op("ConstantOfShape", head_branch.op("Shape", probs),
                           value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))
    kept_head = head_branch.op("ScatterElements", zeros, head_order, kept_head, axis=1)
    kept_head = head_branch.op("Where", keeps_all, probs, kept_head)
    sorted_probs, order = full_branch.op("TopK", probs, vocab, num_outputs=2, axis=-1, largest=1, sorted=1)
    exclusive = full_branch.op("CumSum", sorted_probs, b.const(1, I64), exclusive=1)
    kept_full = full_branch.op("ScatterElements", probs, order,
                               _emit_kept(full_branch, sorted_probs, exclusive, top_p, vocab), axis=1)
    kept = make_if(b, b.op("Not", emit_any(b, b.op("Not", decided))), (head_branch, kept_head),
                   (full_branch, kept_full), TensorProto.FLOAT)
    return b.op("Div", kept, b.op("ReduceSum", kept, b.const([-1], I64), keepdims=1))


def _emit_kept(b: NodeBuilder, sorted_probs: str, exclusive: str, top_p: str, width: str) -> str:
    """The sorted values kept by top-p (exclusive CumSum < top_p, or top_p >= 1, or the first), 0 elsewhere."""
    keep = b.op("Less", exclusive, unsqueeze_last(b, top_p))
    keep = b.op("Or", keep, unsqueeze_last(b, b.op("GreaterOrEqual", top_p, b.const(1, F32))))
    positions = b.op("Range", b.const(0, I64), b.op("Squeeze", width, b.const([0], I64)), b.const(1, I64))
    keep = b.op("Or", keep, b.op("Equal", positions, b.const(0, I64)))  # top-1 always kept
    return b.op("Where", keep, sorted_probs, b.const(0, F32))
