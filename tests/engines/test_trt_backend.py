"""The TensorRT backend without TensorRT: optimization profiles (every bucket, consistent shapes, and every feed
the runtime really makes lies inside them), backend selection, the `trt` commands' refusals; and with TensorRT
and a GPU, the real build, comparison and generation (skipped here, with the reason)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from dspark_export.cli import main as cli_main
from dspark_export.engines.engine_set import EngineSet, _backend_view
from dspark_export.engines.manifest import Manifest
from dspark_export.engines.ort.runner import OrtRunner
from dspark_export.engines.profiler import engine_feed
from dspark_export.engines.trt import has_tensorrt, tensorrt_unavailable_reason
from dspark_export.engines.trt.builder import plan_build
from dspark_export.engines.trt.profiles import POINTS, ShapeProfile, check_profile, eval_dim, profile_for
from dspark_export.errors import BuildError, EngineDirError, ProfileError

BUCKETS = dict(target_buckets=(1, 2, 4, 8, 16), request_buckets=(1, 2, 4), max_context=64,
               profile_context=16, profile_repeats=2, block_size=4, markov_rank=8)
CONTEXT = 16
needs_tensorrt = pytest.mark.skipif(
    not has_tensorrt(), reason=f"TensorRT is not installed here ({tensorrt_unavailable_reason()}); building and "
                               "running TensorRT engines needs TensorRT >= 10.9 and a GPU (scripts/gpu_check.sh)")


@pytest.fixture(scope="module")
def engine_dir(build_tiny_engine_dir):
    return build_tiny_engine_dir("trt_backend", **BUCKETS)


@pytest.fixture(scope="module")
def plan(engine_dir):
    return plan_build(Manifest.load(engine_dir), CONTEXT)


def _declared(model):
    inits = {t.name for t in model.graph.initializer}
    return {vi.name: tuple(d.dim_value if d.HasField("dim_value") else d.dim_param
                           for d in vi.type.tensor_type.shape.dim)
            for vi in model.graph.input if vi.name not in inits}


def test_every_bucket_gets_a_consistent_profile(engine_dir, plan):
    manifest = Manifest.load(engine_dir)
    for graph, item in plan["graphs"].items():
        buckets = sorted(k.bucket for k in manifest.engine_keys(graph) if k.backend == "onnxruntime")
        assert [p.bucket for p in item["profiles"]] == buckets
        declared = _declared(item["model"])
        for profile in item["profiles"]:
            assert check_profile(profile, declared) == []
            assert set(profile.shapes["min"]) == set(declared)  # every input has min/opt/max
            for p in POINTS:
                assert profile.values[p][profile.dim] == profile.bucket
    target = plan["graphs"]["target"]["profiles"][-1]  # N = 16
    assert target.values["max"] | {} == {"N": 16, "R": 4, "Q": 16, "M": 16, "P": 128, "V": 256, "key_len": 144}   # P: aligned(64 + 16)
    assert target.values["opt"]["P"] == 128 and target.values["opt"]["R"] == 4  # aligned(CONTEXT + 5); ceil(16 / 5)
    for p in POINTS:  # batch identical across inputs, query_start one longer, key length = past + query
        s = target.shapes[p]
        assert s["query_start"][0] == s["cache_lens"][0] + 1 == s["pad_index"][0] + 1 == s["past_key.0"][0] + 1
        assert s["past_key.0"][2] == s["past_value.3"][2] == target.values[p]["P"]
        assert target.values[p]["key_len"] == target.values[p]["P"] + s["pad_index"][1]
    verify = plan["graphs"]["verify"]["profiles"][1]  # R = 2
    assert [verify.shapes[p]["target_logits"][0] for p in POINTS] == [2, 10, 10]


def test_check_profile_finds_inconsistent_shapes(plan):
    good = plan["graphs"]["target"]["profiles"][2]
    declared = _declared(plan["graphs"]["target"]["model"])
    shapes = {p: dict(v) for p, v in good.shapes.items()}
    shapes["opt"]["cache_lens"] = (good.shapes["max"]["cache_lens"][0] + 1,)  # R disagrees, and opt > max
    shapes["max"]["input_ids"] = (good.bucket * 2,)                        # N is not the bucket
    bad = ShapeProfile(good.graph, good.dim, good.bucket, good.values, shapes)
    problems = check_profile(bad, declared)
    assert any("opt: R is" in p and "cache_lens" in p for p in problems), problems
    assert any("max: N is" in p and "bucket" in p for p in problems), problems
    assert any("cache_lens" in p and "does not hold" in p for p in problems), problems


def test_eval_dim():
    assert eval_dim("R+1", {"R": 3}) == eval_dim("R_plus_1", {"R": 3}) == 4 and eval_dim(7, {}) == 7
    with pytest.raises(BuildError, match="no value for 'Q'"):
        eval_dim("Q", {"R": 1})


def test_unknown_letter_and_bad_context_are_refused(engine_dir):
    manifest = Manifest.load(engine_dir)
    model = onnx.load(str(manifest.graph_path("verify")), load_external_data=False)
    with pytest.raises(BuildError, match="no value for 'V'"):  # the verify graph's V must be given
        profile_for(model, "verify", 2, block_size=4, max_context=64, max_requests=4)
    with pytest.raises(ProfileError, match="context_len"):
        plan_build(manifest, 60)


def test_runtime_feeds_lie_inside_the_profiles(engine_dir, plan, monkeypatch):
    """Every feed the ONNX Runtime runtime makes (prefill chunks, ragged verification, several slots) fits the
    TensorRT profile of the engine it went to: same letters across inputs, each size within min..max. The feeds
    are padded to their bucket, as for a TensorRT engine (`EngineRunner.padded_rows`; ONNX Runtime's shared sessions
    run a feed's own row count)."""
    from dspark_export.engines.runner import EngineRunner
    from dspark_export.runtime.api import Runtime
    from dspark_export.runtime.request import SamplingParams

    profiles = {(g, p.bucket): p for g, item in plan["graphs"].items() for p in item["profiles"]}
    declared = {g: _declared(item["model"]) for g, item in plan["graphs"].items()}
    seen: dict[tuple[str, int], int] = {}
    original = OrtRunner.infer

    def recording(self, feed):
        profile = profiles[(self.key.graph, self.key.bucket)]
        for name, arr in feed.items():
            lo, hi = profile.shapes["min"][name], profile.shapes["max"][name]
            assert all(a <= s <= b for a, s, b in zip(lo, arr.shape, hi)), (self.key.path, name, arr.shape, lo, hi)
        point = ShapeProfile(profile.graph, profile.dim, profile.bucket, profile.values,
                             {p: {k: tuple(v.shape) for k, v in feed.items()} for p in POINTS})
        assert check_profile(point, declared[self.key.graph]) == [], self.key.path
        seen[(self.key.graph, self.key.bucket)] = seen.get((self.key.graph, self.key.bucket), 0) + 1
        return original(self, feed)

    monkeypatch.setattr(OrtRunner, "infer", recording)
    monkeypatch.setattr(OrtRunner, "padded_rows", EngineRunner.padded_rows)
    rt = Runtime.open(engine_dir, policy="fixed:4")
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 20)]
    params = [SamplingParams(max_new_tokens=9, temperature=t, seed=1) for t in (0.0, 0.8, 0.0)]
    results = rt.generate_ids(prompts, params)
    assert all(r.finish_reason != "error" for r in results), [r.error for r in results]
    assert {g for g, _ in seen} == {"target", "drafter_context", "drafter_block", "verify"}
    assert len(seen) >= 6, seen  # several buckets were exercised


