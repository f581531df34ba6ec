"""``OP_REGISTRY``: each ``dspark`` op's schema, numpy reference, ONNX function and Triton kernel, by op type;
``PLUGIN_SPECS``: each op's TensorRT plugin form.

A reference runner executes a whole exported graph on CPU by looking custom nodes up here
(Polygraphy's pluginref idea); ``graph.make_op_model`` builds single-op models from it. The Triton
kernels are named lazily: nothing imports triton (or decorates a kernel) until ``OpEntry.triton`` is
called, and it raises PluginError when ``triton_support.has_triton()`` is False.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import onnx

from dspark_export.errors import PluginError
from dspark_export.plugins.common.contract import OpSchema
from dspark_export.plugins.common.tensorrt_spec import PluginSpec
from dspark_export.plugins.common.triton_support import require_triton
from dspark_export.plugins.markov_draft import onnx_function as markov_draft_onnx
from dspark_export.plugins.markov_draft import reference as markov_draft_reference
from dspark_export.plugins.markov_draft.schema import SCHEMA as MARKOV_DRAFT_SCHEMA
from dspark_export.plugins.markov_draft.schema import MarkovDraftConfig
from dspark_export.plugins.markov_draft.tensorrt import PLUGIN_SPEC as MARKOV_DRAFT_PLUGIN
from dspark_export.plugins.speculative_verify import onnx_function as verify_onnx
from dspark_export.plugins.speculative_verify import reference as verify_reference
from dspark_export.plugins.speculative_verify.schema import SCHEMA as VERIFY_SCHEMA
from dspark_export.plugins.speculative_verify.tensorrt import PLUGIN_SPEC as VERIFY_PLUGIN

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class OpEntry:
    """Everything the package knows about one op.

    Attributes:
        schema: the op's contract.
        reference: feeds keyed by input name → outputs keyed by output name (numpy).
        make_function: static configuration → FunctionProto.
        make_node: (inputs, outputs, name, **configuration) → NodeProto.
        present_inputs: static configuration (a mapping) → the input names a node of it feeds, in schema order.
        triton: feeds keyed by input name → outputs keyed by output name (torch tensors on a CUDA
            device, or on the CPU under ``TRITON_INTERPRET=1``), with the op's Triton kernel; options
            such as ``block_v`` pass through. None for an op without one.
    """

    schema: OpSchema
    reference: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]
    make_function: Callable[..., onnx.FunctionProto]
    make_node: Callable[..., onnx.NodeProto]
    present_inputs: Callable[[Mapping[str, object]], tuple[str, ...]]
    triton: Callable[..., dict[str, torch.Tensor]] | None = None


def _markov_draft_inputs(config: Mapping[str, object]) -> tuple[str, ...]:
    return MarkovDraftConfig.from_dict(config).present_inputs


def _verify_inputs(config: Mapping[str, object]) -> tuple[str, ...]:
    verify_onnx.check_no_config(config)
    return VERIFY_SCHEMA.input_names


def _lazy_triton(op_folder: str, schema: OpSchema) -> Callable[..., dict[str, torch.Tensor]]:
    """``plugins.<op_folder>.triton_kernel.run``, imported on the first call (behind ``has_triton``)."""

    def run(feeds: Mapping[str, torch.Tensor], **options) -> dict[str, torch.Tensor]:
        require_triton(schema.qualified_name)
        return importlib.import_module(f"dspark_export.plugins.{op_folder}.triton_kernel").run(feeds, **options)

    return run


OP_REGISTRY: dict[str, OpEntry] = {
    "MarkovDraft": OpEntry(
        MARKOV_DRAFT_SCHEMA, markov_draft_reference.run, markov_draft_onnx.make_function, markov_draft_onnx.make_node,
        _markov_draft_inputs, triton=_lazy_triton("markov_draft", MARKOV_DRAFT_SCHEMA),
    ),
    "SpeculativeVerify": OpEntry(
        VERIFY_SCHEMA, verify_reference.run, verify_onnx.make_function, verify_onnx.make_node, _verify_inputs,
        triton=_lazy_triton("speculative_verify", VERIFY_SCHEMA),
    ),
}


def get_op(op_type: str) -> OpEntry:
    """The registry entry of ``op_type``; raises PluginError for an unknown op."""
    if op_type not in OP_REGISTRY:
        raise PluginError(f"unknown dspark op {op_type!r}; available: {sorted(OP_REGISTRY)}")
    return OP_REGISTRY[op_type]


PLUGIN_SPECS: dict[str, PluginSpec] = {"MarkovDraft": MARKOV_DRAFT_PLUGIN, "SpeculativeVerify": VERIFY_PLUGIN}
"""Op type → its TensorRT plugin form (``plugins/<op>/tensorrt.py``)."""


def plugin_spec(op_type: str) -> PluginSpec:
    """The plugin spec of ``op_type``; raises PluginError for an op with no TensorRT plugin."""
    if op_type not in PLUGIN_SPECS:
        raise PluginError(f"no TensorRT plugin for op {op_type!r}; plugins exist for {sorted(PLUGIN_SPECS)}")
    return PLUGIN_SPECS[op_type]
