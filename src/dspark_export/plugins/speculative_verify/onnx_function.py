"""``dspark::SpeculativeVerify`` as an ONNX function of standard ops (opset 21), so ONNX Runtime runs it unaided.

I/O contract: the table in ``speculative_verify/schema.py``. Vectorised over [R, γ+1]; R, γ, V and M
are all dynamic, so one body (no overload) serves every configuration. Greedy rows take the argmax
path through ``Where``; sampled rows use the warped target p and draft q.

    rows [R, γ+1]  = Min(query_start[:-1, None] + j, query_start[:-1] + verify_lens)
    p = warp(Gather(target_logits, rows)) [R, γ+1, V]       q = warp(draft_logits) [R, γ, V]
    accepted [R, γ] = Where(greedy, x_j == ArgMax(target row j), u_j·q_j(x_j) < p_j(x_j)) ∧ j < verify_lens
    num_accepted   = ReduceSum(CumSum(¬accepted) == 0)
    next_ids       = Where(greedy, ArgMax(target row a), sample(residual or p_a, u_γ))

When every request is greedy (an ``If`` on the temperatures), only the argmax of the M target rows
is computed: no gather of [R, γ+1, V], no warp, no draft probabilities (the same outputs). Otherwise only
the first W = max(verify_lens) draft slots (and W + 1 target rows per request) are warped: the slots past
every request's verify length cannot change an output, and a step without drafts (W = 0: `ar`, or no
request drafted) warps one target row per request and no draft row at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from dspark_export.errors import PluginError
from dspark_export.plugins.common import DOMAIN
from dspark_export.plugins.common.onnx_builder import NodeBuilder, make_function as _make_function, make_if
from dspark_export.plugins.common.onnx_sampling import emit_greedy_masks, emit_sample, emit_warp_probs, unsqueeze_last
from dspark_export.plugins.speculative_verify.schema import SCHEMA

F32, I64 = np.float32, np.int64
ROW_ALIGN = 16   #: float32 values per 64 bytes: warped rows are padded to a multiple (`_emit_warp`)


def make_function(**static_config) -> onnx.FunctionProto:
    """The function body; it takes no configuration (every dimension is dynamic).

    Returns:
        FunctionProto ``dspark.SpeculativeVerify``; formal inputs and outputs are the schema's names.

    Raises:
        PluginError: any configuration is given.
    """
    check_no_config(static_config)
    b = NodeBuilder("/SpeculativeVerify/")
    dims = _emit_dims(b)
    rows = _emit_rows(b, dims)
    is_verified = b.op("Less", b.op("Range", b.const(0, I64), dims["gamma_scalar"], b.const(1, I64)),
                       unsqueeze_last(b, "verify_lens"))  # [R, γ]
    draft_ids = b.op("Where", is_verified, "draft_ids", b.const(0, I64))  # unverified slots may hold placeholders
    is_greedy, all_greedy = emit_greedy_masks(b, "temperature")

    fast = b.branch("greedy/")
    fast_argmax = fast.op("Gather", fast.op("ArgMax", "target_logits", axis=-1, keepdims=0), rows, axis=0)  # [R, γ+1]
    fast_accepted = fast.op("And", _emit_greedy_acceptance(fast, dims, draft_ids, fast_argmax), is_verified)
    fast_num = _emit_num_accepted(fast, fast_accepted)
    fast_next = _emit_greedy_next(fast, fast_argmax, fast_num)

    full = b.branch("mixed/")
    width = full.op("Max", full.op("ReduceMax", "verify_lens", keepdims=1), b.const([0], I64))   # [1] W
    zero, axis1 = b.const([0], I64), b.const([1], I64)
    head = lambda x, w: full.op("Slice", x, zero, w, axis1)  # noqa: E731  the first w slots of [R, ·, ...]
    aligned_v = full.op("Mul", full.op("Div", full.op("Add", dims["V"], b.const([ROW_ALIGN - 1], I64)),
                                       b.const([ROW_ALIGN], I64)), b.const([ROW_ALIGN], I64))
    used = {**dims, "gamma": width, "gamma_plus_1": full.op("Add", width, axis1),   # the W verified slots,
            "V": aligned_v}                                     # their probabilities over V rounded up (_emit_warp)
    target_logits = full.op("Gather", "target_logits", head(rows, used["gamma_plus_1"]), axis=0)  # [R, W+1, V]
    target_probs = _emit_warp(full, target_logits, used, used["gamma_plus_1"])
    draft_probs = _emit_warp(full, head("draft_logits", width), used, width)  # [R, W, V]
    target_argmax = full.op("ArgMax", target_logits, axis=-1, keepdims=0)  # [R, W+1]
    is_accepted = _emit_acceptance(full, used, target_probs, draft_probs, head(draft_ids, width), target_argmax)
    num_accepted = _emit_num_accepted(full, full.op("And", is_accepted, head(is_verified, width)))
    sampled = _emit_next_sample(full, used, target_probs, draft_probs, num_accepted)
    next_ids = full.op("Where", is_greedy, _emit_greedy_next(full, target_argmax, num_accepted), sampled)

    kinds = [TensorProto.INT64, TensorProto.INT64]
    then_graph = fast.to_graph("then", list(zip((fast_num, fast_next), kinds)))
    else_graph = full.to_graph("else", list(zip((num_accepted, next_ids), kinds)))
    b.nodes.append(helper.make_node("If", [all_greedy], ["num_accepted", "next_ids"], name="/SpeculativeVerify/If_greedy",
                                    then_branch=then_graph, else_branch=else_graph))
    return _make_function(SCHEMA.op_type, SCHEMA.input_names, SCHEMA.output_names, b, SCHEMA.doc)


def make_node(inputs: Sequence[str], outputs: Sequence[str], name: str, **config) -> onnx.NodeProto:
    """A ``dspark::SpeculativeVerify`` node.

    Args:
        inputs: the nine input value names in schema order (none is optional).
        outputs: the two output value names (num_accepted, next_ids).
        name: node name, e.g. ``/verify/SpeculativeVerify``.

    Raises:
        PluginError: a configuration is given, or the wrong number of (or empty) inputs or outputs.
    """
    check_no_config(config)
    if len(inputs) != len(SCHEMA.inputs) or len(outputs) != len(SCHEMA.outputs) or not all(inputs):
        raise PluginError(f"{SCHEMA.qualified_name} node {name!r}: expected {len(SCHEMA.inputs)} non-empty inputs "
                          f"{list(SCHEMA.input_names)} and {len(SCHEMA.outputs)} outputs, found {list(inputs)} "
                          f"and {list(outputs)}")
    return helper.make_node(SCHEMA.op_type, list(inputs), list(outputs), name=name, domain=DOMAIN)


def _emit_dims(b: NodeBuilder) -> dict[str, str]:
    """Shape values: R, γ and γ+1 as [1] int64, γ as a scalar, V as [1] int64."""
    gamma = b.op("Shape", "draft_ids", start=1, end=2)
    return {
        "R": b.op("Shape", "draft_ids", start=0, end=1),
        "gamma": gamma,
        "gamma_scalar": b.op("Squeeze", gamma, b.const([0], I64)),
        "gamma_plus_1": b.op("Add", gamma, b.const([1], I64)),
        "V": b.op("Shape", "draft_logits", start=2, end=3),
    }


def _emit_rows(b: NodeBuilder, dims: dict[str, str]) -> str:
    """rows [R, γ+1] int64: each request's target rows, past its width repeating its last row."""
    starts = b.op("Slice", "query_start", b.const([0], I64), b.const([-1], I64), b.const([0], I64))  # [R]
    offsets = b.op("Range", b.const(0, I64), b.op("Squeeze", dims["gamma_plus_1"], b.const([0], I64)), b.const(1, I64))
    rows = b.op("Add", unsqueeze_last(b, starts), offsets)
    return b.op("Min", rows, unsqueeze_last(b, b.op("Add", starts, "verify_lens")))


