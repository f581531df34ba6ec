"""plugins/graph.py and plugins/registry.py: standalone op models, several configurations in one model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from dspark_export.errors import PluginError
from dspark_export.plugins.common import DOMAIN, IR_VERSION, ONNX_OPSET, OPSET_VERSION
from dspark_export.plugins.graph import make_op_model
from dspark_export.plugins.markov_draft.onnx_function import make_function as make_markov_function
from dspark_export.plugins.markov_draft.onnx_function import make_node as make_markov_node
from dspark_export.plugins.common.onnx_builder import opset_imports
from dspark_export.plugins.registry import OP_REGISTRY, get_op
from dspark_export.plugins.speculative_verify.onnx_function import make_function as make_verify_function
from dspark_export.plugins.speculative_verify.onnx_function import make_node as make_verify_node
from plugin_cases import MARKOV_CONFIGS, markov_feeds, verify_feeds

MODEL_CASES = {f"MarkovDraft-{tag}": ("MarkovDraft", dict(block_size=4, **cfg)) for tag, cfg in MARKOV_CONFIGS.items()}
MODEL_CASES["SpeculativeVerify"] = ("SpeculativeVerify", {})


@pytest.mark.parametrize("tag", MODEL_CASES)
def test_op_model_matches_the_schema(tag):
    op_name, config = MODEL_CASES[tag]
    model = make_op_model(op_name, config)  # runs check_model(full_check=True)
    schema = OP_REGISTRY[op_name].schema
    present = OP_REGISTRY[op_name].present_inputs(config)
    assert [i.name for i in model.graph.input] == list(present)
    assert [o.name for o in model.graph.output] == list(schema.output_names)
    for value in [*model.graph.input, *model.graph.output]:
        spec = schema.input(value.name) if value.name in schema.input_names else schema.outputs[
            schema.output_names.index(value.name)]
        assert value.type.tensor_type.elem_type == spec.elem_type
        assert len(value.type.tensor_type.shape.dim) == len(spec.shape)
    (node,) = model.graph.node
    (function,) = model.functions
    assert (node.domain, node.op_type, function.domain, function.name) == (DOMAIN, op_name, DOMAIN, op_name)
    assert node.overload == function.overload
    assert list(function.input) == list(schema.input_names)
    assert {(o.domain, o.version) for o in model.opset_import} == {("", ONNX_OPSET), (DOMAIN, OPSET_VERSION)}
    assert model.ir_version == IR_VERSION
    assert all(n.domain in ("", "ai.onnx") for n in function.node)  # only standard ops in the body


def test_dims_are_pinned_or_symbolic():
    model = make_op_model("MarkovDraft", dict(block_size=7, has_markov=True, has_confidence=True), dims={"V": 37})
    dims = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    assert dims["base_logits"] == ["R", 7, 37]
    assert dims["confidence_weight"] == ["H_plus_r"]
    verify = make_op_model("SpeculativeVerify", {})
    dims = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in verify.graph.input}
    assert dims["uniforms"] == ["R", "gamma_plus_1"] and dims["query_start"] == ["R_plus_1"]


def test_two_markov_configurations_and_a_verify_in_one_model():
    """Overloads let two MarkovDraft bodies coexist; ORT inlines all three functions."""
    configs = [dict(block_size=4, has_markov=True, has_confidence=True), dict(block_size=7, **MARKOV_CONFIGS["plain"])]
    rng = np.random.default_rng(0)
    feeds, nodes, inputs, outputs, expected = {}, [], [], [], {}
    for index, config in enumerate(configs):
        op_feeds = markov_feeds(rng, "mixed", config, num_requests=3)
        names = {name: f"{name}_{index}" for name in op_feeds}
        feeds.update({names[k]: v for k, v in op_feeds.items()})
        node_inputs = [names.get(name, "") for name in OP_REGISTRY["MarkovDraft"].schema.input_names]
        out_names = [f"{name}_{index}" for name in OP_REGISTRY["MarkovDraft"].schema.output_names]
        nodes.append(make_markov_node(node_inputs, out_names, f"/MarkovDraft_{index}", **config))
        expected.update({f"{k}_{index}": v for k, v in OP_REGISTRY["MarkovDraft"].reference(op_feeds).items()})
        outputs += out_names
    verify = verify_feeds(rng, "mixed", [1, 4, 0], 4)
    feeds.update(verify)
    nodes.append(make_verify_node(list(verify), ["num_accepted", "next_ids"], "/SpeculativeVerify"))
    expected.update(OP_REGISTRY["SpeculativeVerify"].reference(verify))
    outputs += ["num_accepted", "next_ids"]
    graph = helper.make_graph(nodes, "three_ops", [_info(k, v) for k, v in feeds.items()],
                              [_info(name, expected[name]) for name in outputs])
    functions = [make_markov_function(**configs[0]), make_markov_function(**configs[1]), make_verify_function()]
    model = helper.make_model(graph, opset_imports=opset_imports(), functions=functions, ir_version=IR_VERSION)
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    actual = dict(zip(outputs, session.run(outputs, feeds)))
    for name in outputs:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_registry_lookup_and_errors():
    assert sorted(OP_REGISTRY) == ["MarkovDraft", "SpeculativeVerify"]
    assert get_op("SpeculativeVerify").schema.qualified_name == "dspark::SpeculativeVerify"
    with pytest.raises(PluginError, match="unknown dspark op 'Nope'"):
        get_op("Nope")
    with pytest.raises(PluginError, match="no static configuration"):
        make_op_model("SpeculativeVerify", {"block_size": 4})
    with pytest.raises(PluginError, match="expected keys"):
        make_op_model("MarkovDraft", {"block_size": 4})


def _info(name: str, array: np.ndarray) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), [None] * array.ndim)
