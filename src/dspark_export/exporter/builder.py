"""A small ONNX graph builder shared by the target and drafter exporters.

Node names follow one namespace (`/target/layers.0/attn/q_proj/MatMul`), outputs are
`{node}/output_{i}`, so names are unique and greppable. Weights become initializers under their
PyTorch state_dict names, so a graph's weights can be traced back to the checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS_DOMAIN = "com.microsoft"  #: ONNX Runtime's contrib-op domain

OPSET = 21

_DTYPES = {
    "float32": TensorProto.FLOAT,
    "int64": TensorProto.INT64,
    "bool": TensorProto.BOOL,
    "float64": TensorProto.DOUBLE,
}


class GraphBuilder:
    """Collects nodes, inputs, outputs and initializers, then makes an `onnx.ModelProto`.

    Args:
        name (str): graph name, also the root of node names ("/name/...").
    """

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.functions: dict[str, onnx.FunctionProto] = {}
        self.opsets: dict[str, int] = {"": OPSET}
        self._consts: dict[tuple, str] = {}
        self._names: set[str] = set()
        #: values built once per graph and reused by later nodes, by key (e.g. `quantize.matmul_w8a8`'s zero point)
        self.shared: dict[str, str] = {}

    # -- graph interface -------------------------------------------------------------------
    def input(self, name: str, dtype: str, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, _DTYPES[dtype], list(shape)))
        return name

    def output(self, value: str, name: str, dtype: str, shape: Sequence[int | str]) -> str:
        """Expose `value` as graph output `name` (an Identity node renames it)."""
        self.nodes.append(helper.make_node("Identity", [value], [name], name=f"/{self.name}/output/{name}"))
        self.outputs.append(helper.make_tensor_value_info(name, _DTYPES[dtype], list(shape)))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        """Add a weight initializer under its state_dict name (fp32 unless integer)."""
        if name not in self.initializers:
            arr = np.ascontiguousarray(array)
            if arr.dtype.kind == "f":
                arr = arr.astype(np.float32, copy=False)
            self.initializers[name] = numpy_helper.from_array(arr, name)
        return name

    def const(self, value, dtype: str = "int64") -> str:
        """A small constant (shape tuple, scalar), deduplicated."""
        arr = np.asarray(value, dtype=np.dtype(dtype))
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = f"/{self.name}/const/{len(self._consts)}"
            self.initializers[name] = numpy_helper.from_array(arr, name)
            self._consts[key] = name
        return self._consts[key]

    def op(self, op_type: str, inputs: Sequence[str], name: str, *, num_outputs: int = 1,
           domain: str = "", **attrs):
        """Add one node named `/{graph}/{name}/{op_type}`; returns its output name(s)."""
        node_name = f"/{self.name}/{name}/{op_type}" if name else f"/{self.name}/{op_type}"
        base, i = node_name, 1
        while node_name in self._names:
            node_name, i = f"{base}_{i}", i + 1
        self._names.add(node_name)
        outs = [f"{node_name}/output_{k}" for k in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=node_name, domain=domain, **attrs))
        return outs[0] if num_outputs == 1 else outs

    def add_function(self, function: onnx.FunctionProto) -> None:
        self.functions[f"{function.domain}::{function.name}"] = function
        self.opsets.setdefault(function.domain, 1)

    # -- output ----------------------------------------------------------------------------
    def model(self, doc: str = "") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs,
                                  initializer=list(self.initializers.values()))
        opsets = [helper.make_opsetid(d, v) for d, v in self.opsets.items()]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="dspark-export",
                                  functions=list(self.functions.values()))
        model.ir_version = 10
        model.doc_string = doc
        return model


def save_model(model: onnx.ModelProto, path: Path, share_from: Path | None = None) -> list[Path]:
    """Write `model` to `path` with weights in one external-data file beside it.

    Args:
        model: the graph (weights inline; they are moved out).
        path: the .onnx file to write.
        share_from: an already saved graph in the same folder. Initializers of `model` that have the
            same name as one of its external initializers point into its data file instead of being
            written again (the exporters give a tensor the same name only when it is equal, e.g. the
            drafter's frozen embedding/LM head and the target's embedding).
    Returns:
        list[Path]: the files written (the .onnx and, when weights were written, its .onnx.data).
    """
    path = Path(path)
    data_name = path.name + ".data"
    data_path = path.with_name(data_name)
    if data_path.exists():
        os.remove(data_path)  # onnx appends to an existing data file
    if share_from is not None:
        _point_to_shared(model, Path(share_from))
    views = _take_views(model)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_name, size_threshold=1024)
    if views:
        _add_views(model, views)
        onnx.save_model(model, str(path))  # the graph only: every tensor already points into the data file
    return [path, data_path] if data_path.exists() else [path]


def _take_views(model: onnx.ModelProto) -> list[tuple[onnx.TensorProto, str]]:
    """Remove the initializers that are views of another's bytes (doc_string `quantize.VIEW_DOC` + source
    name, e.g. a quantized embedding read by GatherBlockQuantized over the LM head's MatMulNBits weight),
    so the data file holds those bytes once. Views already pointing into a shared file stay."""
    from .quantize import VIEW_DOC

    views, keep = [], []
    for init in model.graph.initializer:
        if init.doc_string.startswith(VIEW_DOC) and init.HasField("raw_data"):
            views.append((init, init.doc_string[len(VIEW_DOC):]))
        else:
            keep.append(init)
    if views:
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
    return views


def _add_views(model: onnx.ModelProto, views: list[tuple[onnx.TensorProto, str]]) -> None:
    """Put each view back as an external tensor over its source's bytes (same location, offset, length)."""
    by_name = {t.name: t for t in model.graph.initializer}
    for view, source in views:
        src = by_name[source]
        if src.data_location != onnx.TensorProto.EXTERNAL:  # a source under the size threshold stays inline
            model.graph.initializer.append(view)
            continue
        if len(view.raw_data) != int(np.prod(src.dims)) * np.dtype(
                onnx.helper.tensor_dtype_to_np_dtype(src.data_type)).itemsize:
            raise ValueError(f"view {view.name!r} is not the size of its source {source!r}")
        view.ClearField("raw_data")
        view.data_location = onnx.TensorProto.EXTERNAL
        del view.external_data[:]
        for entry in src.external_data:
            view.external_data.add(key=entry.key, value=entry.value)
        model.graph.initializer.append(view)