def _emit_warp(b: NodeBuilder, logits: str, dims: dict[str, str], width: str) -> str:
    """warp_probs of logits [R, width, V] with each request's parameters repeated over width -> [R, width, Va],
    Va = dims["V"] (V rounded up to ROW_ALIGN; the extra columns are logit -inf, probability 0).

    Why the padding: ONNX Runtime adds a float row (softmax and renormalisation sums) in an order that depends
    on the row's alignment in memory, so with V·4 bytes not a multiple of 64 a row's probabilities would depend
    on its index, that is on the slot and on the batch's widest verify length; aligned rows do not.
    """
    vocab = b.op("Shape", logits, start=2, end=3)
    flat = b.op("Reshape", logits, b.op("Concat", b.const([-1], I64), vocab, axis=0))
    pads = b.op("Concat", b.const([0, 0, 0], I64), b.op("Sub", dims["V"], vocab), axis=0)
    flat = b.op("Pad", flat, pads, b.const(-np.inf, F32))
    row_shape = b.op("Concat", dims["R"], width, axis=0)
    params = [
        b.op("Reshape", b.op("Expand", unsqueeze_last(b, name), row_shape), b.const([-1], I64))
        for name in ("temperature", "top_k", "top_p")
    ]
    probs = emit_warp_probs(b, flat, *params)
    return b.op("Reshape", probs, b.op("Concat", row_shape, dims["V"], axis=0), allowzero=1)  # width may be 0


def _emit_num_accepted(b: NodeBuilder, is_accepted: str) -> str:
    """num_accepted [R] int64: the length of the accepted prefix of is_accepted [R, γ] bool."""
    rejected_so_far = b.op("CumSum", b.op("Cast", b.op("Not", is_accepted), to=TensorProto.INT64), b.const(1, I64))
    run = b.op("Cast", b.op("Equal", rejected_so_far, b.const(0, I64)), to=TensorProto.INT64)
    return b.op("ReduceSum", run, b.const([1], I64), keepdims=0)


