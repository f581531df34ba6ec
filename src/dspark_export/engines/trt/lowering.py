"""Lowering of the canonical graphs to the form TensorRT's ONNX parser builds: ``dspark`` nodes become plugins.

The canonical graphs (docs/ARCHITECTURE.md, "Canonical graphs") carry each ``dspark`` op as a custom node
plus its ONNX function body, so ONNX Runtime runs them unaided. TensorRT must instead run the op as a
plugin (``plugins/tensorrt_plugins.py``; the function bodies hold a full-vocabulary TopK and an int64
CumSum that TensorRT 10 does not import). The lowering, per ``dspark`` node:

- keeps op type and domain (= plugin name and namespace, ``plugins/common/tensorrt_spec.py``) and the node name;
- feeds every schema input in order, an absent optional input (MarkovDraft without Markov or confidence
  weights) as a one-element zero placeholder initializer, because the parser hands an empty input to
  the plugin as a null tensor;
- writes the plugin attributes: ``plugin_namespace``, ``plugin_version``, ``aot`` = 1, and the plugin
  fields (``has_markov`` / ``has_confidence`` from which optional inputs are present, ``block_v``,
  ``num_probes``), and drops the ONNX overload tag;
- declares each output's type and shape (``value_info``) from the plugin's output rules, since ONNX shape
  inference knows nothing of a plugin node.

A MarkovDraft node with a draft vocabulary (input ``d2t``) is first expanded to the full-vocabulary form the
plugin takes (``expand_draft_vocab``): its base logits [R, γ, Vd] are scattered to [R, γ, V] with
``OUTSIDE_DRAFT_VOCAB`` (ScatterElements) and its W2 rows [Vd, r] into a zero [V, r] table (ScatterND),
``d2t`` is dropped, and the plugin's [R, γ, V] logits are gathered back at d2t (Gather, axis 2), so the graph's
``draft_logits`` stays [R, γ, Vd] on both backends. The drafts, logits and confidence are the same
(plugins/markov_draft/schema.py says why); the GPU then reads the full W2, which on a GPU is small next to
the block's other reads.

An int8 drafter LM head (``exporter.drafter.int8_lm_head``: per-row quantization of h with Abs, ReduceMax,
Round, Clip and Cast to uint8, then MatMulInteger, which TensorRT 10 does not import, and the scale
products) becomes weight-only int8: ``MatMul(h, DequantizeLinear(w_q, scale, axis=1))`` with the same int8
weights and per-vocabulary scales (zero point 0, which TensorRT requires), so the plan stays small; the
activations are not quantized (``trt compare`` uses the same form as its reference, see compare.py).

The ops' local functions are dropped (a plugin is then the only way to import the node). Every other node
is kept as it is: TensorRT 10 imports the rest of our graphs as they are (int64 is native since TensorRT
9.0; ``inspect --trt-compat`` checks every node against the 10.15 operator table), and the target's
attention stays in standard ops: TensorRT 11's ``TRT_Attention`` custom op refuses ``past_key`` /
``past_value`` with packed queries (peers_and_apis.md §2.3), and our target reads a persistent KV cache
with per-request lengths, so there is nothing it could replace without changing the graph contract.

The result is checked with ``onnx.checker.check_model(full_check=True)`` and strict ONNX shape
inference, and the inferred types and shapes of every plugin output must equal the declared ones.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...errors import BuildError, PluginError
from ...plugins.common import DOMAIN
from ...plugins.cpu_ops import DOMAIN as CPU_DOMAIN
from ...plugins.common.tensorrt_spec import PLUGIN_NAMESPACE, PLUGIN_VERSION, PluginSpec
from ...plugins.markov_draft.schema import OUTSIDE_DRAFT_VOCAB
from ...plugins.markov_draft.schema import SCHEMA as MARKOV_DRAFT_SCHEMA
from ...plugins.registry import PLUGIN_SPECS

log = logging.getLogger(__name__)

__all__ = ["LoweredGraph", "lower_model", "lower_file", "lower_int8_heads", "expand_draft_vocab",
           "PLACEHOLDER_PREFIX", "LOWERED_SUFFIX"]

PLACEHOLDER_PREFIX = "dspark_trt.absent."
"""Name prefix of the placeholder initializers fed to absent optional plugin inputs."""
LOWERED_SUFFIX = ".trt.onnx"
"""A lowered graph is written next to its canonical graph as ``<name>.trt.onnx`` (same external data file)."""
#: the node attributes the parser reads besides the plugin fields
PARSER_ATTRIBUTES = ("plugin_namespace", "plugin_version", "aot")


@dataclasses.dataclass
class LoweredGraph:
    """One lowered graph and what the lowering did to it.

    Attributes:
        name: the graph's name in the engine directory (``target``, ``drafter_block``, ...).
        model: the lowered model (weights stay where they were: external data is not loaded).
        plugin_nodes: per plugin node {"node", "plugin", "fields", "placeholders", "outputs"}.
        dropped_functions: ``domain::name[overload]`` of every local function removed.
        int8_heads: the MatMul node of every int8 LM head rewritten to DequantizeLinear + MatMul.
        draft_vocab_nodes: every MarkovDraft node expanded from a draft vocabulary (``expand_draft_vocab``).
    """

    name: str
    model: onnx.ModelProto
    plugin_nodes: list[dict] = dataclasses.field(default_factory=list)
    dropped_functions: list[str] = dataclasses.field(default_factory=list)
    int8_heads: list[str] = dataclasses.field(default_factory=list)
    draft_vocab_nodes: list[str] = dataclasses.field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.plugin_nodes or self.dropped_functions or self.int8_heads or self.draft_vocab_nodes)

    def summary(self) -> dict:
        return {"graph": self.name, "plugin_nodes": self.plugin_nodes, "dropped_functions": self.dropped_functions,
                "int8_heads": self.int8_heads, "draft_vocab_nodes": self.draft_vocab_nodes}


def _shape_of(vi: onnx.ValueInfoProto) -> tuple | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)


def _known_shapes(model: onnx.ModelProto, name: str) -> dict[str, tuple]:
    """Shapes of every value of the top-level graph, from the declared I/O and ONNX shape inference."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as e:
        raise BuildError(f"{name}: ONNX shape inference of the canonical graph failed ({e})") from e
    shapes = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        shape = _shape_of(vi)
        if shape is not None:
            shapes[vi.name] = shape
    for init in inferred.graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def _fields_from_node(spec: PluginSpec, node: onnx.NodeProto, present: set[str], graph: str,
                      overrides: Mapping[str, int]) -> dict[str, int]:
    values = dict(overrides)
    if spec.name == "MarkovDraft":
        pairs = {"has_markov": ("markov_w1", "markov_w2"), "has_confidence": ("confidence_weight", "confidence_bias")}
        for field, (a, b) in pairs.items():
            if (a in present) != (b in present):
                given, lacking = (a, b) if a in present else (b, a)
                raise BuildError(f"{graph}: node {node.name!r} ({DOMAIN}::{spec.name}) feeds {given} without "
                                 f"{lacking}; the pair is both-or-neither")
            values[field] = int(a in present)
        if node.overload:
            parts = set(node.overload.split("_"))
            if ("markov" in parts) != bool(values["has_markov"]) or ("conf" in parts) != bool(values["has_confidence"]):
                raise BuildError(f"{graph}: node {node.name!r}: overload {node.overload!r} disagrees with its inputs "
                                 f"(has_markov={values['has_markov']}, has_confidence={values['has_confidence']})")
    try:
        return spec.check_fields(values)
    except PluginError as e:
        raise BuildError(f"{graph}: node {node.name!r}: {e}") from e