def test_engine_feeds_lie_inside_the_profiles(engine_dir, plan):
    """The feeds the profiler and `trt compare` send (engine_feed) fit every bucket's profile."""
    graphs = Manifest.load(engine_dir).data["graphs"]
    for graph, item in plan["graphs"].items():
        for profile in item["profiles"]:
            feed = engine_feed(graphs, graph, profile.bucket, CONTEXT)
            assert set(feed) == set(profile.shapes["opt"])
            for name, arr in feed.items():
                lo, hi = profile.shapes["min"][name], profile.shapes["max"][name]
                assert all(a <= s <= b for a, s, b in zip(lo, arr.shape, hi)), (graph, profile.bucket, name)


def test_backend_selection(engine_dir):
    with pytest.raises(EngineDirError, match=r"no tensorrt engines .*dspark-export trt build"):
        EngineSet.open(engine_dir, backend="tensorrt")
    with pytest.raises(EngineDirError, match="backend: expected one of"):
        EngineSet.open(engine_dir, backend="cuda")
    manifest = Manifest.load(engine_dir)
    view = _backend_view(manifest, "tensorrt")
    assert "profile" not in view.data and manifest.data["profile"]["path"] == "profile/sps.json"
    manifest.data["backends"] = {"tensorrt": {"profile": {"path": "profile/tensorrt/sps.json"}}}
    assert _backend_view(manifest, "tensorrt").data["profile"] == {"path": "profile/tensorrt/sps.json"}
    assert EngineSet.open(engine_dir).device_info()["backend"] == "onnxruntime"