def _emit_greedy_acceptance(b: NodeBuilder, dims: dict[str, str], draft_ids: str, target_argmax: str) -> str:
    """[R, γ] bool: draft x_j equals the argmax of target row j."""
    return b.op("Equal", draft_ids, b.op("Slice", target_argmax, b.const([0], I64), dims["gamma"], b.const([1], I64)))


def _emit_greedy_next(b: NodeBuilder, target_argmax: str, num_accepted: str) -> str:
    """next_ids [R] int64 of greedy rows: the argmax of target row num_accepted."""
    greedy = b.op("GatherElements", target_argmax, unsqueeze_last(b, num_accepted), axis=1)
    return b.op("Squeeze", greedy, b.const([1], I64))


def _emit_acceptance(b, dims, target_probs: str, draft_probs: str, draft_ids: str, target_argmax: str) -> str:
    """[R, γ] bool before the verify_lens mask: greedy x == argmax p, else u·q(x) < p(x)."""
    gamma_end = dims["gamma"]
    zero, axis1 = b.const([0], I64), b.const([1], I64)
    target_draft_rows = b.op("Slice", target_probs, zero, gamma_end, axis1)  # [R, γ, V]
    index = unsqueeze_last(b, draft_ids)
    target_at = b.op("Squeeze", b.op("GatherElements", target_draft_rows, index, axis=2), b.const([2], I64))
    draft_at = b.op("Squeeze", b.op("GatherElements", draft_probs, index, axis=2), b.const([2], I64))
    uniforms = b.op("Slice", "uniforms", zero, gamma_end, axis1)
    sampled = b.op("Less", b.op("Mul", uniforms, draft_at), target_at)
    greedy = _emit_greedy_acceptance(b, dims, draft_ids, target_argmax)
    is_greedy = unsqueeze_last(b, b.op("LessOrEqual", "temperature", b.const(0, F32)))
    # ORT has no bool Where kernel: select with And/Or.
    return b.op("Or", b.op("And", is_greedy, greedy), b.op("And", b.op("Not", is_greedy), sampled))


def _emit_next_sample(b, dims, target_probs: str, draft_probs: str, num_accepted: str) -> str:
    """next_ids of sampled rows [R] int64: residual max(p_a − q_a, 0) when rejected (p_a if all zero), else p_a.
    With no draft slot (dims["gamma"] = 0) nothing is rejected: p_a, and no draft row is read."""
    target_flat = b.op("Reshape", target_probs, b.op("Concat", b.const([-1], I64), dims["V"], axis=0))
    request = b.op("Range", b.const(0, I64), b.op("Squeeze", dims["R"], b.const([0], I64)), b.const(1, I64))
    target_row = b.op("Add", b.op("Mul", request, dims["gamma_plus_1"]), num_accepted)
    p_next = b.op("Gather", target_flat, target_row, axis=0)  # [R, V]
    uniform = b.op("Squeeze", b.op("Slice", "uniforms", b.const([-1], I64), b.const([np.iinfo(np.int64).max], I64),
                                   b.const([1], I64)), b.const([1], I64))
    plain, drafts = b.branch("no_drafts/"), b.branch("drafts/")
    plain_ids = emit_sample(plain, p_next, uniform)
    draft_flat = drafts.op("Reshape", draft_probs, drafts.op("Concat", b.const([-1], I64), dims["V"], axis=0))
    last_slot = drafts.op("Sub", dims["gamma"], b.const([1], I64))
    draft_row = drafts.op("Add", drafts.op("Mul", request, dims["gamma"]), drafts.op("Min", num_accepted, last_slot))
    q_next = drafts.op("Gather", draft_flat, draft_row, axis=0)  # [R, V]
    residual = drafts.op("Relu", drafts.op("Sub", p_next, q_next))
    has_residual = drafts.op("Greater", drafts.op("ReduceSum", residual, b.const([1], I64), keepdims=0),
                             b.const(0, F32))
    use_residual = drafts.op("And", drafts.op("Less", num_accepted, "verify_lens"), has_residual)
    residual_ids = emit_sample(drafts, drafts.op("Where", unsqueeze_last(drafts, use_residual), residual, p_next),
                               uniform)
    no_drafts = b.op("Equal", b.op("Squeeze", dims["gamma"], b.const([0], I64)), b.const(0, I64))
    ids = make_if(b, no_drafts, (plain, plain_ids), (drafts, residual_ids), TensorProto.INT64)
    return b.op("Reshape", ids, b.op("Shape", num_accepted))  # [R] for shape inference (If outputs carry none)


def check_no_config(config: Mapping[str, object]) -> None:
    """SpeculativeVerify has no static configuration; raise PluginError for any key."""
    if config:
        raise PluginError(f"{SCHEMA.qualified_name} takes no static configuration (every dimension is dynamic), "
                          f"found {sorted(config)}")
