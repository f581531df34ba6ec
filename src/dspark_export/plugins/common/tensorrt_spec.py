"""The data types of the TensorRT plugin form of the ``dspark`` ops: names, fields, inputs, output shape/type
rules. Each op's own form is ``plugins/<op>/tensorrt.py``; ``plugins/registry.py`` gathers them as
``PLUGIN_SPECS``.

Pure Python (numpy, onnx): nothing here imports tensorrt, triton or torch. Three users read the specs:

- ``engines/trt/lowering.py`` writes plugin nodes from it (op type, domain, attributes, placeholder
  inputs, output value_info);
- ``plugins/tensorrt_plugins.py`` registers the plugins with ``tensorrt.plugin`` from it (the output rules
  become the ``@trtp.register`` shape/type function; the fields become its attributes);
- the tests hold it equal to the ONNX schema (``plugins/<op>/schema.py``) and to ONNX shape inference of
  the ops' function bodies.

How TensorRT's ONNX parser reaches a plugin (onnx-tensorrt ``FallbackPluginImporter``, 10.1 source; the
``aot`` attribute from NVIDIA's quickly-deployable-plugins sample README):

- a node whose ``op_type`` has no builtin importer is looked up in the plugin registry by
  (``op_type``, attribute ``plugin_version`` default "1", attribute ``plugin_namespace`` default ""); the
  lowering also puts the namespace in the node's domain, which later 10.x parsers read as the namespace;
- the plugin creator's declared fields are read from the node's attributes of the same names (INT
  attributes arrive as INT32 fields; other attributes are ignored); a field with no attribute is skipped
  with a warning, which for a Python (QDP) plugin then fails at creation, so every field is written;
- empty optional inputs reach the plugin as null tensors, which a Python plugin with a fixed input list
  cannot take, so the lowering feeds a one-element zero placeholder instead (never read: the kernel is
  compiled without that branch, see ``has_markov`` / ``has_confidence``);
- INT64 tensors reach the plugin as INT64 (the parser casts only some of TensorRT's own plugins to INT32);
- a boolean attribute ``aot`` = 1 asks for the ahead-of-time implementation of that node (needs TensorRT
  >= 10.9, the first release whose ``tensorrt.plugin`` has ``aot_impl`` and whose parser reads ``aot``); the
  node's choice overrides any network-level preference, so the builder passes no flags for it.

Plugin ids: ``dspark::MarkovDraft`` and ``dspark::SpeculativeVerify`` (namespace = the ONNX domain, name =
the ONNX op type, version "1"), so the lowered node keeps the canonical node's op type and domain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from dspark_export.errors import PluginError
from dspark_export.plugins.common import DOMAIN
from dspark_export.plugins.common.contract import OpSchema

__all__ = ["PLUGIN_NAMESPACE", "PLUGIN_VERSION", "MIN_TRT_VERSION", "DEFAULT_BLOCK_V", "DEFAULT_NUM_PROBES",
           "PluginField", "OutputRule", "PluginSpec", "BLOCK_FIELDS"]

PLUGIN_NAMESPACE = DOMAIN
"""TensorRT plugin namespace of both plugins (``tensorrt.plugin`` forbids "", "trt", "tensorrt" and dots)."""
PLUGIN_VERSION = "1"
"""Plugin version; ``tensorrt.plugin`` creators are always version "1"."""
MIN_TRT_VERSION = (10, 9)
"""The first TensorRT release with ``tensorrt.plugin.aot_impl`` (ahead-of-time Python plugins: TensorRT 10.9
release notes; its CHANGELOG, 10.9: "Added support for Python AOT plugins")."""
DEFAULT_BLOCK_V = 1024
"""Vocab block of the kernels (equal to ``triton_kernel.DEFAULT_BLOCK_V`` of both ops; tested)."""
DEFAULT_NUM_PROBES = 8
"""Probes per pass of the top-k/top-p searches (equal to ``triton_kernel.DEFAULT_NUM_PROBES``; tested)."""


@dataclasses.dataclass(frozen=True)
class PluginField:
    """One plugin attribute (a ``@trtp.register`` attribute argument, an ONNX INT attribute of the node).

    Attributes:
        name: attribute name.
        doc: meaning.
        default: value the lowering writes when the canonical graph does not determine it.
        choices: allowed values (None = any positive power of two for block sizes).
    """

    name: str
    doc: str
    default: int | None = None
    choices: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class OutputRule:
    """Shape and type of one plugin output, as (input name, axis) per output axis.

    ``dims[k] = ("base_logits", 1)`` means output axis k has the size of input ``base_logits``'s axis 1.
    """

    name: str
    dtype: np.dtype
    dims: tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class PluginSpec:
    """The plugin form of one op.

    Attributes:
        schema: the op's ONNX schema (inputs in order; every one is a plugin input, optional ones fed a
            placeholder when absent).
        fields: the plugin attributes, in ``@trtp.register`` order.
        outputs: one rule per schema output, in order.
        placeholders: absent optional input → rank of its one-element zero placeholder.
    """

    schema: OpSchema
    fields: tuple[PluginField, ...]
    outputs: tuple[OutputRule, ...]
    placeholders: Mapping[str, int]

    @property
    def name(self) -> str:
        return self.schema.op_type

    @property
    def plugin_id(self) -> str:
        """``namespace::name``, the id ``tensorrt.plugin.register`` takes."""
        return f"{PLUGIN_NAMESPACE}::{self.schema.op_type}"

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def output_shapes(self, input_shapes: Mapping[str, Sequence[object]]) -> dict[str, tuple[object, ...]]:
        """Output name → shape, each dim copied from the input axis its rule names.

        Args:
            input_shapes: input name → shape (ints, dim_param strings or None for unknown dims).
        Raises:
            PluginError: an input the rules read is missing or has too few axes.
        """
        out = {}
        for rule in self.outputs:
            dims = []
            for source, axis in rule.dims:
                shape = input_shapes.get(source)
                if shape is None or len(shape) <= axis:
                    raise PluginError(f"{self.plugin_id}: output {rule.name!r} takes axis {axis} of input "
                                      f"{source!r}, found shape {None if shape is None else list(shape)}")
                dims.append(shape[axis])
            out[rule.name] = tuple(dims)
        return out

    def check_fields(self, values: Mapping[str, int]) -> dict[str, int]:
        """The field values with every field present and valid.

        Raises:
            PluginError: a missing, unknown or invalid field value (names the field and what was found).
        """
        unknown = sorted(set(values) - set(self.field_names))
        if unknown:
            raise PluginError(f"{self.plugin_id}: unknown plugin fields {unknown}; expected {list(self.field_names)}")
        out = {}
        for f in self.fields:
            value = values.get(f.name, f.default)
            if isinstance(value, (bool, np.bool_)):
                value = int(value)
            if not isinstance(value, (int, np.integer)):
                raise PluginError(f"{self.plugin_id}: field {f.name!r} expected an int, found {value!r}")
            value = int(value)
            if f.choices is not None and value not in f.choices:
                raise PluginError(f"{self.plugin_id}: field {f.name!r} expected one of {list(f.choices)}, "
                                  f"found {value}")
            if f.choices is None and (value < 1 or value & (value - 1)):
                raise PluginError(f"{self.plugin_id}: field {f.name!r} expected a power of two, found {value}")
            out[f.name] = value
        if "block_v" in out and out["block_v"] < 16:
            raise PluginError(f"{self.plugin_id}: field 'block_v' expected a power of two >= 16, "
                              f"found {out['block_v']}")
        return out


BLOCK_FIELDS = (
    PluginField("block_v", "vocab block of one program step (power of two >= 16)", DEFAULT_BLOCK_V),
    PluginField("num_probes", "probes per pass of the top-k/top-p searches (power of two)", DEFAULT_NUM_PROBES),
)
"""The vocab-block fields both plugins take (last, in this order)."""
