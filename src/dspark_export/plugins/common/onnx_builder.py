"""A small node builder for ONNX function bodies and their ``If`` branches.

Function bodies cannot hold initializers, so constants are ``Constant`` nodes. Every value gets a
unique name ``<prefix><OpType>_<n>`` from a counter shared with the builder's branches (ONNX
requires unique value names across a function body and its subgraphs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from dspark_export.plugins.common import DOMAIN, ONNX_OPSET, OPSET_VERSION


class NodeBuilder:
    """Collects the nodes of one graph scope (a function body or an ``If`` branch)."""

    def __init__(self, prefix: str, counter: itertools.count | None = None):
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self._counter = counter if counter is not None else itertools.count()

    def op(self, op_type: str, *inputs: str, num_outputs: int = 1, **attrs) -> str | list[str]:
        """Append one standard-domain node; returns its output name (a list when ``num_outputs`` > 1)."""
        name = f"{self.prefix}{op_type}_{next(self._counter)}"
        outputs = [name] if num_outputs == 1 else [f"{name}_out{i}" for i in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outputs, name=name, **attrs))
        return outputs[0] if num_outputs == 1 else outputs

    def op_into(self, output: str, op_type: str, *inputs: str, **attrs) -> str:
        """Append one node whose output has a fixed name (a function or branch output)."""
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=f"{self.prefix}{output}", **attrs))
        return output

    def const(self, value, dtype: type[np.generic]) -> str:
        """A ``Constant`` node holding ``value`` as a ``dtype`` tensor (a scalar for a Python number)."""
        array = np.asarray(value, dtype=dtype)
        name = f"{self.prefix}Constant_{next(self._counter)}"
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(array, name)))
        return name

    def branch(self, prefix: str) -> NodeBuilder:
        """A builder for a subgraph scope (or a named part of this one) sharing this builder's name counter."""
        return NodeBuilder(f"{self.prefix}{prefix}", self._counter)

    def absorb(self, part: NodeBuilder) -> None:
        """Append the nodes of ``part`` (a ``branch`` used only to prefix names) to this scope."""
        self.nodes.extend(part.nodes)

    def to_graph(self, name: str, outputs: Sequence[tuple[str, int]]) -> onnx.GraphProto:
        """This scope as an ``If`` branch graph; ``outputs`` are (value name, element type) pairs.

        Each output is copied by an ``Identity`` so that a branch never returns an outer-scope name.
        """
        nodes = list(self.nodes)
        infos = []
        for index, (value, elem_type) in enumerate(outputs):
            out = f"{self.prefix}{name}_out{index}"
            nodes.append(helper.make_node("Identity", [value], [out], name=out))
            infos.append(helper.make_tensor_value_info(out, elem_type, None))
        return helper.make_graph(nodes, name, [], infos)


def make_if(builder: NodeBuilder, cond: str, then: tuple[NodeBuilder, str], otherwise: tuple[NodeBuilder, str],
            elem_type: int) -> str:
    """An ``If`` node on the scalar bool ``cond`` choosing between two one-output branches."""
    (then_builder, then_value), (else_builder, else_value) = then, otherwise
    then_graph = then_builder.to_graph("then", [(then_value, elem_type)])
    else_graph = else_builder.to_graph("else", [(else_value, elem_type)])
    return builder.op("If", cond, then_branch=then_graph, else_branch=else_graph)


def make_function(op_type: str, inputs: Sequence[str], outputs: Sequence[str], builder: NodeBuilder,
                  doc: str, overload: str | None = None) -> onnx.FunctionProto:
    """A ``dspark`` domain FunctionProto over ``builder``'s nodes (default-domain opset ``ONNX_OPSET``)."""
    return helper.make_function(
        DOMAIN, op_type, list(inputs), list(outputs), builder.nodes, [helper.make_opsetid("", ONNX_OPSET)],
        doc_string=doc, overload=overload,
    )


def opset_imports() -> list[onnx.OperatorSetIdProto]:
    """Opset imports of a model that holds ``dspark`` functions."""
    return [helper.make_opsetid("", ONNX_OPSET), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