def _point_to_shared(model: onnx.ModelProto, other: Path) -> None:
    from onnx.external_data_helper import uses_external_data

    shared = {t.name: t for t in onnx.load(str(other), load_external_data=False).graph.initializer
              if uses_external_data(t)}
    for init in model.graph.initializer:
        ref = shared.get(init.name)
        if ref is None or list(ref.dims) != list(init.dims) or ref.data_type != init.data_type:
            continue
        init.ClearField("raw_data")
        init.data_location = onnx.TensorProto.EXTERNAL
        del init.external_data[:]
        for entry in ref.external_data:
            init.external_data.add(key=entry.key, value=entry.value)


# -- common subgraphs ------------------------------------------------------------------------
def rms_norm(b: GraphBuilder, x: str, weight: str, eps: float, name: str) -> str:
    """x * w / sqrt(mean(x², -1) + eps) (the pattern ORT fuses into SimplifiedLayerNormalization)."""
    sq = b.op("Pow", [x, b.const(2.0, "float32")], name)
    mean = b.op("ReduceMean", [sq, b.const([-1])], name, keepdims=1)
    std = b.op("Sqrt", [b.op("Add", [mean, b.const(eps, "float32")], name)], name)
    return b.op("Mul", [b.op("Div", [x, std], name), weight], name)


def linear(b: GraphBuilder, x: str, weight_name: str, weight: np.ndarray, name: str,
           bias: np.ndarray | None = None, bias_name: str | None = None) -> str:
    """x @ W^T (+ b) for a PyTorch Linear weight W [out, in]; x [..., in] -> [..., out].

    The weight is stored transposed ([in, out], MatMul's layout) under `weight_name`; on disk the
    tensor name keeps the state_dict key so weights map back to the checkpoint.
    """
    w = b.weight(weight_name, np.ascontiguousarray(weight.T))
    y = b.op("MatMul", [x, w], name)
    if bias is not None:
        y = b.op("Add", [y, b.weight(bias_name, bias)], name)
    return y