def expand_draft_vocab(graph: onnx.GraphProto, name: str = "model") -> list[str]:
    """Rewrite each MarkovDraft node fed a ``d2t`` to the full-vocabulary form, in place (module docstring).

    Returns:
        The names of the rewritten nodes.
    Raises:
        BuildError: a node with ``d2t`` but no ``markov_w1`` (the op contract forbids it; V comes from W1).
    """
    schema = MARKOV_DRAFT_SCHEMA.input_names
    at = {n: i for i, n in enumerate(schema)}
    done, nodes = [], []
    for node in graph.node:
        given = dict(zip(schema, node.input))
        if node.domain != DOMAIN or node.op_type != "MarkovDraft" or not given.get("d2t"):
            nodes.append(node)
            continue
        if not given.get("markov_w1") or not given.get("markov_w2"):
            raise BuildError(f"{name}: node {node.name!r} feeds d2t without markov_w1/markov_w2 (the op needs them "
                             "with a draft vocabulary)")
        prefix = f"{node.name}/d2t_expand/"
        extra: list[onnx.NodeProto] = []

        def op(op_type, inputs, suffix, **attrs):
            out_name = prefix + suffix
            extra.append(helper.make_node(op_type, list(inputs), [out_name], name=out_name, **attrs))
            return out_name

        def const(value, dtype, suffix):
            return op("Constant", [], suffix, value=numpy_helper.from_array(np.asarray(value, dtype), prefix + suffix))

        base, w1, w2, d2t = given["base_logits"], given["markov_w1"], given["markov_w2"], given["d2t"]
        base_shape = op("Shape", [base], "base_shape")
        vocab = op("Shape", [w1], "vocab", start=0, end=1)  # [V]
        rank = op("Shape", [w2], "rank", start=1, end=2)  # [r]
        fill = op("Expand", [const([[[OUTSIDE_DRAFT_VOCAB]]], np.float32, "fill_value"),
                             op("Concat", [op("Shape", [base], "rows", start=0, end=2), vocab], "fill_shape", axis=0)],
                  "fill")
        index = op("Expand", [op("Reshape", [d2t, const([1, 1, -1], np.int64, "index_shape")], "index_row"),
                              base_shape], "index")
        base_full = op("ScatterElements", [fill, index, base], "base_logits", axis=2)
        zeros = op("Expand", [const([[0.0]], np.float32, "zero"), op("Concat", [vocab, rank], "w2_shape", axis=0)],
                   "w2_zeros")
        w2_full = op("ScatterND", [zeros, op("Unsqueeze", [d2t, const([1], np.int64, "axis")], "w2_index"), w2],
                     "markov_w2")
        inputs = list(node.input)[:at["d2t"]]
        inputs[at["base_logits"]], inputs[at["markov_w2"]] = base_full, w2_full
        while inputs and not inputs[-1]:
            inputs.pop()
        rewritten = onnx.NodeProto()
        rewritten.CopyFrom(node)
        del rewritten.input[:]
        rewritten.input.extend(inputs)
        rewritten.overload = "_".join(p for p in node.overload.split("_") if p != "d2t")
        gather = []
        if len(node.output) > 1 and node.output[1]:   # draft_logits back to the d2t columns
            rewritten.output[1] = prefix + "draft_logits_full"
            gather = [helper.make_node("Gather", [rewritten.output[1], d2t], [node.output[1]],
                                       name=prefix + "draft_logits", axis=2)]
        nodes += extra + [rewritten] + gather
        done.append(node.name)
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
    return done


