"""The TensorRT lowering (engines/trt/lowering.py) and `inspect --trt-compat` on the lowered graphs.

Runs without TensorRT: the lowered graphs are checked with the ONNX checker, strict shape inference and
the TensorRT 10.15 operator table (engines/trt/ops.py).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from dspark_export.cli import main as cli_main
from dspark_export.engines.manifest import Manifest
from dspark_export.engines.trt.lowering import LOWERED_SUFFIX, PLACEHOLDER_PREFIX, lower_file, lower_model
from dspark_export.engines.trt.ops import check_model
from dspark_export.errors import BuildError
from dspark_export.plugins.graph import make_op_model
from dspark_export.plugins.registry import PLUGIN_SPECS

BUCKETS = dict(target_buckets=(1, 2, 8), request_buckets=(1, 2), max_context=64,
               profile_context=16, profile_repeats=2, block_size=4, markov_rank=8)


@pytest.fixture(scope="module")
def engine_dir(build_tiny_engine_dir):
    return build_tiny_engine_dir("lowering", **BUCKETS)


@pytest.fixture(scope="module")
def lowered(engine_dir, tmp_path_factory):
    """Each canonical graph copied (with its data) to a scratch folder and lowered there."""
    import shutil

    work = tmp_path_factory.mktemp("lowered")
    manifest = Manifest.load(engine_dir)
    out = {}
    for name in ("target", "drafter_context", "drafter_block", "verify"):
        src = manifest.graph_path(name)
        for f in src.parent.iterdir():
            if not (work / f.name).exists():
                shutil.copy(f, work / f.name)
        out[name] = lower_file(work / src.name, name=name)
    return out


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def test_plugin_nodes_replace_the_custom_nodes(lowered):
    for name, (path, result) in lowered.items():
        assert path.name == f"{name}{LOWERED_SUFFIX}" and path.is_file()
        model = onnx.load(str(path), load_external_data=False)
        assert not [f for f in model.functions if f.domain == "dspark"], name
        custom = [n for n in model.graph.node if n.domain not in ("", "ai.onnx")]
        if name in ("target", "drafter_context"):
            assert not result.changed and not custom
            continue
        (node,) = custom
        spec = PLUGIN_SPECS[node.op_type]
        attrs = _attrs(node)
        assert node.domain == "dspark" and node.overload == ""
        assert attrs["plugin_namespace"] == b"dspark" and attrs["plugin_version"] == b"1" and attrs["aot"] == 1
        assert set(attrs) == {"plugin_namespace", "plugin_version", "aot", *spec.field_names}
        assert list(node.input) == [i for i in node.input if i] and len(node.input) == len(spec.schema.inputs)
        # the default build's MarkovDraft body has the CPU greedy slots (`_cpu`); the plugin replaces it all
        assert result.dropped_functions == [f"dspark::{node.op_type}" + ("[g4_markov_conf_cpu]"
                                                                         if name == "drafter_block" else "")]
        assert not any(o.domain == "dspark.cpu" for o in model.opset_import)
        if name == "drafter_block":  # the untrained drafter has Markov and confidence heads
            assert (attrs["has_markov"], attrs["has_confidence"]) == (1, 1)


def test_lowered_files_pass_the_checker_and_strict_shape_inference(lowered):
    for name, (path, _) in lowered.items():
        onnx.checker.check_model(str(path), full_check=True)  # from the path: external data found beside it
        inferred = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False),
                                                     strict_mode=True)
        types = {vi.name: vi.type.tensor_type.elem_type for vi in [*inferred.graph.value_info, *inferred.graph.output]}
        if name == "drafter_block":
            assert types["draft_ids"] == TensorProto.INT64 and types["draft_logits"] == TensorProto.FLOAT
        if name == "verify":
            assert types["num_accepted"] == types["next_ids"] == TensorProto.INT64


def test_lowered_graphs_have_no_trt_findings(lowered):
    """Without the function bodies, nothing in our graphs falls outside TensorRT 10.15's table (V real size)."""
    for name, (path, _) in lowered.items():
        findings = check_model(onnx.load(str(path), load_external_data=False), name, dims={"V": 49152})
        assert findings == [], (name, findings)


def test_other_nodes_are_untouched(engine_dir, lowered):
    manifest = Manifest.load(engine_dir)
    for name, (path, _) in lowered.items():
        before = onnx.load(str(manifest.graph_path(name)), load_external_data=False)
        after = onnx.load(str(path), load_external_data=False)
        keep = lambda m: [n.SerializeToString() for n in m.graph.node  # noqa: E731
                          if n.domain != "dspark" and "lm_head_int8" not in n.name]
        assert keep(before) == keep(after)
        assert [i.SerializeToString() for i in before.graph.input] == [i.SerializeToString() for i in after.graph.input]
        assert [o.SerializeToString() for o in before.graph.output] == [o.SerializeToString() for o in after.graph.output]