def test_trt_plan_command(engine_dir, capsys):
    assert cli_main(["trt", "plan", "--engine-dir", str(engine_dir), "--context", str(CONTEXT)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["graphs"]) == {"target", "drafter_context", "drafter_block", "verify"}
    assert [p["bucket"] for p in out["graphs"]["target"]["profiles"]] == [1, 2, 4, 8, 16]
    assert out["graphs"]["verify"]["lowering"]["dropped_functions"] == ["dspark::SpeculativeVerify"]


@pytest.mark.skipif(has_tensorrt(), reason="TensorRT is installed here; the refusal path cannot be exercised")
@pytest.mark.parametrize("command", ["build", "compare"])
def test_trt_commands_without_tensorrt_say_why(engine_dir, capsys, command):
    assert cli_main(["trt", command, "--engine-dir", str(engine_dir)]) == 2
    err = capsys.readouterr().err
    assert "needs TensorRT >= 10.9" in err and "cannot import tensorrt" in err
    assert not (engine_dir / "engines" / "tensorrt").exists()  # nothing was written


# -- with TensorRT and a GPU --------------------------------------------------------------------------------

@needs_tensorrt
def test_build_compare_and_generate_with_tensorrt(engine_dir, tmp_path):
    """Build TensorRT engines into a copy, compare them with ONNX Runtime, then greedy generation on TensorRT is
    token-identical to ONNX Runtime's and the directory still passes its integrity check."""
    import shutil

    from dspark_export.engines.inspect import inspect_engine_dir
    from dspark_export.engines.trt.builder import TrtBuildConfig, build_trt_engines
    from dspark_export.engines.trt.compare import compare_backends
    from dspark_export.runtime.api import Runtime
    from dspark_export.runtime.request import SamplingParams

    work = tmp_path / "dir"
    shutil.copytree(engine_dir, work)
    for p in [work, *work.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    sps = build_trt_engines(TrtBuildConfig(work, context_len=CONTEXT, repeats=3))
    assert [row["B"] for row in sps["target"]] == [1, 2, 4, 8, 16] and sps["device"]["backend"] == "tensorrt"
    result = compare_backends(work, atol=1e-3, rtol=1e-3)
    assert result["passed"], result
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 20)]
    params = [SamplingParams(max_new_tokens=12)] * 3
    ort = Runtime.open(work, policy="fixed:4").generate_ids(prompts, params)
    trt = Runtime.open(work, policy="fixed:4", backend="tensorrt").generate_ids(prompts, params)
    assert [r.token_ids for r in trt] == [r.token_ids for r in ort]
    report = inspect_engine_dir(work)
    assert report.summary["engines"]["target@tensorrt"]["buckets"] == [1, 2, 4, 8, 16]
    assert np.isfinite([row["sps"] for row in sps["target"]]).all()


def test_compare_runners_verdict_and_errors():
    """The Polygraphy comparison `trt compare` uses, on two ONNX Runtime sessions that differ by 0.01."""
    pytest.importorskip("polygraphy", reason="polygraphy is in the test extra (pip install 'dspark-export[test]')")
    from onnx import TensorProto, helper
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    from dspark_export.engines.trt.compare import compare_runners

    def model(delta):
        graph = helper.make_graph(
            [helper.make_node("Add", ["x", "d"], ["y"]), helper.make_node("ArgMax", ["y"], ["i"], axis=1)], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", 5])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["R", 5]),
             helper.make_tensor_value_info("i", TensorProto.INT64, ["R", 1])],
            initializer=[helper.make_tensor("d", TensorProto.FLOAT, [1], [delta])])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()

    feed = {"x": np.arange(10, dtype=np.float32).reshape(2, 5)}
    a, b = OnnxrtRunner(SessionFromOnnx(model(0.0)), name="a"), OnnxrtRunner(SessionFromOnnx(model(0.01)), name="b")
    passed, outputs = compare_runners([a, b], feed, atol=1e-3, rtol=1e-4)
    assert not passed and outputs["y"]["max_abs"] == pytest.approx(0.01, abs=1e-6) and outputs["i"]["max_abs"] == 0
    passed, _ = compare_runners([a, b], feed, atol=0.1, rtol=0.0)
    assert passed


