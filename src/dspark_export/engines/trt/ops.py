"""TensorRT 10.x ONNX-parser operator support (as data) and a checker that walks ONNX graphs against it.

Source of the table: `onnx/onnx-tensorrt` `docs/operators.md`, the **TensorRT 10.15** edition (its header:
TensorRT 10.15 parses opsets 9 to 24; the newest 10.x edition of that file found), read in 2026 and restated
here in our own words: per op, whether the parser imports it, the ONNX element types it accepts and the
documented restrictions. Parser behaviour that the table does not state comes from the same repository's
`docs/Changelog.md` (10.0 … 10.15 entries) and, where noted, from its `ModelImporter.cpp` /
`onnxOpImporters.cpp` at tag 10.1-GA (commit 96e7811):

- node dispatch is by `op_type`: a builtin importer first; for other op types a registered plugin is preferred
  over a model-local function of that name since 10.7 (10.0-10.6 preferred the local function); the
  plugin lookup takes its namespace from the node's domain since 10.10 (before: attribute `plugin_namespace`,
  default ""); local functions are keyed by name only (an ONNX overload tag is not part of the key);
- the parser checks only a lower opset bound; the 10.0 edition of the table stopped at opset 20, the
  10.15 edition at 24;
- `If` with a build-time-constant condition imports only the taken branch; otherwise the condition
  must be a scalar BOOL and both branches are imported.

`since_opset` is the ONNX opset that introduced the op (from `onnx.defs`; 1 for the experimental
ops `ImageScaler`, `ParametricSoftplus`, `ScaledTanh`, which ONNX later removed). `trt_minor` is the first
TensorRT 10 minor release whose parser imports the op (0 = 10.0), from the changelog.

`check_model` returns a list of `Finding` (graph, node, op, reason, …); see its docstring for what
each severity means.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from ...errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["OpSupport", "Finding", "OPS", "TABLE_SOURCE", "TABLE_TRT_VERSION", "OPSET_RANGE", "TOPK_MAX_K",
           "SUPPORTED_MAJORS", "check_model", "our_plugins"]

TABLE_SOURCE = "onnx/onnx-tensorrt docs/operators.md (TensorRT 10.15 edition) + docs/Changelog.md"
TABLE_TRT_VERSION = "10.15"
SUPPORTED_MAJORS = (10,)
#: opsets the 10.15 table covers (the parser itself rejects only opsets below its minimum)
OPSET_RANGE = (9, 24)
#: TopK: K must stay below this (documented limit)
TOPK_MAX_K = 3840

F = ("FLOAT", "FLOAT16", "BFLOAT16")
I = ("INT32", "INT64")  # noqa: E741
B = ("BOOL",)
F32_16 = ("FLOAT", "FLOAT16")
Q = ("INT8", "FLOAT8E4M3FN", "FLOAT4E2M1", "INT4")  # quantized types: only through Q/DQ from a wider float


@dataclass(frozen=True)
class OpSupport:
    """One row of the support table.

    Attributes:
        since_opset: ONNX opset that introduced the op.
        types: ONNX element types the parser accepts for the op's data inputs (empty when unsupported).
        restrictions: documented limits, in our words ("" = none).
        supported: the parser imports the op.
        trt_minor: first TensorRT 10 minor that imports the op (0 = every 10.x).
    """

    since_opset: int
    types: tuple[str, ...] = ()
    restrictions: str = ""
    supported: bool = True
    trt_minor: int = 0


def _y(since: int, *types: tuple[str, ...], note: str = "", minor: int = 0) -> OpSupport:
    return OpSupport(since, tuple(t for group in types for t in group), note, True, minor)


def _n(since: int, note: str = "") -> OpSupport:
    return OpSupport(since, (), note or "not imported by the parser", False)


_AXES_INIT = "the axes input (opset 18+) must be an initializer or Constant"
_POOL = "2-D or 3-D pooling only; dilations empty or all 1"

#: op_type (default ONNX domain) → support in TensorRT 10.15's ONNX parser
OPS: dict[str, OpSupport] = {
    "Abs": _y(1, F, I), "Acos": _y(7, F), "Acosh": _y(9, F), "Add": _y(1, F, I), "AffineGrid": _n(20),
    "And": _y(1, B), "ArgMax": _y(1, F, I), "ArgMin": _y(1, F, I), "Asin": _y(7, F), "Asinh": _y(9, F),
    "Atan": _y(7, F), "Atanh": _y(9, F),
    "Attention": _y(23, F, ("INT8", "FLOAT8E4M3FN"), minor=14,
                    note="Q, K, V and attn_mask 4-D; no past_key / past_value / nonpad_kv_seqlen inputs; no "
                         "present_key / present_value / qk_matmul_output outputs; no qk_matmul_output_mode or "
                         "softcap; head counts come from the Q and K/V shapes"),
    "AveragePool": _y(1, F, note=_POOL), "BatchNormalization": _y(1, F), "Bernoulli": _n(15),
    "BitShift": _n(11), "BitwiseAnd": _n(18), "BitwiseNot": _n(18), "BitwiseOr": _n(18), "BitwiseXor": _n(18),
    "BlackmanWindow": _y(17, F32_16, minor=4),
    "Cast": _y(1, F, I, ("UINT8",), B), "CastLike": _y(15, F, I, ("UINT8",), B), "Ceil": _y(1, F),
    "Col2Im": _n(18), "Celu": _y(12, F), "CenterCropPad": _n(18), "Clip": _y(1, F), "Compress": _n(9),
    "Concat": _y(1, F, I, B), "ConcatFromSequence": _n(11),
    "Constant": _y(1, F, ("FLOAT8E4M3FN", "FLOAT4E2M1", "INT4"), I, B,
                   note="sparse_value, value_string and value_strings are not imported"),
    "ConstantOfShape": _y(9, F, ("FLOAT8E4M3FN", "FLOAT4E2M1", "INT4"), I, B),
    "Conv": _y(1, F), "ConvInteger": _n(10), "ConvTranspose": _y(1, F), "Cos": _y(7, F), "Cosh": _y(9, F),
    # The table lists floating-point types only; TensorRT's Cumulative layer page (latest docs) also names
    # INT32/INT64, so the parser table may lag the layer: we follow the table.
    "CumSum": _y(11, F, note="axis must be a build-time constant; floating-point data only"),
    "DFT": _n(17),
    "DeformConv": _y(19, F32_16, minor=1, note="1-D or 2-D spatial input; equal begin/end pads per axis"),
    "DepthToSpace": _y(1, F, I),
    "DequantizeLinear": _y(10, Q, note="zero point must be 0"), "Det": _n(11), "Div": _y(1, F, I),
    "Dropout": _y(1, F, note="is_training must be an initializer equal to false"),
    "DynamicQuantizeLinear": _n(11, "not imported (compose it as a model-local function)"),
    "Einsum": _y(12, F), "Elu": _y(1, F), "Equal": _y(1, F, I), "Erf": _y(9, F), "Exp": _y(1, F),
    "Expand": _y(8, F, I, B), "EyeLike": _y(9, F, I, B, note="input dims must be static"),
    "Flatten": _y(1, F, I, B), "Floor": _y(1, F),
    "Gather": _y(1, F, I, B), "GatherElements": _y(11, F, I, B), "GatherND": _y(11, F, I, B),
    "Gelu": _y(20, F, ("INT8",), I), "Gemm": _y(1, F),
    "GlobalAveragePool": _y(1, F), "GlobalLpPool": _y(1, F), "GlobalMaxPool": _y(1, F),
    "Greater": _y(1, F, I), "GreaterOrEqual": _y(12, F, I),
    "GridSample": _y(16, F32_16, note="4-D input only"), "GroupNormalization": _y(18, F),
    "GRU": _y(1, F, note="a bidirectional GRU needs the same activations both ways"),
    "HammingWindow": _y(17, F32_16, minor=4), "HannWindow": _y(17, F32_16, minor=4),
    "HardSigmoid": _y(1, F), "HardSwish": _y(14, F),
    "Hardmax": _y(1, F, note="the size of the axis dimension must be a build-time constant"),
    "Identity": _y(1, F, I, B),
    "If": _y(1, F, I, B, note="scalar BOOL condition; both branches' outputs of equal rank and distinct names"),
    "ImageScaler": _y(1, F), "ImageDecoder": _n(20), "InstanceNormalization": _y(1, F),
    "IsInf": _y(10, F), "IsNaN": _y(9, F, I),
    "LayerNormalization": _y(17, F, note="only the first output (Y)"), "LeakyRelu": _y(1, F),
    "Less": _y(1, F, I), "LessOrEqual": _y(12, F, I), "Log": _y(1, F), "LogSoftmax": _y(1, F),
    "Loop": _y(1, F, I, B, note="scan outputs of static length; loop-carried shapes constant across iterations"),
    "LRN": _y(1, F),
    "LSTM": _y(1, F, note="same activations both ways when bidirectional; input_forget = 0; layout = 0"),
    "LpNormalization": _y(1, F), "LpPool": _y(1, F, note="dilations empty or all 1"),
    "MatMul": _y(1, F), "MatMulInteger": _n(10), "Max": _y(1, F, I),
    "MaxPool": _y(1, F, note=_POOL + "; no Indices output"), "MaxRoiPool": _n(1), "MaxUnpool": _n(9),
    "Mean": _y(1, F, ("FLOAT8E4M3FN",), I), "MeanVarianceNormalization": _y(9, F), "MelWeightMatrix": _n(17),
    "Min": _y(1, F, I), "Mish": _y(18, F32_16), "Mod": _y(10, F, I, note="fmod = 0 needs integer inputs"),
    "Mul": _y(1, F, I), "Multinomial": _n(7), "Neg": _y(1, F, I), "NegativeLogLikelihoodLoss": _n(12),
    "NonMaxSuppression": _y(10, F32_16), "NonZero": _y(9, F32_16), "Not": _y(1, B),
    "OneHot": _y(9, F, I, B, note="depth must be a build-time constant"),
    "Optional": _n(15), "OptionalGetElement": _n(15), "OptionalHasElement": _n(15), "Or": _y(1, B),
    "Pad": _y(1, F, I), "ParametricSoftplus": _y(1, F), "Pow": _y(1, F, I), "PRelu": _y(1, F),
    "QLinearConv": _n(10), "QLinearMatMul": _n(10), "QuantizeLinear": _y(10, F, note="zero point must be 0"),
    "RandomNormal": _y(1, F, note="seed ignored"), "RandomNormalLike": _y(1, F, note="seed ignored"),
    "RandomUniform": _y(1, F, note="seed ignored"), "RandomUniformLike": _y(1, F, note="seed ignored"),
    "Range": _y(11, F, I, note="start, limit and delta of one type"), "Reciprocal": _y(1, F),
    "ReduceL1": _y(1, F, I, note=_AXES_INIT), "ReduceL2": _y(1, F, I, note=_AXES_INIT),
    "ReduceLogSum": _y(1, F, I, note=_AXES_INIT), "ReduceLogSumExp": _y(1, F, I, note=_AXES_INIT),
    "ReduceMax": _y(1, F, I, note=_AXES_INIT), "ReduceMean": _y(1, F, I, note=_AXES_INIT),
    "ReduceMin": _y(1, F, I, note=_AXES_INIT), "ReduceProd": _y(1, F, I, note=_AXES_INIT),
    "ReduceSum": _y(1, F, I, note=_AXES_INIT), "ReduceSumSquare": _y(1, F, I, note=_AXES_INIT),
    "RegexFullMatch": _n(20), "Relu": _y(1, F, I), "Reshape": _y(1, F, I, B),
    "Resize": _y(10, F, note="coordinate modes half_pixel, pytorch_half_pixel, tf_half_pixel_for_nn, asymmetric, "
                             "align_corners; modes nearest and linear; aspect-ratio policy stretch; tensor scales "
                             "need axes covering every dim in order; no antialiasing"),
    "ReverseSequence": _y(10, F, I, B), "RMSNormalization": _y(23, F, minor=15),
    "RNN": _y(1, F, note="a bidirectional RNN needs the same activations both ways"), "RoiAlign": _y(10, F32_16),
    "RotaryEmbedding": _y(23, F, minor=15, note="position_ids must be INT64"), "Round": _y(11, F),
    "STFT": _y(17, ("FLOAT",), minor=5, note="frame_step and window must be initializers; real input only"),
    "ScaledTanh": _y(1, F), "Scan": _y(8, F), "Scatter": _y(9, F, I), "ScatterElements": _y(11, F, I),
    "ScatterND": _y(11, F, I, note="reduction must be none"), "Selu": _y(1, F),
    "SequenceAt": _n(11), "SequenceConstruct": _n(11), "SequenceEmpty": _n(11), "SequenceErase": _n(11),
    "SequenceInsert": _n(11), "SequenceLength": _n(11), "SequenceMap": _n(17),
    "Shape": _y(1, F, I, B), "Shrink": _y(9, F, I), "Sigmoid": _y(1, F), "Sign": _y(9, F, I), "Sin": _y(7, F),
    "Sinh": _y(9, F), "Size": _y(1, F, I, B), "Slice": _y(1, F, I, B), "Softmax": _y(1, F),
    "SoftmaxCrossEntropyLoss": _n(12), "Softplus": _y(1, F), "Softsign": _y(1, F), "SpaceToDepth": _y(1, F, I),
    "Split": _y(1, F, I, B), "SplitToSequence": _n(11), "Sqrt": _y(1, F),
    "Squeeze": _y(1, F, I, B, note="axes must resolve to a constant"),
    "StringConcat": _n(20), "StringNormalizer": _n(10), "StringSplit": _n(20),
    "Sub": _y(1, F, I), "Sum": _y(1, F, I), "Tan": _y(7, F), "Tanh": _y(1, F),
    "TensorScatter": _y(24, F, ("INT32",), minor=15, note="past_cache and update 4-D; axis -2"),
    "TfIdfVectorizer": _n(9), "ThresholdedRelu": _y(10, F), "Tile": _y(1, F, I, B),
    "TopK": _y(1, F, I, note=f"sorted must be 1; K below {TOPK_MAX_K}"), "Transpose": _y(1, F, I, B),
    "Trilu": _y(14, F, I, B), "Unique": _n(11),
    "Unsqueeze": _y(1, F, I, B, note="axes must resolve to a constant"), "Upsample": _y(1, F),
    "Where": _y(9, F, I, B), "Xor": _y(1, B),
}

#: which inputs carry the type the table's "types" column speaks of (default: input 0)
_TYPED_INPUTS: dict[str, tuple[int, ...] | str] = {
    "Where": (1, 2), "Concat": "all", "Max": "all", "Min": "all", "Mean": "all", "Sum": "all", "Range": "all",
    "If": "outputs", "Loop": "none", "Scan": "none", "Constant": "value", "ConstantOfShape": "value",
    "Shape": "none", "Size": "none", "RandomNormal": "none", "RandomUniform": "none", "EyeLike": (0,),
}
_DEFAULT_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class Finding:
    """One reason a node would not import (or imports with a limit) into TensorRT.

    Attributes:
        graph: the graph's name in the engine directory (or the name given to `check_model`).
        node: the node's name (`<op #i>` when unnamed); "" for a model-level finding.
        op: the op type, `domain::op` for custom ops.
        reason: what is wrong, in one line.
        severity: "error" (the parser or builder rejects it) or "warning" (imports; a limit applies that
            depends on the TensorRT minor version or on run-time values).
        rule: a short identifier of the check (stable, for tests and filters).
        scope: where the node sits: "" (the graph), "function dspark::MarkovDraft", "… > If <name>.then_branch".
        fallback: the plugin (`domain::op`) whose ONNX function body holds the node, when that plugin is in our
            plugin list: TensorRT ≥ 10.7 imports the plugin and never sees the body; the finding only matters
            without the plugin (or on 10.0-10.6, which prefer the local function).
    """

    graph: str
    node: str
    op: str
    reason: str
    severity: str = "error"
    rule: str = ""
    scope: str = ""
    fallback: str = ""

    @property
    def blocking(self) -> bool:
        """An error that applies to the graph as TensorRT would parse it with our plugins registered."""
        return self.severity == "error" and not self.fallback

    def to_dict(self) -> dict:
        return asdict(self)


def our_plugins() -> dict[str, int]:
    """`domain::op` → version of every custom op this package ships (the plugins TensorRT must provide)."""
    from ...plugins.registry import OP_REGISTRY

    return {e.schema.qualified_name: int(e.schema.version) for e in OP_REGISTRY.values()}


# -- static value resolution -------------------------------------------------------------------------

_UNKNOWN = object()


@dataclass
class _Scope:
    """Names visible in one graph body: element types, shapes, constant values and which are weights."""

    label: str
    outer: "_Scope | None" = None
    types: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple] = field(default_factory=dict)
    weights: dict[str, onnx.TensorProto | None] = field(default_factory=dict)  # initializer / Constant outputs
    producers: dict[str, onnx.NodeProto] = field(default_factory=dict)
    dims: Mapping[str, int] = field(default_factory=dict)
    _values: dict[str, object] = field(default_factory=dict)

    def lookup(self, table: str, name: str):
        scope = self
        while scope is not None:
            d = getattr(scope, table)
            if name in d:
                return d[name]
            scope = scope.outer
        return None

    def dtype(self, name: str) -> str | None:
        t = self.lookup("types", name)
        return onnx.TensorProto.DataType.Name(t) if t else None

    def shape(self, name: str) -> tuple | None:
        return self.lookup("shapes", name)

    def is_weight(self, name: str) -> bool:
        scope = self
        while scope is not None:
            if name in scope.weights:
                return True
            node = scope.producers.get(name)
            if node is not None and node.op_type == "Identity" and node.input:
                return scope.is_weight(node.input[0])
            scope = scope.outer
        return False

    def value(self, name: str):
        """The tensor's value when it is known before run time (weights, constant folding over Shape of
        static dims), else None."""
        scope = self
        while scope is not None:
            if name in scope._values:
                v = scope._values[name]
                return None if v is _UNKNOWN else v
            if name in scope.weights or name in scope.producers:
                v = scope._compute(name)
                scope._values[name] = _UNKNOWN if v is None else v
                return v
            scope = scope.outer
        return None

    def _compute(self, name: str):
        if name in self.weights:
            t = self.weights[name]
            if t is None or t.data_location == onnx.TensorProto.EXTERNAL or int(np.prod(t.dims)) > 4096:
                return None
            return numpy_helper.to_array(t)
        node = self.producers[name]
        if node.op_type == "Shape":
            shape = self.shape(node.input[0])
            if shape is None:
                return None
            dims = [d if isinstance(d, int) else self.dims.get(d) if isinstance(d, str) else None for d in shape]
            a = _attrs(node)
            dims = dims[a.get("start", 0): a.get("end", len(dims))]
            return None if any(d is None for d in dims) else np.array(dims, dtype=np.int64)
        fold = _FOLD.get(node.op_type)
        if fold is None:
            return None
        args = [self.value(i) if i else None for i in node.input]
        if any(a is None for a, i in zip(args, node.input) if i):
            return None
        try:
            out = fold(args, _attrs(node))
        except (ValueError, IndexError, TypeError) as e:
            log.debug("constant folding of %s (%s) stopped: %s", node.name, node.op_type, e)
            return None
        return np.asarray(out) if node.output[0] == name else None


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _slice(args, a):
    data, starts, ends = args[0], args[1], args[2]
    axes = args[3] if len(args) > 3 and args[3] is not None else range(len(starts))
    steps = args[4] if len(args) > 4 and args[4] is not None else [1] * len(starts)
    index = [slice(None)] * data.ndim
    for s, e, ax, st in zip(starts, ends, axes, steps):
        index[int(ax)] = slice(int(s), int(e), int(st))
    return data[tuple(index)]


def _axes(args, a):
    return tuple(int(x) for x in (args[1] if len(args) > 1 and args[1] is not None else a.get("axes", ())))


_FOLD = {
    "Identity": lambda v, a: v[0],
    "Cast": lambda v, a: v[0].astype(onnx.helper.tensor_dtype_to_np_dtype(a["to"])),
    "Gather": lambda v, a: np.take(v[0], v[1], axis=a.get("axis", 0)),
    "Slice": _slice,
    "Squeeze": lambda v, a: np.squeeze(v[0], axis=_axes(v, a) or None),
    "Unsqueeze": lambda v, a: np.expand_dims(v[0], axis=_axes(v, a)),
    "Concat": lambda v, a: np.concatenate([np.atleast_1d(x) for x in v], axis=a.get("axis", 0)),
    "Reshape": lambda v, a: v[0].reshape([int(d) if d != 0 else v[0].shape[i] for i, d in enumerate(v[1])]),
    "Add": lambda v, a: v[0] + v[1], "Sub": lambda v, a: v[0] - v[1], "Mul": lambda v, a: v[0] * v[1],
    "Div": lambda v, a: v[0] // v[1] if v[0].dtype.kind in "iu" else v[0] / v[1],
    "Min": lambda v, a: np.minimum.reduce(v), "Max": lambda v, a: np.maximum.reduce(v),
    "Neg": lambda v, a: -v[0], "Abs": lambda v, a: np.abs(v[0]),
}


def _fill_scope(scope: _Scope, graph: onnx.GraphProto) -> None:
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        tt = vi.type.tensor_type
        if tt.elem_type:
            scope.types[vi.name] = tt.elem_type
        if tt.HasField("shape"):
            scope.shapes[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                          for d in tt.shape.dim)
    for init in graph.initializer:
        scope.weights[init.name] = init
        scope.types[init.name] = init.data_type
        scope.shapes[init.name] = tuple(init.dims)
    for node in graph.node:
        for out in node.output:
            if out:
                scope.producers[out] = node
        if node.op_type == "Constant" and node.output:
            a = {x.name: x for x in node.attribute}
            if "value" in a:
                scope.weights[node.output[0]] = a["value"].t
                scope.types[node.output[0]] = a["value"].t.data_type
                scope.shapes[node.output[0]] = tuple(a["value"].t.dims)
            elif "value_int" in a or "value_ints" in a or "value_float" in a or "value_floats" in a:
                (k, attr), = [(k, a[k]) for k in ("value_int", "value_ints", "value_float", "value_floats") if k in a]
                arr = np.array(onnx.helper.get_attribute_value(attr),
                               dtype=np.int64 if "int" in k else np.float32)
                scope.weights[node.output[0]] = numpy_helper.from_array(arr)
                scope.types[node.output[0]] = onnx.helper.np_dtype_to_tensor_dtype(arr.dtype)
                scope.shapes[node.output[0]] = arr.shape
            else:
                scope.weights[node.output[0]] = None


# -- the checker -----------------------------------------------------------------------------------------

class _Checker:
    def __init__(self, model: onnx.ModelProto, graph: str, plugins: Mapping[str, int], dims: Mapping[str, int]):
        self.model, self.graph, self.plugins, self.dims = model, graph, plugins, dims
        self.findings: list[Finding] = []
        self.plugin_nodes: list[dict] = []
        self.opsets = {o.domain: o.version for o in model.opset_import}
        self.functions = {(f.domain, f.name, f.overload): f for f in model.functions}
        self.function_names = {(f.domain, f.name) for f in model.functions}
        self._bodies_checked: set[tuple] = set()

    def add(self, node: onnx.NodeProto | None, op: str, reason: str, scope: _Scope | None, *, severity="error",
            rule="", fallback="", index: int = 0) -> None:
        name = "" if node is None else (node.name or f"<{node.op_type} #{index}>")
        self.findings.append(Finding(self.graph, name, op, reason, severity, rule,
                                     "" if scope is None else scope.label, fallback))

    # model level
    def run(self) -> None:
        opset = next((v for d, v in self.opsets.items() if d in _DEFAULT_DOMAINS), None)
        lo, hi = OPSET_RANGE
        if opset is not None and opset < lo:
            self.add(None, "", f"opset {opset} is below {lo}, the oldest opset TensorRT 10 parses", None,
                     rule="opset")
        elif opset is not None and opset > hi:
            self.add(None, "", f"opset {opset} is above {hi}, the newest opset in the TensorRT "
                               f"{TABLE_TRT_VERSION} table: ops may be read with older semantics", None,
                     severity="warning", rule="opset")
        names = [f.name for f in self.model.functions]
        for dup in sorted({n for n in names if names.count(n) > 1}):
            self.add(None, dup, f"{names.count(dup)} local functions named {dup!r} (overloads): TensorRT keys "
                                "local functions by name only, so they collide", None, rule="function-overload")
        try:
            inferred = onnx.shape_inference.infer_shapes(self.model, strict_mode=False, data_prop=True)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as e:
            log.warning("%s: ONNX shape inference failed (%s); type checks use the declared types only",
                        self.graph, e)
            inferred = self.model
        scope = _Scope("", dims=self.dims)
        _fill_scope(scope, inferred.graph)
        self.walk(inferred.graph, scope, fallback="")

    def walk(self, graph: onnx.GraphProto, scope: _Scope, fallback: str) -> None:
        for index, node in enumerate(graph.node):
            if node.domain in _DEFAULT_DOMAINS:
                self.check_builtin(node, scope, fallback, index)
            else:
                self.check_custom(node, scope, fallback, index)

    def check_custom(self, node, scope, fallback, index) -> None:
        qualified = f"{node.domain}::{node.op_type}"
        version = self.opsets.get(node.domain)
        function = self.functions.get((node.domain, node.op_type, node.overload))
        known = self.plugins.get(qualified)
        if known is not None and version is not None and version != known:
            self.add(node, qualified, f"custom op {qualified} version {version}, our plugin is version {known}",
                     scope, rule="plugin-version", fallback=fallback, index=index)
        if known is not None:
            self.plugin_nodes.append({"graph": self.graph, "node": node.name, "op": qualified, "version": known,
                                      "scope": scope.label, "function_body": function is not None})
        elif function is None:
            self.add(node, qualified, f"custom op {qualified} is neither one of our plugins {sorted(self.plugins)} "
                                      "nor a model-local function: TensorRT would look for a plugin creator "
                                      f"{node.op_type!r} and fail", scope, rule="unknown-custom-op",
                     fallback=fallback, index=index)
        if function is not None:
            label = f"function {qualified}"
            self.check_function(node, function, scope, label, fallback or (qualified if known is not None else ""))

    def check_function(self, call: onnx.NodeProto, function: onnx.FunctionProto, outer: _Scope, label: str,
                       fallback: str) -> None:
        signature = (function.domain, function.name, tuple(outer.dtype(i) if i else None for i in call.input),
                     tuple(outer.shape(i) if i else None for i in call.input))
        if signature in self._bodies_checked:
            return
        self._bodies_checked.add(signature)
        inputs = []
        for formal, actual in zip(function.input, call.input):
            dtype = outer.lookup("types", actual) if actual else None
            shape = outer.shape(actual) if actual else None
            inputs.append(onnx.helper.make_tensor_value_info(formal, dtype, None if shape is None else list(shape))
                          if dtype else onnx.helper.make_empty_tensor_value_info(formal))
        body = onnx.helper.make_graph(list(function.node), function.name, inputs,
                                      [onnx.helper.make_empty_tensor_value_info(o) for o in function.output])
        temp = onnx.helper.make_model(body, opset_imports=list(function.opset_import) or list(self.model.opset_import),
                                      ir_version=self.model.ir_version, functions=list(self.model.functions))
        try:
            temp = onnx.shape_inference.infer_shapes(temp, strict_mode=False, data_prop=True)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as e:
            log.warning("%s: shape inference of %s failed (%s); its body is checked with declared types only",
                        self.graph, label, e)
        scope = _Scope(label, dims=self.dims)
        _fill_scope(scope, temp.graph)
        self.walk(temp.graph, scope, fallback)

    def check_builtin(self, node, scope, fallback, index) -> None:
        op = node.op_type
        support = OPS.get(op)
        if (node.domain, op) in self.function_names:  # a model-local function shadowing a builtin name
            self.add(node, op, "a model-local function shares the name of a builtin op: TensorRT imports the "
                               "builtin, not the function", scope, severity="warning", rule="shadowed-function",
                     fallback=fallback, index=index)
        if support is None:
            self.add(node, op, f"{op} is not in TensorRT {TABLE_TRT_VERSION}'s ONNX operator list", scope,
                     rule="not-in-table", fallback=fallback, index=index)
            return
        if not support.supported:
            self.add(node, op, f"{op} is not supported by TensorRT {TABLE_TRT_VERSION}'s ONNX parser "
                               f"({support.restrictions})", scope, rule="unsupported-op", fallback=fallback,
                     index=index)
            return
        if support.trt_minor:
            self.add(node, op, f"{op} needs TensorRT >= 10.{support.trt_minor}", scope, severity="warning",
                     rule="trt-minor", fallback=fallback, index=index)
        self.check_types(node, support, scope, fallback, index)
        rule = _RULES.get(op)
        if rule is not None:
            for severity, code, reason in rule(node, scope):
                self.add(node, op, reason, scope, severity=severity, rule=code, fallback=fallback, index=index)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                self.check_subgraph(node, attr.name, attr.g, scope, fallback)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for k, g in enumerate(attr.graphs):
                    self.check_subgraph(node, f"{attr.name}[{k}]", g, scope, fallback)

    def check_subgraph(self, node, attr_name, graph, outer, fallback) -> None:
        label = f"{outer.label + ' > ' if outer.label else ''}{node.op_type} {node.name}.{attr_name}"
        scope = _Scope(label, outer=outer, dims=self.dims)
        _fill_scope(scope, graph)
        self.walk(graph, scope, fallback)

    def check_types(self, node, support, scope, fallback, index) -> None:
        which = _TYPED_INPUTS.get(node.op_type, (0,))
        if which == "none":
            return
        if which == "value":
            names = [o for o in node.output[:1] if o]
        elif which == "outputs":
            names = [o for o in node.output if o]
        elif which == "all":
            names = [i for i in node.input if i]
        else:
            names = [node.input[k] for k in which if k < len(node.input) and node.input[k]]
        bad = {}
        for name in names:
            dtype = scope.dtype(name)
            if dtype is None:
                continue
            if dtype == "DOUBLE" and "FLOAT" in support.types:
                self.add(node, node.op_type, "DOUBLE tensor: TensorRT casts it down to FLOAT (values clamped to "
                                             "±FLT_MAX)", scope, severity="warning", rule="double",
                         fallback=fallback, index=index)
            elif dtype not in support.types:
                bad.setdefault(dtype, name)
        if node.op_type == "Cast":
            to = _attrs(node).get("to")
            to_name = onnx.TensorProto.DataType.Name(to) if to else None
            if to_name and to_name not in support.types and to_name != "DOUBLE":
                bad.setdefault(to_name, f"to={to_name}")
        for dtype, name in bad.items():
            self.add(node, node.op_type, f"{dtype} {name!r}: TensorRT's {node.op_type} takes "
                                         f"{', '.join(support.types)}", scope, rule="dtype", fallback=fallback,
                     index=index)


# -- op-specific restrictions: (node, scope) -> [(severity, rule, reason)] ---------------------------------

def _constant_input(node, scope, k, what, need="an initializer or Constant") -> list[tuple[str, str, str]]:
    if k < len(node.input) and node.input[k] and not scope.is_weight(node.input[k]):
        return [("error", "not-constant", f"{what} {node.input[k]!r} must be {need}: it is computed in the graph")]
    return []


def _resolvable_input(node, scope, k, what) -> list[tuple[str, str, str]]:
    if (k < len(node.input) and node.input[k] and not scope.is_weight(node.input[k])
            and scope.value(node.input[k]) is None):
        return [("error", "not-constant", f"{what} {node.input[k]!r} must resolve to a constant")]
    return []


def _rule_topk(node, scope):
    out = []
    if _attrs(node).get("sorted", 1) != 1:
        out.append(("error", "topk-sorted", "TopK with sorted=0: TensorRT needs sorted=1"))
    if len(node.input) < 2:
        return out
    k = scope.value(node.input[1])
    if k is not None and int(np.asarray(k).reshape(-1)[0]) >= TOPK_MAX_K:
        axis = _attrs(node).get("axis", -1)
        out.append(("error", "topk-k", f"K = {int(np.asarray(k).reshape(-1)[0])} (the size of axis {axis}) is not "
                                       f"below {TOPK_MAX_K}, TensorRT's TopK limit"))
    elif k is None:
        out.append(("warning", "topk-k-runtime", f"K {node.input[1]!r} is only known at run time: TensorRT rejects "
                                                 f"K >= {TOPK_MAX_K}"))
    return out


def _rule_reduce(node, scope):
    return _constant_input(node, scope, 1, "axes")


def _rule_if(node, scope):
    out = []
    shape = scope.shape(node.input[0]) if node.input else None
    if shape is not None and not all(d == 1 for d in shape):
        out.append(("error", "if-condition", f"condition {node.input[0]!r} has shape {list(shape)}: TensorRT needs "
                                             "a scalar"))
    a = {x.name: x.g for x in node.attribute if x.type == onnx.AttributeProto.GRAPH}
    then, other = a.get("then_branch"), a.get("else_branch")
    if then is not None and other is not None:
        if len(then.output) != len(other.output):
            out.append(("error", "if-branches", "then/else branches have different numbers of outputs"))
        for t, e in zip(then.output, other.output):
            rt, re_ = (len(x.type.tensor_type.shape.dim) if x.type.tensor_type.HasField("shape") else None
                       for x in (t, e))
            if rt is not None and re_ is not None and rt != re_:
                out.append(("error", "if-branches", f"branch outputs {t.name!r} (rank {rt}) and {e.name!r} "
                                                    f"(rank {re_}) differ in rank"))
    return out


def _rule_mod(node, scope):
    if _attrs(node).get("fmod", 0) == 0 and (scope.dtype(node.input[0]) or "INT").startswith(("FLOAT", "BFLOAT")):
        return [("error", "mod-fmod", "Mod with fmod=0 on floating-point inputs")]
    return []


def _rule_range(node, scope):
    types = {scope.dtype(i) for i in node.input if i} - {None}
    return [("error", "range-types", f"start/limit/delta of different types {sorted(types)}")] if len(types) > 1 else []


def _rule_softmax(node, scope):
    shape = scope.shape(node.input[0])
    axis = _attrs(node).get("axis", -1)
    if shape is not None and not -len(shape) <= axis < len(shape):
        return [("error", "softmax-axis", f"axis {axis} outside the input rank {len(shape)}")]
    return []


def _rule_split(node, scope):
    if len(node.input) > 1 and node.input[1] and "num_outputs" in _attrs(node):
        return [("error", "split-args", "Split with both a split input and num_outputs")]
    return []


def _rule_constant(node, scope):
    bad = [a.name for a in node.attribute if a.name in ("sparse_value", "value_string", "value_strings")]
    return [("error", "constant-attr", f"Constant with {bad[0]} is not imported")] if bad else []


def _rule_scatternd(node, scope):
    red = _attrs(node).get("reduction", b"none")
    red = red.decode() if isinstance(red, bytes) else red
    return [("error", "scatternd-reduction", f"ScatterND reduction {red!r}: only 'none'")] if red != "none" else []


def _rule_attention(node, scope):
    out = [("error", "attention-io", f"Attention input {k} ({what}) is not imported")
           for k, what in ((4, "past_key"), (5, "past_value"), (6, "nonpad_kv_seqlen"))
           if k < len(node.input) and node.input[k]]
    out += [("error", "attention-io", f"Attention output {k} ({what}) is not imported")
            for k, what in ((1, "present_key"), (2, "present_value"), (3, "qk_matmul_output"))
            if k < len(node.output) and node.output[k]]
    return out


def _rule_slice(node, scope):
    axes = node.input[3] if len(node.input) > 3 else ""
    if axes and not scope.is_weight(axes) and scope.value(axes) is None:
        return [("warning", "trt-minor", "Slice with tensor axes needs TensorRT >= 10.3")]
    return []


_RULES = {
    "TopK": _rule_topk, "If": _rule_if, "Mod": _rule_mod, "Range": _rule_range, "Softmax": _rule_softmax,
    "LogSoftmax": _rule_softmax, "Split": _rule_split, "Constant": _rule_constant, "ScatterND": _rule_scatternd,
    "Attention": _rule_attention, "Slice": _rule_slice,
    "CumSum": lambda n, s: _constant_input(n, s, 1, "axis", "a build-time constant"),
    "Squeeze": lambda n, s: _resolvable_input(n, s, 1, "axes"),
    "Unsqueeze": lambda n, s: _resolvable_input(n, s, 1, "axes"),
    "Dropout": lambda n, s: _constant_input(n, s, 2, "training_mode"),
    "OneHot": lambda n, s: _resolvable_input(n, s, 1, "depth"),
    **{r: _rule_reduce for r in ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax",
                                 "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare")},
}


def check_model(model: onnx.ModelProto, graph: str = "model", *, trt_major: int = 10,
                plugins: Mapping[str, int] | None = None, dims: Mapping[str, int] | None = None,
                plugin_nodes: list | None = None) -> list[Finding]:
    """Every reason `model` would not import into TensorRT `trt_major`'s ONNX parser, node by node.

    Walks the graph, `If`/`Loop`/`Scan` bodies and the bodies of model-local functions. A node in a custom
    domain is a plugin node: it must be in `plugins`; its local function body (if any) is checked too and
    its findings carry `fallback` = the plugin's name (they matter only without the plugin). A custom node
    that is not one of our plugins but has a local function is imported through that function, so its body's
    findings count in full.

    Args:
        model: loaded without weights is enough (`onnx.load(path, load_external_data=False)`).
        graph: the name findings carry.
        trt_major: the TensorRT major version (only 10 is tabled).
        plugins: `domain::op` → version of the plugins TensorRT will have (default: `our_plugins()`).
        dims: values for symbolic dims (e.g. {"V": 49152}), used to resolve sizes such as TopK's K.
        plugin_nodes: if given, a list that receives one dict per plugin node found.
    Returns:
        Findings in graph order; `Finding.blocking` tells the ones that stop the import.
    Raises:
        ConfigError: `trt_major` is not tabled.
    """
    if trt_major not in SUPPORTED_MAJORS:
        raise ConfigError(f"--trt-version: expected one of {list(SUPPORTED_MAJORS)} (the tabled TensorRT majors), "
                          f"found {trt_major}")
    checker = _Checker(model, graph, our_plugins() if plugins is None else dict(plugins), dict(dims or {}))
    checker.run()
    if plugin_nodes is not None:
        plugin_nodes.extend(checker.plugin_nodes)
    seen, out = set(), []
    for f in checker.findings:
        key = (f.graph, f.scope, f.node, f.op, f.reason, f.fallback)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
