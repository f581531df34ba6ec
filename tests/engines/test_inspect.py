"""`dspark-export inspect`: summary, integrity, and the TensorRT operator check (engines/inspect.py, engines/trt/ops.py)."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
from onnx import TensorProto, helper

from dspark_export.cli import main as cli_main
from dspark_export.engines.inspect import inspect_engine_dir
from dspark_export.engines.trt.ops import OPS, TOPK_MAX_K, check_model
from dspark_export.errors import ConfigError

BUCKETS = dict(target_buckets=(1, 2, 4, 8), request_buckets=(1, 2), max_context=64,
               profile_context=16, profile_repeats=2, block_size=4, markov_rank=8)

#: what `inspect --trt-compat` reports on the real default build (SmolLM2, V = 49152) as
#: (graph, op, rule, severity, fallback), without counts; every graph parses with our plugins (exit 0).
REAL_FINDINGS = {
    ("drafter_block", "TopK", "topk-k", "error", "dspark::MarkovDraft"),
    ("drafter_block", "TopK", "topk-k-runtime", "warning", "dspark::MarkovDraft"),
    ("verify", "TopK", "topk-k-runtime", "warning", "dspark::SpeculativeVerify"),   # rows padded at run time
    ("verify", "CumSum", "dtype", "error", "dspark::SpeculativeVerify"),
    # the greedy slots' CPU kernel inside MarkovDraft's body (the TensorRT plugin replaces the body)
    ("drafter_block", "dspark.cpu::MarkovDraftGreedy", "unknown-custom-op", "error", "dspark::MarkovDraft"),
}
#: the one rule that depends on the model's size: K = V of the top-p sort is under TensorRT's limit when V = 256
SIZE_DEPENDENT = {"topk-k"}


@pytest.fixture(scope="module")
def engine_dir(build_tiny_engine_dir):
    return build_tiny_engine_dir("inspect", **BUCKETS)


@pytest.fixture
def copy_dir(engine_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(engine_dir, dst)
    for p in [dst, *dst.rglob("*")]:  # the build leaves the directory read-only for others, not for us
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


def _run(capsys, *argv):
    code = cli_main(["inspect", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


# -- summary -------------------------------------------------------------------------------------------

def test_summary_text(engine_dir, capsys):
    code, out, err = _run(capsys, engine_dir)
    assert code == 0 and err == ""
    assert "integrity ok" in out and "NOT trained" in out
    for graph in ("target", "drafter_context", "drafter_block", "verify"):
        assert f"graphs/{graph}.onnx" in out
    assert "past_key.{0..3}" in out and "int64  [N]" in out  # 4 tiny layers fold into one row
    assert "dspark::MarkovDraft" in out and "ai.onnx 21" in out
    assert "{1,2,4,8}" in out and "{1,2}" in out  # engine buckets
    assert "median ms" in out and "SPS" in out
    assert "layout cost: c_a" in out and "ms per slot per KV entry" in out
    assert "block_size 4, max_context 64, vocab 256, eos [2]" in out
    assert "tokenizer.json" in out and "onnxruntime" in out
    assert "hidden 64, heads 4/2 kv × 16, vocab 256" in out and "confidence head" in out
    assert "calibration  none (all confidence temperatures 1)" in out and "report     report/index.html" in out
    assert "TensorRT" not in out  # only with --trt-compat


def test_summary_json_keys(engine_dir, capsys):
    code, out, _ = _run(capsys, engine_dir, "--json")
    assert code == 0
    d = json.loads(out)
    assert set(d) == {"dir", "schema_version", "tool", "created_unix", "source", "models", "plugins", "integrity",
                      "graphs", "engines", "buckets", "runtime", "profile", "calibration", "report", "tokenizer",
                      "versions", "build"}
    assert d["models"]["target"]["hidden_size"] == 64 and d["models"]["target"]["num_kv_heads"] == 2
    assert d["models"]["drafter"]["block_size"] == 4 and d["models"]["drafter"]["markov_rank"] == 8
    assert d["calibration"] == {"temperatures": [1.0] * 4, "biases": [0.0] * 4, "calibrated": False, "path": None, "method": None,
                                "rounds": None, "ece_before": None, "ece_after": None, "mean_ece_before": None,
                                "mean_ece_after": None, "reliability_bins": False}
    assert d["report"]["path"] == "report/index.html"
    folders = d["integrity"]["folders"]
    assert set(folders) == {"graphs", "engines", "profile", "tokenizer", "report"}
    assert sum(f["files"] for f in folders.values()) + 1 == d["integrity"]["files"]
    assert d["source"]["drafter"]["is_trained"] is False and d["integrity"]["verified"] is True
    g = d["graphs"]["target"]
    assert {"path", "bytes", "data", "data_bytes", "nodes", "opset_imports", "inputs", "outputs", "functions"} <= set(g)
    assert g["opset_imports"] == {"ai.onnx": 21} and g["nodes"] > 100
    assert g["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": ["N"]}
    assert d["graphs"]["verify"]["functions"][0]["name"] == "dspark::SpeculativeVerify"
    assert d["engines"]["target"] == {"backend": "onnxruntime", "dim": "N", "buckets": [1, 2, 4, 8]}
    assert d["engines"]["verify"]["buckets"] == [1, 2]
    assert [r["B"] for r in d["profile"]["target"]] == [1, 2, 4, 8]
    assert set(d["profile"]["target"][0]) == {"B", "median_ms", "p10_ms", "p90_ms", "sps"}
    assert isinstance(d["profile"]["warnings"], list)
    assert {t["path"] for t in d["tokenizer"]} >= {"tokenizer/tokenizer.json"}
    assert d["runtime"]["vocab_size"] == 256 and "onnx" in d["versions"]


# -- integrity -----------------------------------------------------------------------------------------

def test_altered_file_exits_2_naming_it(copy_dir, capsys):
    path = copy_dir / "graphs" / "verify.onnx"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # same size, different sha256
    path.write_bytes(bytes(raw))
    code, out, err = _run(capsys, copy_dir)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "'graphs/verify.onnx'" in err and "sha256" in err


def test_extra_unlisted_file_exits_2_naming_it(copy_dir, capsys):
    (copy_dir / "engines" / "onnxruntime" / "stray.json").write_text("{}")
    code, out, err = _run(capsys, copy_dir, "--trt-compat")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "'engines/onnxruntime/stray.json'" in err and "not listed" in err


def test_missing_file_and_missing_dir(copy_dir, capsys):
    (copy_dir / "tokenizer" / "tokenizer.json").unlink()
    code, _, err = _run(capsys, copy_dir)
    assert code == 2 and "'tokenizer/tokenizer.json'" in err and "missing" in err
    code, _, err = _run(capsys, copy_dir.parent / "nowhere")
    assert code == 2 and err.count("\n") == 1


def test_unknown_trt_version_is_an_error(engine_dir, capsys):
    code, _, err = _run(capsys, engine_dir, "--trt-compat", "--trt-version", "7")
    assert code == 2 and "--trt-version" in err
    with pytest.raises(ConfigError):
        check_model(helper.make_model(helper.make_graph([], "g", [], [])), trt_major=11)


# -- TensorRT operator check ---------------------------------------------------------------------------

def _model(nodes, inputs, outputs, *, functions=(), opsets=(("", 21),), initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets],
                             functions=list(functions), ir_version=10)


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _rules(findings):
    return {(f.node, f.op, f.rule, f.severity, f.fallback) for f in findings}


def test_unsupported_ops_are_reported():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="ok_relu"),
        helper.make_node("FrobnicateND", ["r"], ["f"], name="made_up"),         # not an ONNX op at all
        helper.make_node("Unique", ["r"], ["u"], name="unique"),                # ONNX op TensorRT lists as "N"
        helper.make_node("CumSum", ["ids", "axis"], ["c"], name="cumsum_i64"),  # INT64 data
        helper.make_node("ReduceMean", ["x", "axes_dyn"], ["m"], name="mean_dyn_axes"),
        helper.make_node("TopK", ["wide", "k"], ["tv", "ti"], name="topk_wide"),
        helper.make_node("Equal", ["flags", "flags"], ["e"], name="equal_bool"),
    ]
    inputs = [_vi("x", TensorProto.FLOAT, [2, 3]), _vi("ids", TensorProto.INT64, [4]),
              _vi("axes_dyn", TensorProto.INT64, [1]), _vi("wide", TensorProto.FLOAT, [2, 4096]),
              _vi("flags", TensorProto.BOOL, [3])]
    inits = [helper.make_tensor("axis", TensorProto.INT64, [], [0]),
             helper.make_tensor("k", TensorProto.INT64, [1], [4096])]
    outputs = [_vi(n, TensorProto.UNDEFINED, None) for n in ("f", "u", "c", "m", "tv", "e")]
    findings = check_model(_model(nodes, inputs, outputs, initializers=inits), "hand")
    got = {(f.node, f.rule) for f in findings}
    assert got == {("made_up", "not-in-table"), ("unique", "unsupported-op"), ("cumsum_i64", "dtype"),
                   ("mean_dyn_axes", "not-constant"), ("topk_wide", "topk-k"), ("equal_bool", "dtype")}
    assert all(f.blocking and f.graph == "hand" for f in findings)
    topk = next(f for f in findings if f.rule == "topk-k")
    assert "4096" in topk.reason and str(TOPK_MAX_K) in topk.reason


def test_subgraphs_and_custom_ops():
    """If branches are walked; a custom op outside our plugin list is an error; a plugin's function body is a
    fallback report; a non-plugin custom op with a function is imported through its body (errors count)."""
    then = helper.make_graph([helper.make_node("Unique", ["x"], ["t"], name="then_unique")], "then", [],
                             [_vi("t", TensorProto.FLOAT, [3])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["o"], name="else_id")], "else", [],
                              [_vi("o", TensorProto.FLOAT, [3])])
    body = [helper.make_node("CumSum", ["a", "zero"], ["b"], name="body_cumsum"),
            helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.INT64, [], [0]),
                             name="body_zero")]
    body = [body[1], body[0]]
    plug_fn = helper.make_function("dspark", "Plug", ["a"], ["b"], body, [helper.make_opsetid("", 21)])
    local_fn = helper.make_function("acme", "Local", ["a"], ["b"], body, [helper.make_opsetid("", 21)])
    nodes = [
        helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="branch"),
        helper.make_node("Plug", ["ids"], ["p"], domain="dspark", name="plug"),
        helper.make_node("Local", ["ids"], ["q"], domain="acme", name="local"),
        helper.make_node("Stranger", ["ids"], ["s"], domain="dspark", name="stranger"),
    ]
    inputs = [_vi("cond", TensorProto.BOOL, []), _vi("x", TensorProto.FLOAT, [3]), _vi("ids", TensorProto.INT64, [5])]
    outputs = [_vi(n, TensorProto.UNDEFINED, None) for n in ("y", "p", "q", "s")]
    model = _model(nodes, inputs, outputs, functions=[plug_fn, local_fn],
                   opsets=(("", 21), ("dspark", 1), ("acme", 1)))
    plugin_nodes = []
    findings = check_model(model, "hand", plugins={"dspark::Plug": 1}, plugin_nodes=plugin_nodes)
    assert _rules(findings) == {
        ("then_unique", "Unique", "unsupported-op", "error", ""),
        ("body_cumsum", "CumSum", "dtype", "error", "dspark::Plug"),  # fallback only
        ("body_cumsum", "CumSum", "dtype", "error", ""),              # acme::Local has no plugin: its body counts
        ("stranger", "dspark::Stranger", "unknown-custom-op", "error", ""),
    }
    assert [p["op"] for p in plugin_nodes] == ["dspark::Plug"]
    scopes = {f.node: f.scope for f in findings if not f.fallback}
    assert scopes["then_unique"] == "If branch.then_branch" and scopes["stranger"] == ""


def test_table_shape():
    assert OPS["Gather"].supported and "INT64" in OPS["Gather"].types
    assert "INT64" in OPS["Mod"].types and "INT64" in OPS["Range"].types and "BOOL" in OPS["Where"].types
    assert not OPS["Unique"].supported and OPS["Unique"].types == ()
    assert OPS["TensorScatter"].since_opset == 24 and OPS["TensorScatter"].trt_minor == 15
    assert all(s.since_opset >= 1 for s in OPS.values())


def test_trt_compat_on_tiny_matches_real_graphs(engine_dir, capsys):
    """The tiny build has the real build's op set, so it gets the same verdict and the same kinds of
    findings, except the one that depends on the vocabulary size (top-p's TopK over V = 256 < 3840)."""
    code, out, _ = _run(capsys, engine_dir, "--trt-compat", "--json")
    trt = json.loads(out)["trt_compat"]
    assert code == 0 and trt["verdict"] == "supported" and trt["counts"]["blocking"] == 0
    got = {(f["graph"], f["op"], f["rule"], f["severity"], f["fallback"]) for f in trt["findings"]}
    assert got == {k for k in REAL_FINDINGS if k[2] not in SIZE_DEPENDENT}
    assert {p["op"] for p in trt["plugin_nodes"]} == {"dspark::MarkovDraft", "dspark::SpeculativeVerify"}
    assert set(trt["opsets"].values()) == {21}
    code, text, _ = _run(capsys, engine_dir, "--trt-compat")
    assert code == 0 and "would not parse (0)" in text and "CumSum" in text and "verdict: supported" in text


def test_trt_compat_verify_at_real_vocab_warns_of_a_run_time_k(engine_dir):
    """Bind the tiny verify graph's symbolic V to the real vocabulary. Its top-p sorts rows padded to a multiple
    of 16 values, a width computed at run time, so the lint cannot fold K and warns that TensorRT rejects K >=
    3840 at run time (the op runs as the dspark::SpeculativeVerify plugin under TensorRT either way)."""
    model = onnx.load(str(engine_dir / "graphs" / "verify.onnx"), load_external_data=False)
    findings = check_model(model, "verify", dims={"V": 49152})
    got = {("verify", f.op, f.rule, f.severity, f.fallback) for f in findings}
    assert got == {k for k in REAL_FINDINGS if k[0] == "verify"}


def test_unsupported_engine_graph_exits_1(copy_dir, capsys):
    """A graph with an op TensorRT lacks makes `--trt-compat` exit 1 and name the node."""
    from dspark_export.engines.manifest import Manifest

    m = Manifest.load(copy_dir)
    model = onnx.load(str(copy_dir / "graphs" / "drafter_context.onnx"), load_external_data=False)
    out = model.graph.output[0].name
    model.graph.node.append(helper.make_node("Unique", [out], ["uniq"], name="sneaky_unique"))
    model.graph.output.append(_vi("uniq", TensorProto.FLOAT, None))
    # re-sealed like `profile` re-seals sps.json; the weights stay in the untouched external data file
    m.replace_file("graphs/drafter_context.onnx", model.SerializeToString())
    code, text, err = _run(capsys, copy_dir, "--trt-compat")
    assert code == 1 and err == ""
    assert "would not parse (1)" in text and "sneaky_unique" in text and "verdict: unsupported" in text
    report = inspect_engine_dir(copy_dir, trt_compat=True)
    assert [(f.graph, f.node, f.op) for f in report.blocking] == [("drafter_context", "sneaky_unique", "Unique")]
    assert report.exit_code == 1 and report.summary["integrity"]["verified"] is True


def _rewrite_profile(root, change) -> None:
    """Edit profile/sps.json with `change(data)` and re-list it in the manifest (size and sha256), as a user
    who hand-edits a profile and fixes the manifest would."""
    import hashlib

    path = root / "profile" / "sps.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    manifest = json.loads((root / "manifest.json").read_text())
    blob = path.read_bytes()
    manifest["files"]["profile/sps.json"].update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    (root / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(attention=[1, 2]), "'attention' must be an object"),
    (lambda d: d["attention"].update(ms_per_row_entry="0.1"), "attention.ms_per_row_entry: .* found '0.1'"),
    (lambda d: d["attention"].update(ms_per_slot_entry=-1), "attention.ms_per_slot_entry: .* found -1"),
    (lambda d: d["target"][1].update(Q=0), "target row B=2: 'Q' must be an integer ≥ 1"),
])
def test_a_malformed_layout_fit_is_named_not_a_crash(copy_dir, capsys, change, match):
    """inspect, report and generate name sps.json and the field of a bad layout-cost fit (exit 2)."""
    import re

    _rewrite_profile(copy_dir, change)
    code, out, err = _run(capsys, copy_dir)
    assert code == 2 and "internal error" not in err and re.search(match, err), err
    assert str(copy_dir / "profile" / "sps.json") in err
    assert cli_main(["report", str(copy_dir)]) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err and re.search(match, err), err
    assert cli_main(["generate", "--engine-dir", str(copy_dir), "--policy", "dspark-async", "--prompt", "hello",
                     "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and "profile/sps.json" in err, err


def test_a_fit_without_its_optional_fields_still_shows(copy_dir, capsys):
    def change(d):
        d["attention"].pop("max_error_pct")
        d["attention"]["layouts"] = {}
    _rewrite_profile(copy_dir, change)
    code, out, err = _run(capsys, copy_dir)
    assert code == 0 and "largest error ? % on 0 layouts" in out, out + err