def _fake_aot_plugin_module() -> dict:
    return {name: object() for name in ("aot_impl", "KernelLaunchParams", "SymInt32")}


def test_build_passes_no_flags_to_the_onnx_parser(engine_dir, tmp_path, fake_tensorrt, monkeypatch):
    """At the Polygraphy boundary: the builder asks for a strongly typed network and passes nothing through
    `NetworkFromOnnxPath(flags=...)` (those are OnnxParserFlags; a network creation flag there would switch on an
    unrelated parser flag); the AOT implementation is chosen by each plugin node's `aot` = 1 in the lowered graph.
    The fake engine build then fails, and the written files are removed (the directory stays valid)."""
    import shutil
    import sys
    import types

    from dspark_export.engines.inspect import inspect_engine_dir
    from dspark_export.engines.trt.builder import TrtBuildConfig, build_trt_engines
    from dspark_export.plugins import tensorrt_plugins

    work = tmp_path / "dir"
    shutil.copytree(engine_dir, work)
    for p in [work, *work.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    fake_tensorrt(version="10.16.0.1", plugin=_fake_aot_plugin_module())
    calls = []

    class NetworkFromOnnxPath:
        def __init__(self, path, *args, **kwargs):
            calls.append((path, args, kwargs))
            self.path = path

    def engine_bytes(network, config):
        def build():
            raise RuntimeError("fake TensorRT: no engine")
        return build

    Profile = pytest.importorskip("polygraphy.backend.trt").Profile  # the real one: it needs no TensorRT
    polygraphy_trt = types.ModuleType("polygraphy.backend.trt")
    polygraphy_trt.Profile = Profile
    polygraphy_trt.NetworkFromOnnxPath = NetworkFromOnnxPath
    polygraphy_trt.CreateConfig = lambda **kwargs: kwargs
    polygraphy_trt.EngineBytesFromNetwork = engine_bytes
    monkeypatch.setitem(sys.modules, "polygraphy.backend.trt", polygraphy_trt)
    monkeypatch.setattr(tensorrt_plugins, "register_plugins", lambda *a: ("dspark::MarkovDraft",))
    monkeypatch.setattr(tensorrt_plugins, "device_capability", lambda: 90)

    with pytest.raises(BuildError, match="TensorRT engine build failed .*fake TensorRT: no engine"):
        build_trt_engines(TrtBuildConfig(work, context_len=CONTEXT, repeats=1))
    [(path, args, kwargs)] = calls
    assert path.endswith("graphs/target.trt.onnx") and args == ()
    assert kwargs == {"strongly_typed": True}  # no `flags`, no network creation flag
    # what picks the AOT implementation instead: `aot` = 1 on every plugin node of the lowered graphs
    lowered = plan_build(Manifest.load(work), CONTEXT)["graphs"]["verify"]["model"]
    nodes = [n for n in lowered.graph.node if n.domain == "dspark"]
    assert nodes and all(onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "aot")) == 1
                         for n in nodes)
    inspect_engine_dir(work)  # nothing written is left behind
    assert not (work / "graphs" / "target.trt.onnx").exists()


