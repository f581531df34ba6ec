"""``dspark::MarkovDraft`` as an ONNX function of standard ops (opset 21), so ONNX Runtime runs it unaided.

I/O contract: the table in ``markov_draft/schema.py``. The γ slots are unrolled (γ is static, from
``MarkovDraftConfig.block_size``); R, V and Vd stay dynamic. The body depends on the configuration, so
the function carries the overload ``MarkovDraftConfig.overload`` and nodes name the same overload.

    prev = anchor_ids
    for k in 0..γ-1:                       (unrolled)
        L_k  = Gather(base_logits, k, axis 1) [+ MatMul(Gather(W1, prev), W2ᵀ)]      [R, Vd]
        j_k  = If(every temperature <= 0,                                           [R]
                  ArgMax(L_k),                                     (greedy batch: no warp, no sampling)
                  Where(temperature <= 0, ArgMax(L_k), sample(warp(L_k), u[:, k])))
        x_k  = j_k, or Gather(d2t, j_k) with a draft vocabulary (target ids)
        prev = x_k
    draft_ids = Concat(x_k), draft_logits = Concat(L_k)
        with d2t: ScatterElements(Expand(OUTSIDE_DRAFT_VOCAB, [R, γ, V]), Expand(d2t, [R, γ, Vd]), ·, axis 2)
    confidence = Sigmoid((MatMul(Concat(hidden, Gather(W1, [anchor, x_0..x_{γ-2}])), w) + b) / T)

With d2t every per-slot op (the W2 product, warp, sampling, argmax) reads Vd rows, not V: the Markov
table W2 [V, r] was the largest read of the drafter block on CPU (reports/drafter/draft-vocab.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from dspark_export.errors import PluginError
from dspark_export.plugins.common import DOMAIN
from dspark_export.plugins.markov_draft.schema import OUTSIDE_DRAFT_VOCAB, SCHEMA, MarkovDraftConfig
from dspark_export.plugins.common.onnx_builder import NodeBuilder, make_function as _make_function, make_if
from dspark_export.plugins.common.onnx_sampling import emit_argmax, emit_greedy_masks, emit_sample, emit_warp_probs, unsqueeze_last

I64 = np.int64


def make_function(**static_config) -> onnx.FunctionProto:
    """The function body for one configuration.

    Args:
        **static_config: the fields of ``MarkovDraftConfig``: block_size (γ), has_markov, has_confidence,
            has_d2t (optional).

    Returns:
        FunctionProto ``dspark.MarkovDraft`` with overload ``config.overload``; formal inputs and outputs
        are the schema's names in schema order (absent optional inputs are never read).
    """
    config = MarkovDraftConfig.from_dict(static_config)
    b = NodeBuilder("/MarkovDraft/")
    is_greedy, all_greedy = emit_greedy_masks(b, "temperature")
    w2_t = b.op("Transpose", "markov_w2") if config.has_markov else None
    ids, logits, prev = [], [], "anchor_ids"
    for k in range(config.block_size):
        step = b.branch(f"step{k}/")
        logits_k = step.op("Gather", "base_logits", step.const(k, I64), axis=1)  # [R, V]
        if config.has_markov:
            bias = step.op("MatMul", step.op("Gather", "markov_w1", prev, axis=0), w2_t)
            logits_k = step.op("Add", logits_k, bias)
        greedy = step.branch("greedy/")
        mixed = step.branch("mixed/")
        probs = emit_warp_probs(mixed, logits_k, "temperature", "top_k", "top_p")
        sampled = emit_sample(mixed, probs, mixed.op("Gather", "uniforms", mixed.const(k, I64), axis=1))
        prev = make_if(step, all_greedy, (greedy, emit_argmax(greedy, logits_k)),
                       (mixed, mixed.op("Where", is_greedy, emit_argmax(mixed, logits_k), sampled)), TensorProto.INT64)
        if config.has_d2t:
            prev = step.op("Gather", "d2t", prev, axis=0)  # draft row -> target id
        b.absorb(step)
        ids.append(unsqueeze_last(b, prev))
        logits.append(b.op("Unsqueeze", logits_k, b.const([1], I64)))
    b.op_into("draft_ids", "Concat", *ids, axis=1)
    if config.has_d2t:
        _emit_scatter(b, b.op("Concat", *logits, axis=1))
    else:
        b.op_into("draft_logits", "Concat", *logits, axis=1)
    _emit_confidence(b, config, ids)
    return _make_function(SCHEMA.op_type, SCHEMA.input_names, SCHEMA.output_names, b, SCHEMA.doc, config.overload)


def make_node(inputs: Sequence[str], outputs: Sequence[str], name: str, **config) -> onnx.NodeProto:
    """A ``dspark::MarkovDraft`` node calling the function of ``config``.

    Args:
        inputs: value names in schema order; "" (or a shorter list) for absent optional inputs, which
            must agree with ``has_markov``/``has_confidence``.
        outputs: the three output value names (draft_ids, draft_logits, confidence).
        name: node name, e.g. ``/drafter/MarkovDraft``.
        **config: the fields of ``MarkovDraftConfig``.

    Raises:
        PluginError: a wrong number of inputs or outputs, or inputs that disagree with the configuration.
    """
    parsed = MarkovDraftConfig.from_dict(config)
    names = list(inputs) + [""] * (len(SCHEMA.inputs) - len(inputs))
    if len(names) != len(SCHEMA.inputs) or len(outputs) != len(SCHEMA.outputs):
        raise PluginError(f"{SCHEMA.qualified_name} node {name!r}: expected at most {len(SCHEMA.inputs)} inputs and "
                          f"{len(SCHEMA.outputs)} outputs, found {len(inputs)} and {len(outputs)}")
    for spec, value in zip(SCHEMA.inputs, names):
        should_have = spec.name in parsed.present_inputs
        if should_have != bool(value):
            state = "requires" if should_have else "must leave empty"
            raise PluginError(f"{SCHEMA.qualified_name} node {name!r}: configuration {parsed} {state} input "
                              f"{spec.name!r}, found {value!r}")
    while names and not names[-1]:
        names.pop()
    return helper.make_node(SCHEMA.op_type, names, list(outputs), name=name, domain=DOMAIN, overload=parsed.overload)


def _emit_scatter(b: NodeBuilder, logits: str) -> None:
    """draft_logits [R, γ, V]: the draft rows ``logits`` [R, γ, Vd] at columns d2t, OUTSIDE_DRAFT_VOCAB elsewhere."""
    rows = b.op("Slice", b.op("Shape", logits), b.const([0], I64), b.const([2], I64))  # [R, γ]
    vocab = b.op("Slice", b.op("Shape", "markov_w1"), b.const([0], I64), b.const([1], I64))  # [V]
    fill = b.op("Expand", b.const(np.array([[[OUTSIDE_DRAFT_VOCAB]]], np.float32), np.float32),
                b.op("Concat", rows, vocab, axis=0))
    index = b.op("Expand", b.op("Reshape", "d2t", b.const([1, 1, -1], I64)), b.op("Shape", logits))
    b.op_into("draft_logits", "ScatterElements", fill, index, logits, axis=2)


def _emit_confidence(b: NodeBuilder, config: MarkovDraftConfig, ids: list[str]) -> None:
    """confidence [R, γ] float32 from hidden, W1 of the previous tokens, w, b and the per-slot temperature."""
    if not config.has_confidence:
        b.op_into("confidence", "ConstantOfShape", b.op("Shape", "uniforms"),
                  value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]))
        return
    features = "hidden"
    if config.has_markov:
        prev_ids = b.op("Concat", unsqueeze_last(b, "anchor_ids"), *ids[:-1], axis=1)  # [R, γ]
        features = b.op("Concat", "hidden", b.op("Gather", "markov_w1", prev_ids, axis=0), axis=-1)
    logit = b.op("Add", b.op("MatMul", features, "confidence_weight"), "confidence_bias")
    b.op_into("confidence", "Sigmoid", b.op("Div", logit, "confidence_temperature"))