def rope_cos_sin(b: GraphBuilder, position_ids: str, inv_freq: np.ndarray, scaling: float,
                 name: str = "rope") -> tuple[str, str]:
    """cos, sin [T, D] for positions [T] (rotate-half layout: freqs repeated twice)."""
    pos = b.op("Cast", [b.op("Unsqueeze", [position_ids, b.const([1])], name)], name, to=TensorProto.FLOAT)
    inv = b.const(np.asarray(inv_freq, np.float32).reshape(1, -1), "float32")
    freqs = b.op("Mul", [pos, inv], name)
    emb = b.op("Concat", [freqs, freqs], name, axis=-1)
    cos, sin = b.op("Cos", [emb], name), b.op("Sin", [emb], name)
    if scaling != 1.0:
        s = b.const(scaling, "float32")
        cos, sin = b.op("Mul", [cos, s], name), b.op("Mul", [sin, s], name)
    return cos, sin


def apply_rope(b: GraphBuilder, x: str, cos: str, sin: str, head_dim: int, name: str) -> str:
    """x [T, heads, D] -> x·cos + rotate_half(x)·sin, with cos/sin [T, D] broadcast over heads."""
    half = head_dim // 2
    x1, x2 = b.op("Split", [x, b.const([half, half])], name, num_outputs=2, axis=-1)
    rot = b.op("Concat", [b.op("Neg", [x2], name), x1], name, axis=-1)
    c = b.op("Unsqueeze", [cos, b.const([1])], name)
    s = b.op("Unsqueeze", [sin, b.const([1])], name)
    return b.op("Add", [b.op("Mul", [x, c], name), b.op("Mul", [rot, s], name)], name)


def swiglu_mlp(b: GraphBuilder, x: str, sd: dict, prefix: str, name: str) -> str:
    """down(silu(gate(x)) * up(x)) over state_dict entries `{prefix}.{gate,up,down}_proj.weight`."""
    gate = linear(b, x, f"{prefix}.gate_proj.weight", sd[f"{prefix}.gate_proj.weight"], f"{name}/gate_proj")
    up = linear(b, x, f"{prefix}.up_proj.weight", sd[f"{prefix}.up_proj.weight"], f"{name}/up_proj")
    act = b.op("Mul", [gate, b.op("Sigmoid", [gate], f"{name}/act")], f"{name}/act")
    return linear(b, b.op("Mul", [act, up], name), f"{prefix}.down_proj.weight",
                  sd[f"{prefix}.down_proj.weight"], f"{name}/down_proj")


NEG_INF = -1e30  # finite: a fully masked row (never read back) must not produce NaN