@pytest.mark.parametrize("has_markov,has_confidence", [(False, False), (True, False), (False, True)])
def test_absent_optional_inputs_become_placeholders(has_markov, has_confidence):
    config = dict(block_size=3, has_markov=has_markov, has_confidence=has_confidence)
    dims = {"V": 40, "H": 8, "r": 4 if has_markov else 0}  # without Markov weights the confidence input is h alone
    result = lower_model(make_op_model("MarkovDraft", config, dims=dims), "op")
    (node,) = result.model.graph.node
    attrs = _attrs(node)
    assert (attrs["has_markov"], attrs["has_confidence"]) == (int(has_markov), int(has_confidence))
    absent = [n for n, on in (("markov_w1", has_markov), ("markov_w2", has_markov),
                              ("confidence_weight", has_confidence), ("confidence_bias", has_confidence)) if not on]
    assert result.plugin_nodes[0]["placeholders"] == absent
    inits = {t.name: t for t in result.model.graph.initializer}
    for name in absent:
        tensor = inits[PLACEHOLDER_PREFIX + name]
        assert list(tensor.dims) == [1] * PLUGIN_SPECS["MarkovDraft"].placeholders[name]
        assert node.input[PLUGIN_SPECS["MarkovDraft"].schema.input_names.index(name)] == tensor.name
    assert result.plugin_nodes[0]["outputs"] == {"draft_ids": ["R", 3], "draft_logits": ["R", 3, 40],
                                                 "confidence": ["R", 3]}


def _with_node(model, mutate):
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    mutate(copy.graph.node[0])
    return copy


def test_lowering_errors_name_the_node():
    model = make_op_model("MarkovDraft", dict(block_size=2, has_markov=True, has_confidence=True), dims={"V": 20})
    half = _with_node(model, lambda n: n.input.__setitem__(9, ""))  # markov_w1 without markov_w2
    with pytest.raises(BuildError, match=r"/MarkovDraft.*markov_w1 without markov_w2"):
        lower_model(half, "op")
    wrong_tag = _with_node(model, lambda n: setattr(n, "overload", "g2"))
    with pytest.raises(BuildError, match="overload 'g2' disagrees"):
        lower_model(wrong_tag, "op")
    stranger = _with_node(model, lambda n: setattr(n, "op_type", "Stranger"))
    with pytest.raises(BuildError, match="dspark::Stranger, which has no TensorRT plugin"):
        lower_model(stranger, "op")
    no_anchor = _with_node(model, lambda n: n.input.__setitem__(2, ""))
    with pytest.raises(BuildError, match=r"lacks required inputs \['anchor_ids'\]"):
        lower_model(no_anchor, "op")
    with pytest.raises(BuildError, match="unknown ops"):
        lower_model(model, "op", fields={"Nope": {}})
    with pytest.raises(BuildError, match="power of two"):
        lower_model(model, "op", fields={"MarkovDraft": {"block_v": 100}})


def test_nested_custom_node_is_refused():
    inner = helper.make_graph([helper.make_node("SpeculativeVerify", ["a"], ["b"], domain="dspark", name="inner")],
                              "then", [], [helper.make_tensor_value_info("b", TensorProto.INT64, [1])])
    other = helper.make_graph([helper.make_node("Identity", ["a"], ["c"])], "else", [],
                              [helper.make_tensor_value_info("c", TensorProto.INT64, [1])])
    graph = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=inner, else_branch=other)], "g",
                              [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("a", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("dspark", 1)])
    with pytest.raises(BuildError, match="inside a subgraph"):
        lower_model(model, "nested")


def test_lower_file_keeps_beside_its_data(lowered, tmp_path):
    path, _ = lowered["verify"]
    with pytest.raises(BuildError, match="must sit beside"):
        lower_file(path.with_name("verify.onnx"), tmp_path / "elsewhere.onnx")


def test_custom_fields_reach_the_node():
    model = make_op_model("SpeculativeVerify", {}, dims={"V": 20})
    result = lower_model(model, "verify", fields={"SpeculativeVerify": {"block_v": 256, "num_probes": 4}})
    assert {k: v for k, v in _attrs(result.model.graph.node[0]).items() if k in ("block_v", "num_probes")} == \
        {"block_v": 256, "num_probes": 4}


