"""Op contracts: tensor specs, op schemas and the boundary check every reference runs first.

A shape is a tuple of dimension expressions over the letters of docs/ARCHITECTURE.md
(R requests, γ draft block size, V vocab, H hidden size, r Markov rank, M target logit rows).
An expression is one letter (``"V"``) or a sum of letters and integers (``"γ+1"``, ``"H+r"``).
The first input whose expression has one unbound letter binds it; every later use must agree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import defs

from dspark_export.errors import PluginError

_ONNX_ELEM_TYPE = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.int64): onnx.TensorProto.INT64}
_DTYPE_NAME = {np.dtype(np.float32): "float32", np.dtype(np.int64): "int64"}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output of an op: name, symbolic shape, dtype, meaning, optionality."""

    name: str
    shape: tuple[str, ...]
    dtype: np.dtype
    doc: str
    optional: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if self.dtype not in _ONNX_ELEM_TYPE:
            raise PluginError(f"TensorSpec {self.name!r}: dtype must be float32 or int64, found {self.dtype}")

    @property
    def elem_type(self) -> int:
        """The ONNX ``TensorProto`` element type of this tensor."""
        return _ONNX_ELEM_TYPE[self.dtype]

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAME[self.dtype]

    def describe(self) -> str:
        """``"[R, γ, V] float32"``, the form every docstring uses."""
        return f"[{', '.join(self.shape)}] {self.dtype_name}"


@dataclasses.dataclass(frozen=True)
class OpSchema:
    """The single source of truth of one custom op (domain, version, ordered inputs and outputs)."""

    op_type: str
    domain: str
    version: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    doc: str

    @property
    def qualified_name(self) -> str:
        return f"{self.domain}::{self.op_type}"

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.outputs)

    @property
    def optional_input_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.inputs if spec.optional)

    def input(self, name: str) -> TensorSpec:
        """The spec of input ``name``; raises PluginError for an unknown name."""
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise PluginError(f"{self.qualified_name} has no input {name!r}; inputs are {list(self.input_names)}")

    def to_onnx_schema(self) -> defs.OpSchema:
        """An ``onnx.defs.OpSchema`` for this op (not registered: registration is global state)."""
        option = defs.OpSchema.FormalParameterOption

        def formal(spec: TensorSpec) -> defs.OpSchema.FormalParameter:
            kind = option.Optional if spec.optional else option.Single
            type_str = f"tensor({'float' if spec.dtype == np.float32 else 'int64'})"
            return defs.OpSchema.FormalParameter(spec.name, type_str, f"{spec.describe()}: {spec.doc}", param_option=kind)

        return defs.OpSchema(
            self.op_type, self.domain, self.version, self.doc,
            inputs=[formal(s) for s in self.inputs], outputs=[formal(s) for s in self.outputs],
        )

    def check_inputs(self, arrays: Mapping[str, np.ndarray | None], dims: Mapping[str, int] | None = None) -> dict[str, int]:
        """Check presence, dtype, rank and dimension agreement of ``arrays`` against the inputs.

        Args:
            arrays: input name -> array, or None for an absent optional input.
            dims: dimension letters known in advance (e.g. ``{"r": 0}`` without Markov weights).

        Returns:
            Every dimension letter bound by the inputs, e.g. ``{"R": 2, "γ": 4, "V": 50}``.

        Raises:
            PluginError: an unknown or missing input, or a dtype or shape that breaks the contract;
                the message names the input, the expected shape with the bound letters, and what was found.
        """
        unknown = sorted(set(arrays) - set(self.input_names))
        if unknown:
            raise PluginError(f"{self.qualified_name}: unknown inputs {unknown}; expected names {list(self.input_names)}")
        binder = _DimBinder(dict(dims or {}))
        # Inputs whose shapes are plain letters bind first, so "R+1" is checked against R, not the reverse.
        for spec in sorted(self.inputs, key=lambda s: any("+" in expr for expr in s.shape)):
            array = arrays.get(spec.name)
            if array is None:
                if not spec.optional:
                    raise PluginError(f"{self.qualified_name}: required input {spec.name!r} ({spec.describe()}) is missing")
                continue
            self._check_one(spec, array, binder)
        return binder.values

    def _check_one(self, spec: TensorSpec, array: np.ndarray, binder: _DimBinder) -> None:
        where = f"{self.qualified_name} input {spec.name!r}"
        if not isinstance(array, np.ndarray):
            raise PluginError(f"{where}: expected a numpy array {spec.describe()}, found {type(array).__name__}")
        found = f"found shape {tuple(array.shape)} {array.dtype}"
        if array.dtype != spec.dtype or array.ndim != len(spec.shape):
            raise PluginError(f"{where}: expected {spec.describe()}, {found}")
        for axis, (expr, size) in enumerate(zip(spec.shape, array.shape)):
            expected = binder.resolve(expr, size, spec.name)
            if expected != size:
                raise PluginError(
                    f"{where}: expected {spec.describe()} with {binder.explain(expr)}, {found} (axis {axis} is {size}, "
                    f"expected {expected})"
                )


class _DimBinder:
    """Binds dimension letters to sizes, remembering which input bound each letter."""

    def __init__(self, values: dict[str, int]):
        self.values = values
        self._source = {letter: "the op configuration" for letter in values}

    def resolve(self, expr: str, size: int, source: str) -> int:
        """The size ``expr`` must have; a single unbound letter in ``expr`` is bound so that it fits ``size``."""
        terms = expr.split("+")
        unbound = [t for t in terms if not t.isdigit() and t not in self.values]
        if len(unbound) > 1:
            raise PluginError(f"dimension {expr!r} of input {source!r} has several unbound letters {unbound}")
        known = sum(int(t) if t.isdigit() else self.values[t] for t in terms if t not in unbound)
        if unbound and size >= known:
            self.values[unbound[0]] = size - known
            self._source[unbound[0]] = repr(source)
        return known + sum(self.values.get(t, 0) for t in unbound)

    def explain(self, expr: str) -> str:
        letters = [t for t in expr.split("+") if not t.isdigit()]
        return ", ".join(f"{t}={self.values[t]} from {self._source[t]}" for t in letters if t in self.values)


def make_schema_table(schema: OpSchema) -> str:
    """The I/O contract table of ``schema`` in the markdown form the schema docstrings carry."""
    rows = ["| name | shape | dtype | meaning |", "| --- | --- | --- | --- |"]
    for kind, specs in (("in", schema.inputs), ("out", schema.outputs)):
        for spec in specs:
            optional = " (optional)" if spec.optional else ""
            rows.append(f"| {kind} `{spec.name}`{optional} | [{', '.join(spec.shape)}] | {spec.dtype_name} | {spec.doc} |")
    return "\n".join(rows)
