"""Standalone single-node models of the ``dspark`` ops (``verify.onnx``, tests).

The model holds one custom node and the op's function in ``ModelProto.functions``, so ONNX Runtime
runs it with no custom-op library. Graph inputs and outputs carry the schema's names; absent optional
inputs are left out. Symbolic dimensions become ``dim_param`` names (``R``, ``gamma``, ``R_plus_1``)
unless ``dims`` pins them; MarkovDraft pins γ from its ``block_size`` and, without a draft vocabulary,
names its Vd dimension V (Vd = V then).
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx
from onnx import helper

from dspark_export.plugins.common import IR_VERSION
from dspark_export.plugins.common.contract import TensorSpec
from dspark_export.plugins.common.onnx_builder import opset_imports
from dspark_export.plugins.registry import get_op

_DIM_PARAM_NAMES = {"γ": "gamma"}


def make_op_model(
    op_name: str, config: Mapping[str, object], *, dims: Mapping[str, int] | None = None, check: bool = True
) -> onnx.ModelProto:
    """A model with one ``dspark::<op_name>`` node whose graph I/O are the op's inputs and outputs.

    Args:
        op_name: "MarkovDraft" or "SpeculativeVerify".
        config: the op's static configuration (``MarkovDraftConfig`` fields; {} for SpeculativeVerify).
        dims: dimension letters to pin to fixed sizes, e.g. {"V": 50}; the others stay symbolic.
        check: run ``onnx.checker.check_model(full_check=True)`` on the result; defaults to True.

    Returns:
        The model (opset 21 plus ``dspark`` 1, IR version 10), node named ``/<op_name>``.

    Raises:
        PluginError: an unknown op or an invalid configuration.
    """
    entry = get_op(op_name)
    present = entry.present_inputs(config)
    sizes = dict(dims or {})
    if "block_size" in config:
        sizes.setdefault("γ", int(config["block_size"]))
    aliases = {"Vd": "V"} if op_name == "MarkovDraft" and not config.get("has_d2t") else {}
    node_inputs = [name if name in present else "" for name in entry.schema.input_names]
    node = entry.make_node(node_inputs, entry.schema.output_names, f"/{op_name}", **config)
    graph = helper.make_graph(
        [node], f"dspark_{op_name}",
        [_value_info(entry.schema.input(name), sizes, aliases) for name in present],
        [_value_info(spec, sizes, aliases) for spec in entry.schema.outputs],
    )
    function = entry.make_function(**config)
    imports = opset_imports()
    imports += [o for o in function.opset_import if o.domain not in {i.domain for i in imports}]  # e.g. dspark.cpu
    model = helper.make_model(graph, opset_imports=imports, functions=[function], ir_version=IR_VERSION,
                              producer_name="dspark_export.plugins")
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model


def _value_info(spec: TensorSpec, sizes: Mapping[str, int], aliases: Mapping[str, str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(spec.name, spec.elem_type,
                                         [_dim(aliases.get(expr, expr), sizes) for expr in spec.shape])


def _dim(expr: str, sizes: Mapping[str, int]) -> int | str:
    """A fixed size when every term of ``expr`` is known, else a dim_param name such as ``gamma_plus_1``."""
    terms = expr.split("+")
    if all(t.isdigit() or t in sizes for t in terms):
        return sum(int(t) if t.isdigit() else sizes[t] for t in terms)
    return "_plus_".join(_DIM_PARAM_NAMES.get(t, t) for t in terms)