def two_part_attention(b: GraphBuilder, q: str, k: str, v: str, past_k: str, past_v: str,
                       past_lens: str, dims: tuple[int, int, int], causal: bool, name: str) -> str:
    """Attention of padded queries over [past cache ; new keys] without concatenating the cache.

    ::

        q [R,Q,nH,D] ─► [R,kvH,G·Q,D] ─┬─ MatMul(past_kᵀ) ─► [R,kvH,G·Q,P] ─ mask j<past_lens ─┐
                                       └─ MatMul(kᵀ)      ─► [R,kvH,G·Q,Q] ─ mask (causal) ──┴► Concat ► Softmax
        Softmax ─► Slice[:P] ─ MatMul(past_v) ─┐
                 └ Slice[P:] ─ MatMul(v)     ─┴► Add ─► [R,Q,nH·D]

    Args:
        q: [R, Q, nH, D] float32 queries (RoPE applied). k, v: [R, Q, kvH, D] new keys/values.
        past_k, past_v: [R, kvH, P, D] float32 cache; entries ≥ past_lens[r] are masked out.
        past_lens: [R] int64.
        dims: (num_heads nH, num_kv_heads kvH, head_dim D); query head h uses KV head h // (nH/kvH).
        causal: new query i sees new key j only if j ≤ i; otherwise every new key (DSpark block).
    Returns:
        [R, Q, nH·D] float32.
    """
    nh, nkv, d = dims
    g = nh // nkv
    shape_q = b.op("Shape", [q], name)
    r_dim = b.op("Slice", [shape_q, b.const([0]), b.const([1])], name)
    q_dim = b.op("Slice", [shape_q, b.const([1]), b.const([2])], name)
    # [R,Q,nH,D] -> [R,Q,kvH,G,D] -> [R,kvH,G,Q,D] -> [R,kvH,G·Q,D]
    q5 = b.op("Reshape", [q, b.op("Concat", [r_dim, q_dim, b.const([nkv, g, d])], name, axis=0)], name)
    q5 = b.op("Transpose", [q5], name, perm=[0, 2, 3, 1, 4])
    qg = b.op("Reshape", [q5, b.op("Concat", [r_dim, b.const([nkv, -1, d])], name, axis=0)], name)
    qg = b.op("Mul", [qg, b.const(d ** -0.5, "float32")], name)
    kt = b.op("Transpose", [k], name, perm=[0, 2, 3, 1])       # [R,kvH,D,Q]
    vt = b.op("Transpose", [v], name, perm=[0, 2, 1, 3])       # [R,kvH,Q,D]
    past_kt = b.op("Transpose", [past_k], name, perm=[0, 1, 3, 2])  # fused into MatMul by ORT
    s_past = b.op("MatMul", [qg, past_kt], name)                # [R,kvH,G·Q,P]
    s_new = b.op("MatMul", [qg, kt], name)                      # [R,kvH,G·Q,Q]
    neg = b.const(NEG_INF, "float32")
    # past mask: [R,1,1,P] j < past_lens[r]
    p_dim = b.op("Slice", [b.op("Shape", [past_k], name), b.const([2]), b.const([3])], name)
    p_idx = b.op("Range", [b.const(0), b.op("Squeeze", [p_dim, b.const([0])], name), b.const(1)], name)
    lens = b.op("Reshape", [past_lens, b.const([-1, 1, 1, 1])], name)
    s_past = b.op("Where", [b.op("Less", [p_idx, lens], name), s_past, neg], name)
    if causal:
        # row index of [G·Q] is g·Q + i, so i = row mod Q
        q_scalar = b.op("Squeeze", [q_dim, b.const([0])], name)
        rows = b.op("Range", [b.const(0), b.op("Mul", [q_scalar, b.const(g)], name), b.const(1)], name)
        i = b.op("Unsqueeze", [b.op("Mod", [rows, q_scalar], name), b.const([1])], name)  # [G·Q,1]
        j = b.op("Range", [b.const(0), q_scalar, b.const(1)], name)                       # [Q]
        s_new = b.op("Where", [b.op("LessOrEqual", [j, i], name), s_new, neg], name)
    probs = b.op("Softmax", [b.op("Concat", [s_past, s_new], name, axis=-1)], name, axis=-1)
    p_past = b.op("Slice", [probs, b.const([0]), p_dim, b.const([-1])], name)
    p_new = b.op("Slice", [probs, p_dim, b.const([2 ** 62]), b.const([-1])], name)
    out = b.op("Add", [b.op("MatMul", [p_past, past_v], name), b.op("MatMul", [p_new, vt], name)], name)
    # [R,kvH,G·Q,D] -> [R,kvH,G,Q,D] -> [R,Q,kvH,G,D] -> [R,Q,nH·D]
    out = b.op("Reshape", [out, b.op("Concat", [r_dim, b.const([nkv, g, -1, d])], name, axis=0)], name)
    out = b.op("Transpose", [out], name, perm=[0, 3, 1, 2, 4])
    return b.op("Reshape", [out, b.op("Concat", [r_dim, q_dim, b.const([nh * d])], name, axis=0)], name)


# -- contrib-op building blocks shared by the fused target and drafter graphs --------------------------

def skip_rms_norm(b: GraphBuilder, h: str, delta: str, weight: str, eps: float, name: str) -> tuple[str, str]:
    """(rms_norm(h + delta) · w, h + delta) in one SkipSimplifiedLayerNormalization node."""
    node = f"/{b.name}/{name}/SkipSimplifiedLayerNormalization"
    out, total = f"{node}/output_0", f"{node}/output_3"
    b.nodes.append(onnx.helper.make_node("SkipSimplifiedLayerNormalization", [h, delta, weight],
                                         [out, "", "", total], name=node, domain=MS_DOMAIN, epsilon=eps))
    return out, total


def rope_tables(inv_freq: np.ndarray, scaling: float, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_pos, D/2] float32 of angle pos·inv_freq (the product rounded to float32 as the
    unfused graph computes it; cos/sin in float64, then rounded), times the attention scaling."""
    angle = np.arange(max_pos, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None, :]
    angle = angle.astype(np.float64)
    return ((np.cos(angle) * scaling).astype(np.float32), (np.sin(angle) * scaling).astype(np.float32))


def head_norm(b: "GraphBuilder", y: str, sd: dict, key: str, heads: int, d: int, eps: float, name: str) -> str:
    """Qwen3's per-head RMSNorm of y [1,N,heads·D]."""
    y = b.op("Reshape", [y, b.const([1, -1, heads, d])], name)
    y = rms_norm(b, y, b.weight(key, sd[key]), eps, name)
    return b.op("Reshape", [y, b.const([1, -1, heads * d])], name)
