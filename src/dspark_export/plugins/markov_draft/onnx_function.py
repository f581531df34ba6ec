"""``dspark::MarkovDraft`` as an ONNX function of standard ops (opset 21), so ONNX Runtime runs it unaided.

I/O contract: the table in ``markov_draft/schema.py``. The γ slots are unrolled (γ is static, from
``MarkovDraftConfig.block_size``); R, V and Vd stay dynamic. The body depends on the configuration, so
the function carries the overload ``MarkovDraftConfig.overload`` and nodes name the same overload.

    draft_ids, L = If(every temperature <= 0, greedy slots, mixed slots)     (one If for all γ slots)
    slots (unrolled), prev = anchor_ids:
        L_k  = base_logits[:, k] [+ MatMul(Gather(W1, prev), W2ᵀ)]                 [R, Vd]
        j_k  = ArgMax(L_k)                                                  (greedy slots: no warp, no sampling)
               Where(temperature <= 0, ArgMax(L_k), sample(warp(L_k), u[:, k]))  (mixed slots)
        x_k  = j_k, or Gather(d2t, j_k) with a draft vocabulary (target ids)
        prev = x_k
    draft_ids = Concat(x_k), draft_logits = Concat(L_k)   [R, γ, Vd] (over d2t when given)
    confidence = Sigmoid((MatMul(Concat(hidden, Gather(W1, [anchor, x_0..x_{γ-2}])), w) + b) / T)

One If picks all γ slots (ONNX Runtime pays a subgraph call per If); the greedy slots keep rows as
[R, 1, Vd] (one Split of base_logits, no Unsqueeze per slot): five nodes a slot with a Markov head and d2t.
With ``cpu_greedy`` the greedy branch is one ``dspark.cpu::MarkovDraftGreedy`` node (``plugins/cpu_ops``: the
slots in C++, one fused pass over W2 each; ``use_cpu_greedy`` switches a built graph to it).
With d2t every per-slot op (the W2 product, warp, sampling, argmax) reads Vd rows, not V: the Markov table
W2 [V, r] was the largest read of the drafter block on CPU (reports/drafter/draft-vocab.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from dspark_export.errors import PluginError
from dspark_export.plugins.common import DOMAIN
from dspark_export.plugins.cpu_ops import DOMAIN as CPU_DOMAIN
from dspark_export.plugins.markov_draft.schema import SCHEMA, MarkovDraftConfig
from dspark_export.plugins.common.onnx_builder import NodeBuilder, make_function as _make_function
from dspark_export.plugins.common.onnx_sampling import emit_argmax, emit_greedy_masks, emit_sample, emit_warp_probs, unsqueeze_last

I64 = np.int64
CPU_GREEDY_OP = "MarkovDraftGreedy"
#: `build --markov-draft-kernel`: what runs MarkovDraft's greedy slots ("cpu": the C++ kernel; "onnx": standard ops)
MARKOV_DRAFT_KERNELS = ("cpu", "onnx")


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
    anchor = unsqueeze_last(b, "anchor_ids")  # [R, 1]
    greedy, mixed = b.branch("greedy/"), b.branch("mixed/")
    then_graph = _branch_graph(greedy, "then", _emit_greedy_steps(greedy, config, w2_t, anchor))
    else_graph = _branch_graph(mixed, "else", _emit_mixed_steps(mixed, config, w2_t, is_greedy))
    b.nodes.append(helper.make_node("If", [all_greedy], ["draft_ids", "draft_logits"], name=f"{b.prefix}If_slots",
                                    then_branch=then_graph, else_branch=else_graph))
    _emit_confidence(b, config, anchor)
    function = _make_function(SCHEMA.op_type, SCHEMA.input_names, SCHEMA.output_names, b, SCHEMA.doc,
                              config.overload)
    if config.cpu_greedy:
        function.opset_import.append(helper.make_opsetid(CPU_DOMAIN, 1))
    return function


def _emit_greedy_steps(b: NodeBuilder, config: MarkovDraftConfig, w2_t: str | None, anchor: str) -> tuple[str, str]:
    """The γ slots when every row is greedy -> (ids [R, γ] int64, logits [R, γ, Vd] float32).

    Rows stay [R, 1, ·]: one Split of base_logits into the γ slots, ids [R, 1], no Unsqueeze per slot. The same
    values as `_emit_mixed_steps` gives a greedy row (the same MatMul, Add and first-index ArgMax per row).
    """
    if config.cpu_greedy:
        outs = [f"{b.prefix}draft_ids", f"{b.prefix}draft_logits"]
        inputs = ["base_logits", "anchor_ids", "markov_w1", "markov_w2"] + ["d2t"] * config.has_d2t
        b.nodes.append(helper.make_node(CPU_GREEDY_OP, inputs, outs, name=f"{b.prefix}{CPU_GREEDY_OP}",
                                        domain=CPU_DOMAIN))
        return outs[0], outs[1]
    g = config.block_size
    slots = b.op("Split", "base_logits", b.const([1] * g, I64), axis=1, num_outputs=g)
    slots = [slots] if g == 1 else slots
    ids, logits, prev = [], [], anchor
    for k in range(g):
        step = b.branch(f"step{k}/")
        logits_k = slots[k]                                                           # [R, 1, Vd]
        if config.has_markov:
            logits_k = step.op("Add", logits_k, step.op("MatMul", step.op("Gather", "markov_w1", prev, axis=0), w2_t))
        prev = emit_argmax(step, logits_k)                                            # [R, 1]
        if config.has_d2t:
            prev = step.op("Gather", "d2t", prev, axis=0)  # draft row -> target id
        b.absorb(step)
        ids.append(prev)
        logits.append(logits_k)
    return _concat(b, ids), _concat(b, logits)


def _emit_mixed_steps(b: NodeBuilder, config: MarkovDraftConfig, w2_t: str | None, is_greedy: str) -> tuple[str, str]:
    """The γ slots when some row samples -> (ids [R, γ] int64, logits [R, γ, Vd] float32): warp, sample,
    and the argmax for the greedy rows (``Where``)."""
    ids, logits, prev = [], [], "anchor_ids"
    for k in range(config.block_size):
        step = b.branch(f"step{k}/")
        logits_k = step.op("Gather", "base_logits", step.const(k, I64), axis=1)  # [R, Vd]
        if config.has_markov:
            bias = step.op("MatMul", step.op("Gather", "markov_w1", prev, axis=0), w2_t)
            logits_k = step.op("Add", logits_k, bias)
        probs = emit_warp_probs(step, logits_k, "temperature", "top_k", "top_p")
        sampled = emit_sample(step, probs, step.op("Gather", "uniforms", step.const(k, I64), axis=1))
        prev = step.op("Where", is_greedy, emit_argmax(step, logits_k), sampled)
        if config.has_d2t:
            prev = step.op("Gather", "d2t", prev, axis=0)
        b.absorb(step)
        ids.append(unsqueeze_last(b, prev))
        logits.append(b.op("Unsqueeze", logits_k, b.const([1], I64)))
    return _concat(b, ids), _concat(b, logits)


def _branch_graph(b: NodeBuilder, name: str, outputs: tuple[str, str]) -> onnx.GraphProto:
    """An ``If`` branch returning (ids int64, logits float32), both values made inside the branch (no Identity)."""
    infos = [helper.make_tensor_value_info(v, t, None) for v, t in zip(outputs, (TensorProto.INT64, TensorProto.FLOAT))]
    return helper.make_graph(b.nodes, name, [], infos)


def _concat(b: NodeBuilder, parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else b.op("Concat", *parts, axis=1)


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


def _emit_confidence(b: NodeBuilder, config: MarkovDraftConfig, anchor: str) -> None:
    """confidence [R, γ] float32 from hidden, W1 of the previous tokens ([anchor, x_0..x_{γ-2}]), w, b and the
    per-slot temperature."""
    if not config.has_confidence:
        b.op_into("confidence", "ConstantOfShape", b.op("Shape", "uniforms"),
                  value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]))
        return
    features = "hidden"
    if config.has_markov:
        prev_ids = anchor
        if config.block_size > 1:
            head = b.op("Slice", "draft_ids", b.const([0], I64), b.const([config.block_size - 1], I64),
                        b.const([1], I64))
            prev_ids = b.op("Concat", anchor, head, axis=1)  # [R, γ]
        features = b.op("Concat", "hidden", b.op("Gather", "markov_w1", prev_ids, axis=0), axis=-1)
    logit = b.op("Add", b.op("MatMul", features, "confidence_weight"), "confidence_bias")
    b.op_into("confidence", "Sigmoid", b.op("Div", logit, "confidence_temperature"))


def use_cpu_greedy(model: onnx.ModelProto) -> int:
    """Give every MarkovDraft node with a Markov head the ``cpu_greedy`` body, in place; returns how many.

    The node's configuration is read back from its overload tag (``MarkovDraftConfig.overload``); its function
    is rebuilt by ``make_function`` and the model imports the dspark.cpu domain. Nodes without a Markov head
    (their greedy slots are one ArgMax each) and nodes already switched are left as they are.
    """
    configs = {}
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type == SCHEMA.op_type:
            config = _config_from_overload(node.overload)
            if config is not None and config.has_markov and not config.cpu_greedy:
                configs[node.overload] = config
                node.overload = dataclasses.replace(config, cpu_greedy=True).overload
    if not configs:
        return 0
    kept = [f for f in model.functions
            if not (f.domain == DOMAIN and f.name == SCHEMA.op_type and f.overload in configs)]
    new = {dataclasses.replace(c, cpu_greedy=True).overload: dataclasses.replace(c, cpu_greedy=True)
           for c in configs.values()}
    known = {f.overload for f in kept if f.domain == DOMAIN and f.name == SCHEMA.op_type}
    kept += [make_function(**dataclasses.asdict(c)) for tag, c in new.items() if tag not in known]
    del model.functions[:]
    model.functions.extend(kept)
    if not any(o.domain == CPU_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CPU_DOMAIN, 1))
    return len(configs)


def _config_from_overload(tag: str) -> MarkovDraftConfig | None:
    """The configuration whose ``overload`` is ``tag``, or None for a tag this version does not write."""
    parts = tag.split("_")
    if not parts or not parts[0].startswith("g") or not parts[0][1:].isdigit():
        return None
    flags = {"markov": "has_markov", "conf": "has_confidence", "d2t": "has_d2t", "cpu": "cpu_greedy"}
    if not set(parts[1:]) <= set(flags):
        return None
    try:
        config = MarkovDraftConfig(int(parts[0][1:]), has_markov="markov" in parts, has_confidence="conf" in parts,
                                   has_d2t="d2t" in parts, cpu_greedy="cpu" in parts)
    except PluginError:
        return None
    return config if config.overload == tag else None
