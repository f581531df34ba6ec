"""plugins/common/contract.py and the two schema.py files: specs, boundary checks, docstring tables."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_export.errors import PluginError
from dspark_export.plugins.common.contract import OpSchema, TensorSpec, make_schema_table
from dspark_export.plugins.markov_draft import schema as markov_draft_schema
from dspark_export.plugins.speculative_verify import schema as verify_schema

F32, I64 = np.float32, np.int64
TOY = OpSchema(
    "Toy", "dspark", 1,
    inputs=(TensorSpec("offsets", ("R+1",), I64, "x"), TensorSpec("x", ("R", "V"), F32, "x"),
            TensorSpec("w", ("V+r",), F32, "x", optional=True)),
    outputs=(TensorSpec("y", ("R",), I64, "x"),), doc="toy",
)


@pytest.mark.parametrize("module", [markov_draft_schema, verify_schema], ids=["MarkovDraft", "SpeculativeVerify"])
def test_docstring_table_is_the_schema(module):
    assert make_schema_table(module.SCHEMA) in module.__doc__


@pytest.mark.parametrize("module", [markov_draft_schema, verify_schema], ids=["MarkovDraft", "SpeculativeVerify"])
def test_onnx_opschema_marks_optional_inputs(module):
    onnx_schema = module.SCHEMA.to_onnx_schema()
    assert (onnx_schema.domain, onnx_schema.name, onnx_schema.since_version) == ("dspark", module.SCHEMA.op_type, 1)
    optional = [p.name for p in onnx_schema.inputs if p.option.name == "Optional"]
    assert optional == list(module.SCHEMA.optional_input_names)


def test_letters_bind_from_plain_shapes_first():
    dims = TOY.check_inputs({"offsets": np.zeros(4, I64), "x": np.zeros((3, 5), F32), "w": np.zeros(7, F32)})
    assert dims == {"R": 3, "V": 5, "r": 2}
    with pytest.raises(PluginError, match=r"'offsets'.*\[R\+1\] int64 with R=3 from 'x'.*\(3,\)"):
        TOY.check_inputs({"offsets": np.zeros(3, I64), "x": np.zeros((3, 5), F32)})


def test_preset_dims_and_presence():
    with pytest.raises(PluginError, match=r"'w'.*r=0 from the op configuration"):
        TOY.check_inputs({"offsets": np.zeros(4, I64), "x": np.zeros((3, 5), F32), "w": np.zeros(7, F32)}, {"r": 0})
    with pytest.raises(PluginError, match="required input 'x'"):
        TOY.check_inputs({"offsets": np.zeros(4, I64)})
    with pytest.raises(PluginError, match="unknown inputs \\['z'\\]"):
        TOY.check_inputs({"z": np.zeros(1, F32)})
    with pytest.raises(PluginError, match="has no input 'z'"):
        TOY.input("z")


def test_tensor_spec_dtypes():
    assert TensorSpec("a", ("R",), np.int64, "x").describe() == "[R] int64"
    with pytest.raises(PluginError, match="float32 or int64"):
        TensorSpec("a", ("R",), np.int32, "x")