def _placeholder(input_name: str, rank: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros((1,) * rank, np.float32), PLACEHOLDER_PREFIX + input_name)


def lower_model(model: onnx.ModelProto, name: str = "model", *,
                fields: Mapping[str, Mapping[str, int]] | None = None, check: bool = True) -> LoweredGraph:
    """The TensorRT form of ``model`` (see the module docstring); ``model`` is not modified.

    Args:
        model: a canonical graph, loaded with or without its external data.
        name: the graph's name, for messages and the report.
        fields: per op type, plugin field values to use instead of the defaults (``block_v``, ``num_probes``).
        check: run the ONNX checker and strict shape inference on the result (default True).
    Returns:
        LoweredGraph; a graph without ``dspark`` nodes comes back unchanged (``changed`` False).
    Raises:
        BuildError: a ``dspark`` node with no plugin, nested in a subgraph, missing a required input, with
            half an optional pair, or the lowered graph fails the checker or shape inference.
    """
    fields = {k: dict(v) for k, v in (fields or {}).items()}
    unknown = sorted(set(fields) - set(PLUGIN_SPECS))
    if unknown:
        raise BuildError(f"{name}: plugin fields given for unknown ops {unknown}; plugins: {sorted(PLUGIN_SPECS)}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    result = LoweredGraph(name, out)
    _refuse_nested(out.graph, name, top=True)
    contrib = sorted({n.op_type for n in out.graph.node if n.domain in ("com.microsoft", CPU_DOMAIN)})
    if contrib:  # MatMulNBits / MatMulW4A8, GatherBlockQuantized, the fused ops of a quantized build (quantize.py)
        raise BuildError(f"{name}: ONNX Runtime contrib and CPU custom ops {contrib} have no TensorRT import "
                         "(an engine directory built with --weights or --drafter-weights int4, int8 or w8a8); "
                         "build it with `dspark-export build "
                         "--weights fp32 --drafter-weights float32` for the TensorRT backend")
    result.int8_heads = lower_int8_heads(out.graph, name)
    result.draft_vocab_nodes = expand_draft_vocab(out.graph, name)
    if not any(n.domain == DOMAIN for n in out.graph.node):
        if result.int8_heads and check:
            _check(result)
        return result
    shapes = _known_shapes(out, name)
    declared = {vi.name for vi in [*out.graph.output, *out.graph.value_info]}
    placeholders: dict[str, onnx.TensorProto] = {}
    new_nodes = []
    for node in out.graph.node:
        if node.domain != DOMAIN:
            new_nodes.append(node)
            continue
        spec = PLUGIN_SPECS.get(node.op_type)
        if spec is None:
            raise BuildError(f"{name}: node {node.name!r} is {DOMAIN}::{node.op_type}, which has no TensorRT plugin "
                             f"(plugins: {sorted(PLUGIN_SPECS)})")
        schema_inputs = spec.schema.input_names
        if len(node.input) > len(schema_inputs):
            raise BuildError(f"{name}: node {node.name!r} has {len(node.input)} inputs, {spec.plugin_id} takes "
                             f"{len(schema_inputs)}")
        given = dict(zip(schema_inputs, node.input))
        present = {k for k, v in given.items() if v}
        missing = [s.name for s in spec.schema.inputs if not s.optional and s.name not in present]
        if missing:
            raise BuildError(f"{name}: node {node.name!r} ({spec.plugin_id}) lacks required inputs {missing}")
        node_fields = _fields_from_node(spec, node, present, name, fields.get(spec.name, {}))
        inputs, used_placeholders = [], []
        for input_name in schema_inputs:
            if input_name in present:
                inputs.append(given[input_name])
                continue
            if input_name not in spec.placeholders:
                raise BuildError(f"{name}: node {node.name!r}: input {input_name!r} is absent and has no placeholder")
            tensor = placeholders.setdefault(input_name, _placeholder(input_name, spec.placeholders[input_name]))
            inputs.append(tensor.name)
            used_placeholders.append(input_name)
        lowered = helper.make_node(node.op_type, inputs, list(node.output), name=node.name, domain=PLUGIN_NAMESPACE,
                                   plugin_namespace=PLUGIN_NAMESPACE, plugin_version=PLUGIN_VERSION, aot=1,
                                   **node_fields)
        if node.doc_string:
            lowered.doc_string = node.doc_string
        new_nodes.append(lowered)
        input_shapes = {k: shapes.get(v) for k, v in given.items() if v}
        out_shapes = spec.output_shapes(input_shapes)
        for rule, out_name in zip(spec.outputs, node.output):
            if out_name and out_name not in declared:
                out.graph.value_info.append(helper.make_tensor_value_info(
                    out_name, helper.np_dtype_to_tensor_dtype(rule.dtype), list(out_shapes[rule.name])))
        result.plugin_nodes.append({
            "node": node.name, "plugin": spec.plugin_id, "fields": node_fields, "placeholders": used_placeholders,
            "outputs": {rule.name: [None if d is None else d for d in out_shapes[rule.name]] for rule in spec.outputs},
        })
    del out.graph.node[:]
    out.graph.node.extend(new_nodes)
    out.graph.initializer.extend(placeholders.values())
    keep = []
    for f in out.functions:
        if f.domain == DOMAIN and f.name in PLUGIN_SPECS:
            result.dropped_functions.append(f"{f.domain}::{f.name}" + (f"[{f.overload}]" if f.overload else ""))
        else:
            keep.append(f)
    del out.functions[:]
    out.functions.extend(keep)
    if not any(o.domain == CPU_DOMAIN for f in keep for o in f.opset_import):   # a cpu_greedy MarkovDraft's body
        imports = [o for o in out.opset_import if o.domain != CPU_DOMAIN]
        del out.opset_import[:]
        out.opset_import.extend(imports)
    if check:
        _check(result)
    return result


def lower_int8_heads(graph: onnx.GraphProto, name: str = "model") -> list[str]:
    """Replace each int8 LM head (the nodes named ``.../lm_head_int8/...``, see the module docstring) in place.

    Returns:
        the names of the new MatMul nodes, one per head (empty when the graph has none).

    Raises:
        BuildError: a head whose nodes do not read exactly one activation and the int8 weight and scale
            initializers, or do not produce exactly one value used outside them.
    """
    scopes: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if "/lm_head_int8/" in node.name:
            scopes.setdefault(node.name.split("/lm_head_int8/")[0] + "/lm_head_int8", []).append(node)
    if not scopes:
        return []
    initializers = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    replaced: dict[int, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    heads = []
    for base, group in scopes.items():
        made = {o for n in group for o in n.output}
        ids = {id(n) for n in group}
        reads = {i for n in group for i in n.input if i and i not in made}
        activations = sorted(i for i in reads if i not in initializers)
        used_outside = sorted({o for n in graph.node if id(n) not in ids for o in n.input if o in made}
                              | (made & outputs))
        weight = next((i for i in reads if i.endswith("lm_head_int8.weight")), None)
        scale = next((i for i in reads if i.endswith("lm_head_int8.scale")), None)
        if len(activations) != 1 or len(used_outside) != 1 or weight is None or scale is None:
            raise BuildError(f"{name}: int8 LM head {base!r} reads {activations} (+ weight {weight}, scale "
                             f"{scale}) and produces {used_outside}; expected one activation, the int8 weight and "
                             "scale, and one output. Rebuild the engine directory with this version of dspark-export")
        dequantized = f"{base}/DequantizeLinear/output_0"
        replaced[id(group[-1])] = [
            helper.make_node("DequantizeLinear", [weight, scale], [dequantized], name=f"{base}/DequantizeLinear", axis=1),
            helper.make_node("MatMul", [activations[0], dequantized], used_outside, name=f"{base}/MatMul")]
        drop |= ids
        heads.append(f"{base}/MatMul")
    nodes = []
    for node in graph.node:
        if id(node) in replaced:
            nodes.extend(replaced[id(node)])
        elif id(node) not in drop:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return heads


def _refuse_nested(graph: onnx.GraphProto, name: str, top: bool) -> None:
    for node in graph.node:
        if node.domain == DOMAIN and not top:
            raise BuildError(f"{name}: {DOMAIN}::{node.op_type} node {node.name!r} sits inside a subgraph; the "
                             "lowering handles top-level nodes only")
        for attr in node.attribute:
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                _refuse_nested(g, name, top=False)


def _check(result: LoweredGraph) -> None:
    """ONNX checker (full) and strict shape inference; inferred plugin outputs must equal the declared ones."""
    model = _without_external_data(result.model)
    try:
        onnx.checker.check_model(model, full_check=True)
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise BuildError(f"{result.name}: the lowered graph fails the ONNX checker or strict shape inference: "
                         f"{e}") from e
    found = {vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    for entry in result.plugin_nodes:
        node = next(n for n in model.graph.node if n.name == entry["node"])
        spec = PLUGIN_SPECS[node.op_type]
        for rule, out_name in zip(spec.outputs, node.output):
            vi = found.get(out_name)
            want_type = helper.np_dtype_to_tensor_dtype(rule.dtype)
            if vi is None or vi.type.tensor_type.elem_type != want_type:
                found_type = None if vi is None else onnx.TensorProto.DataType.Name(vi.type.tensor_type.elem_type)
                raise BuildError(f"{result.name}: plugin output {out_name!r} of {entry['node']!r}: expected "
                                 f"{onnx.TensorProto.DataType.Name(want_type)}, shape inference found {found_type}")
            shape = _shape_of(vi)
            want = tuple(entry["outputs"][rule.name])
            if shape is not None and len(shape) != len(want):
                raise BuildError(f"{result.name}: plugin output {out_name!r}: rank {len(shape)} after shape "
                                 f"inference, the plugin rule gives rank {len(want)}")
            for got, exp in zip(shape or (), want):
                if isinstance(got, int) and isinstance(exp, int) and got != exp:
                    raise BuildError(f"{result.name}: plugin output {out_name!r}: shape {list(shape)} after shape "
                                     f"inference, the plugin rule gives {list(want)}")


def _without_external_data(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose external initializers are graph inputs of the same type and shape.

    The checker opens external data files relative to the working directory for an in-memory model; the
    weights' values do not matter to the checks, their types and shapes do, and graph inputs keep those.
    """
    from onnx.external_data_helper import uses_external_data

    external = [t for t in model.graph.initializer if uses_external_data(t)]
    if not external:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    names = {t.name for t in external}
    kept = [t for t in copy.graph.initializer if t.name not in names]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    copy.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external)
    return copy


def lower_file(src: Path, dst: Path | None = None, *, name: str | None = None,
               fields: Mapping[str, Mapping[str, int]] | None = None) -> tuple[Path, LoweredGraph]:
    """Lower the graph file ``src`` into ``dst`` (default ``<src stem>.trt.onnx`` beside it).

    External data is not loaded or copied: the lowered graph keeps the canonical graph's references, so
    ``dst`` must sit in the same folder as ``src`` (external-data locations are plain file names there).

    Raises:
        BuildError: ``dst`` in another folder, an unreadable graph, or a lowering error (see ``lower_model``).
    """
    src = Path(src)
    dst = Path(dst) if dst is not None else src.with_name(src.name.removesuffix(".onnx") + LOWERED_SUFFIX)
    if dst.parent.resolve() != src.parent.resolve():
        raise BuildError(f"{dst}: a lowered graph must sit beside {src.name} in {src.parent} (it shares its "
                         "external data file)")
    try:
        model = onnx.load(str(src), load_external_data=False)
    except Exception as e:  # DecodeError, OSError, ...
        raise BuildError(f"{src}: not a readable ONNX model ({type(e).__name__}: {e})") from e
    result = lower_model(model, name or src.name.removesuffix(".onnx"), fields=fields)
    tmp = dst.with_name(f".{dst.name}.partial")
    onnx.save(result.model, str(tmp))
    tmp.replace(dst)
    return dst, result