# -- inspect --trt-compat on the lowered graphs ------------------------------------------------------------

def _inspect(capsys, *argv):
    code = cli_main(["inspect", *map(str, argv)])
    out, _ = capsys.readouterr()
    return code, out


def test_inspect_checks_the_lowered_graphs(engine_dir, capsys):
    code, out = _inspect(capsys, engine_dir, "--trt-compat", "--json")
    trt = json.loads(out)["trt_compat"]
    assert code == 0 and trt["verdict"] == "supported" and trt["trt_minor"] == 15
    assert {p["op"]: p["function_body"] for p in trt["plugin_nodes"]} == {"dspark::MarkovDraft": False,
                                                                          "dspark::SpeculativeVerify": False}
    assert trt["lowering"]["drafter_block"]["dropped_functions"] == ["dspark::MarkovDraft[g4_markov_conf_cpu]"]
    assert all(f["fallback"] for f in trt["findings"])  # what remains is inside the canonical function bodies


def test_inspect_below_trt_10_9_blocks_the_plugins(engine_dir, capsys):
    code, out = _inspect(capsys, engine_dir, "--trt-compat", "--trt-minor", "8", "--json")
    trt = json.loads(out)["trt_compat"]
    blocking = [(f["graph"], f["rule"]) for f in trt["findings"] if f["severity"] == "error" and not f["fallback"]]
    assert code == 1 and trt["verdict"] == "unsupported"
    assert sorted(blocking) == [("drafter_block", "plugin-trt-minor"), ("verify", "plugin-trt-minor")]
    code, out = _inspect(capsys, engine_dir, "--trt-compat", "--trt-minor", "8")
    assert code == 1 and "needs TensorRT >= 10.9, targeted 10.8" in out


def test_placeholder_values_are_zero():
    result = lower_model(make_op_model("MarkovDraft", dict(block_size=2, has_markov=False, has_confidence=False),
                                       dims={"V": 20}), "op")
    for t in result.model.graph.initializer:
        assert np.all(onnx.numpy_helper.to_array(t) == 0) and t.data_type == TensorProto.FLOAT


def test_int8_lm_head_becomes_weight_only_dequantize_matmul():
    """TensorRT imports neither DynamicQuantizeLinear nor MatMulInteger: the lowering rewrites the exporter's int8
    head to MatMul(h, DequantizeLinear(w_q, scale, axis=1)) on the same int8 weights."""
    from dspark_export.exporter.builder import GraphBuilder
    from dspark_export.exporter.drafter import int8_lm_head
    from dspark_export.exporter.quantize import quantize_rows_int8

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((50, 8)).astype(np.float32)
    b = GraphBuilder("drafter_block")
    b.input("h", "float32", ["n", 8])
    b.output(int8_lm_head(b, "h", weight), "logits", "float32", ["n", 50])
    model = b.model()
    result = lower_model(model, "drafter_block")
    ops = [n.op_type for n in result.model.graph.node]
    assert "MatMulInteger" not in ops and "Round" not in ops and "Clip" not in ops
    assert ops.count("DequantizeLinear") == 1 and ops.count("MatMul") == 1 and result.changed
    assert result.int8_heads == ["/drafter_block/lm_head_int8/MatMul"]
    h = rng.standard_normal((3, 8)).astype(np.float32)
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # EXTENDED fuses DQ + MatMul to int8
    run = lambda m: ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"h": h})[0]
    w_q, scale = quantize_rows_int8(weight)
    np.testing.assert_allclose(run(result.model), h @ (w_q.astype(np.float32) * scale), rtol=1e-5, atol=1e-5)
    exact = h @ weight.T
    assert np.abs(run(model) - exact).max() < 0.03 * np.abs(exact).max()   # the ORT form: activations quantized too


def test_trt_compare_reference_for_an_int8_head_is_weight_only(engine_dir):
    """`trt compare`'s ONNX Runtime reference of an int8-head drafter block computes TensorRT's weight-only math."""
    import onnxruntime as ort

    from dspark_export.engines.profiler import engine_feed
    from dspark_export.engines.trt.compare import reference_session
    from dspark_export.plugins import cpu_ops

    root = engine_dir
    manifest = Manifest.load(root)
    assert manifest.data["graphs"]["drafter_block"]["spec"]["lm_head_dtype"] == "int8"
    path = manifest.graph_path("drafter_block")
    session = reference_session(path, "drafter_block")()
    feed = engine_feed(manifest.data["graphs"], "drafter_block", 2, 8)
    ref = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
    so = ort.SessionOptions()
    cpu_ops.register_for(so, str(path))
    canonical = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in canonical.get_outputs()], canonical.run(None, feed)))
    np.testing.assert_allclose(ref["hidden"], got["hidden"], rtol=1e-4, atol=1e-5)   # fusions differ by level
    span = float(np.abs(got["draft_logits"]).max())
    assert 0 < float(np.abs(ref["draft_logits"] - got["draft_logits"]).max()) < 0.05 * span
    assert reference_session(manifest.graph_path("target"), "target")().get_outputs()  # plain graphs load as they are