def test_build_without_a_known_compute_capability_writes_nothing(engine_dir, tmp_path, fake_tensorrt, monkeypatch):
    import shutil

    from dspark_export.engines.trt.builder import TrtBuildConfig, build_trt_engines
    from dspark_export.plugins import tensorrt_plugins

    work = tmp_path / "dir"
    shutil.copytree(engine_dir, work)
    for p in [work, *work.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    fake_tensorrt(version="10.16.0.1", plugin=_fake_aot_plugin_module())

    def unknown():
        raise BuildError("the GPU's compute capability could not be determined (fake)")

    monkeypatch.setattr(tensorrt_plugins, "device_capability", unknown)
    monkeypatch.setattr(tensorrt_plugins, "register_plugins", lambda *a: pytest.fail("registered"))
    with pytest.raises(BuildError, match="compute capability could not be determined"):
        build_trt_engines(TrtBuildConfig(work, context_len=CONTEXT, repeats=1))
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == sorted(
        p.relative_to(engine_dir) for p in engine_dir.rglob("*"))


def test_trt_runner_returns_arrays_it_owns():
    """Polygraphy's TrtRunner reuses its output buffers between calls; TrtEngineRunner.infer returns copies,
    so a result stays as it was after the next call (as OrtRunner's fresh arrays do)."""
    from dspark_export.engines.manifest import EngineKey
    from dspark_export.engines.trt.runner import PlanStore, TrtEngineRunner

    class ReusingRunner:  # what Polygraphy does: one host buffer per output, overwritten by each call
        def __init__(self):
            self.buffer = np.zeros(3, np.float32)

        def infer(self, feed, check_inputs=True):
            self.buffer[:] = feed["x"]
            return {"y": self.buffer}

    runner = TrtEngineRunner("unused.plan", 0, EngineKey("verify", "tensorrt", "R", 1), PlanStore())
    runner._runner, runner._meta = ReusingRunner(), {"x": (np.float32, 1)}
    first = runner.infer({"x": np.ones(3, np.float32)})
    second = runner.infer({"x": np.full(3, 2.0, np.float32)})
    assert first["y"].tolist() == [1.0, 1.0, 1.0] and second["y"].tolist() == [2.0, 2.0, 2.0]
    assert first["y"].flags.owndata and first["y"].flags.writeable


def test_dropping_tensorrt_entries_leaves_a_valid_directory(engine_dir, tmp_path):
    """The overwrite path's bookkeeping: TensorRT entries and files go, the ONNX Runtime directory stays intact.
    (The 'plan' written here is bytes for the bookkeeping only; nothing loads it.)"""
    import shutil

    from dspark_export.engines.inspect import inspect_engine_dir
    from dspark_export.engines.manifest import EngineKey, write_json_atomic
    from dspark_export.engines.trt.builder import TRT_DIR, _drop_tensorrt

    work = tmp_path / "dir"
    shutil.copytree(engine_dir, work)
    for p in [work, *work.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    manifest = Manifest.load(work)
    key = EngineKey("verify", "tensorrt", "R", 1)
    (work / TRT_DIR).mkdir(parents=True)
    (work / TRT_DIR / "verify.plan").write_bytes(b"bookkeeping only")
    write_json_atomic(work / key.path, {"key": key.to_dict(), "plan": f"{TRT_DIR}/verify.plan", "profile_index": 0})
    shutil.copy(work / "graphs" / "verify.onnx", work / "graphs" / "verify.trt.onnx")
    manifest.data["engines"].append({"key": key.to_dict(), "path": key.path})
    manifest.data["backends"] = {"tensorrt": {"gpu": None}}
    manifest.record_files([key.path, f"{TRT_DIR}/verify.plan", "graphs/verify.trt.onnx"])
    manifest.save()
    assert inspect_engine_dir(work).summary["engines"]["verify@tensorrt"]["buckets"] == [1]
    _drop_tensorrt(Manifest.load(work))
    report = inspect_engine_dir(work)  # verifies sizes, hashes and that no file is unlisted
    assert "verify@tensorrt" not in report.summary["engines"] and not list((work / TRT_DIR).glob("*"))
    assert not (work / "graphs" / "verify.trt.onnx").exists()
    assert Manifest.load(work).data.get("backends", {}) == {}


def test_engine_feeds_run_on_every_onnxruntime_engine(engine_dir):
    """The feeds `trt compare` sends are valid inputs (dtypes, ranks) for every engine: ORT runs them all."""
    engines = EngineSet.open(engine_dir, verify=False)
    graphs = engines.manifest.data["graphs"]
    for key in engines.manifest.engine_keys():
        out = engines.runner_exact(key.graph, key.bucket).infer(engine_feed(graphs, key.graph, key.bucket, 16))
        assert all(np.all(np.isfinite(v)) for v in out.values() if v.dtype == np.float32), key