@pytest.mark.parametrize("has_confidence", [True, False])
def test_draft_vocab_node_expands_to_the_full_vocabulary_plugin(has_confidence):
    """A MarkovDraft node fed d2t becomes the plugin's full-vocabulary form: the expansion nodes, run on ONNX
    Runtime, give base logits and W2 over V with which the op without d2t drafts exactly as with it, and a
    Gather at d2t returns its draft_logits to the graph's [R, γ, Vd]."""
    import onnxruntime as ort

    from dspark_export.plugins.markov_draft.reference import run as markov_reference

    config = dict(block_size=3, has_markov=True, has_confidence=has_confidence, has_d2t=True)
    model = make_op_model("MarkovDraft", config, dims={"V": 40, "Vd": 9, "H": 8, "r": 4})
    result = lower_model(model, "op")
    assert result.draft_vocab_nodes == ["/MarkovDraft"]
    plugin = [n for n in result.model.graph.node if n.domain == "dspark"]
    assert len(plugin) == 1 and len(plugin[0].input) == len(PLUGIN_SPECS["MarkovDraft"].schema.inputs)
    assert result.plugin_nodes[0]["outputs"]["draft_logits"] == ["R", 3, 40]
    assert not check_model(result.model)  # no TensorRT findings for the expansion nodes
    base_full, w2_full = plugin[0].input[0], plugin[0].input[9]
    nodes = list(result.model.graph.node)
    at = nodes.index(plugin[0])
    (back,) = nodes[at + 1:]
    assert (back.op_type, list(back.input), list(back.output)) == ("Gather", [plugin[0].output[1], "d2t"], ["draft_logits"])
    assert helper.get_attribute_value(back.attribute[0]) == 2
    # the expansion nodes alone, as an ONNX Runtime model
    expansion = [n for n in nodes[:at] if n.domain != "dspark"]
    inputs = [i for i in result.model.graph.input if i.name in ("base_logits", "markov_w1", "markov_w2", "d2t")]
    sub = helper.make_model(helper.make_graph(expansion, "expand", inputs, [
        helper.make_tensor_value_info(base_full, TensorProto.FLOAT, None),
        helper.make_tensor_value_info(w2_full, TensorProto.FLOAT, None)]), opset_imports=[helper.make_opsetid("", 21)])
    sess = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(11)
    d2t = np.sort(rng.choice(40, 9, replace=False)).astype(np.int64)
    feeds = dict(base_logits=rng.normal(size=(2, 3, 9)).astype(np.float32), hidden=rng.normal(size=(2, 3, 8)).astype(
        np.float32), anchor_ids=np.array([5, 39]), temperature=np.array([0.0, 1.0], np.float32),
        top_k=np.zeros(2, np.int64), top_p=np.ones(2, np.float32), uniforms=rng.random((2, 3), dtype=np.float32),
        confidence_temperature=np.ones(3, np.float32), markov_w1=rng.normal(size=(40, 4)).astype(np.float32),
        markov_w2=rng.normal(size=(9, 4)).astype(np.float32), d2t=d2t)
    if has_confidence:
        feeds.update(confidence_weight=rng.normal(size=12).astype(np.float32), confidence_bias=np.zeros(1, np.float32))
    got_base, got_w2 = sess.run(None, {k: feeds[k] for k in ("base_logits", "markov_w1", "markov_w2", "d2t")})
    assert got_base.shape == (2, 3, 40) and got_w2.shape == (40, 4)
    np.testing.assert_array_equal(got_w2[d2t], feeds["markov_w2"])
    full = markov_reference({**{k: v for k, v in feeds.items() if k != "d2t"}, "base_logits": got_base,
                             "markov_w2": got_w2})
    expected = markov_reference(feeds)
    full["draft_logits"] = full["draft_logits"][..., d2t]   # the Gather after the plugin
    for name in expected:
        np.testing.assert_array_equal(full[name], expected[name], err_msg=name)
