"""`dspark-export export-profile`: SGLang / TensorRT-LLM / generic files reproduce the runtime's SPS(B) staircase."""

from __future__ import annotations

import bisect
import csv
import json

import numpy as np
import pytest

from dspark_export.cli import main as cli_main
from dspark_export.engines.export_profile import (_sglang_additive, _sglang_sps, _trtllm_cost, draft_staircase,
                                                  sps_staircase)
from dspark_export.errors import ProfileError
from dspark_export.engines.sps import ThroughputProfile

BUCKETS = dict(target_buckets=(1, 2, 4, 8), request_buckets=(1, 2), max_context=64, profile_context=16,
               profile_repeats=2, block_size=4, markov_rank=8)

#: a measured staircase with a dip: B=4 ran faster than B=2, so 2-token steps use the B=4 engine
ROWS = [{"B": 1, "median_ms": 10.0}, {"B": 2, "median_ms": 30.0}, {"B": 4, "median_ms": 20.0},
        {"B": 8, "median_ms": 40.0}, {"B": 16, "median_ms": 80.0}]


def _runtime_sps(rows, b):
    return ThroughputProfile.from_json({"target": [{"B": r["B"], "sps": 1000 / r["median_ms"]} for r in rows]}).sps(b)


def test_staircase_follows_the_runtime():
    stairs = sps_staircase(ROWS)
    assert [s["served_by"] for s in stairs] == [1, 4, 4, 8, 16]
    for s in stairs:
        assert s["sps"] == pytest.approx(_runtime_sps(ROWS, s["B"]))
    with pytest.raises(ProfileError):
        sps_staircase([{"B": 1, "median_ms": 0.0}])
    with pytest.raises(ProfileError):
        sps_staircase([{"B": "x"}])


def test_sglang_floor_lookup_equals_runtime_sps_for_every_b():
    table = _sglang_sps(sps_staircase(ROWS))
    probes, values = table["sample_batch_tokens"], table["sample_steps_per_sec"]
    assert probes == sorted(set(probes)) and table["max_batch_tokens"] == 16 and probes[0] == 1
    for b in range(1, 17):  # SGLang: the largest probe <= B, clamped
        idx = max(0, min(bisect.bisect_right(probes, b) - 1, len(probes) - 1))
        assert values[idx] == pytest.approx(_runtime_sps(ROWS, b), rel=1e-6), b


def test_trtllm_interpolated_cost_equals_runtime_latency_for_every_b():
    table = _trtllm_cost(sps_staircase(ROWS))
    counts, times = table["token_counts"], table["step_time_ms"]
    assert counts == sorted(set(counts)) and all(t > 0 for t in times)
    for b in range(1, 17):  # TensorRT-LLM: clamped linear interpolation over total verified tokens
        assert 1000 / float(np.interp(b, counts, times)) == pytest.approx(_runtime_sps(ROWS, b), rel=1e-6), b


@pytest.fixture(scope="module")
def engine_dir(build_tiny_engine_dir):
    return build_tiny_engine_dir("export", **BUCKETS)


@pytest.mark.parametrize("fmt, names", [("sglang", {"sglang_sps_table.json", "sglang_sps_additive.json",
                                                   "sglang_sts.json"}),
                                        ("trtllm", {"trtllm_sps_table.json", "trtllm_sts.json",
                                                    "trtllm_speculative_config.yaml"}),
                                        ("generic", {"dspark_profile.json", "dspark_profile.csv"})])
def test_cli_writes_each_format(engine_dir, tmp_path, capsys, fmt, names):
    out = tmp_path / fmt
    assert cli_main(["export-profile", str(engine_dir), "--format", fmt, "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {p.name for p in out.iterdir()} == names and result["format"] == fmt
    sps = json.loads((engine_dir / "profile" / "sps.json").read_text())
    if fmt == "sglang":
        sts = json.loads((out / "sglang_sts.json").read_text())
        assert sts["temperatures"] == [1.0] * 4 and set(result["flags"]) == {
            "--speculative-dspark-sps-table-path", "--speculative-dspark-confidence-sts-path"}
        assert any("uncalibrated" in n for n in result["notes"])
    elif fmt == "trtllm":
        assert json.loads((out / "trtllm_sts.json").read_text())["sts_temperatures"] == [1.0] * 4
        cost = json.loads((out / "trtllm_sps_table.json").read_text())
        assert cost["token_counts"][-1] == 8
        assert set(result["flags"]) == {"confidence_sps_table_path", "confidence_sts_path", "config"}
    else:
        rows = list(csv.DictReader((out / "dspark_profile.csv").open()))
        assert [int(r["B"]) for r in rows] == [1, 2, 4, 8]
        assert [float(r["median_ms"]) for r in rows] == [r["median_ms"] for r in sps["target"]]


def test_vllm_and_missing_profile_are_one_line_errors(engine_dir, tmp_path, capsys):
    code = cli_main(["export-profile", str(engine_dir), "--format", "vllm", "--out", str(tmp_path / "v")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN" in err
    assert not (tmp_path / "v").exists()
    code = cli_main(["export-profile", str(tmp_path / "nowhere"), "--format", "sglang", "--out", str(tmp_path / "s")])
    assert code == 2 and capsys.readouterr().err.count("\n") == 1


@pytest.fixture(scope="module")
def calibrated_dir(tiny_target_dir, tmp_path_factory):
    """A tiny engine directory whose drafter's calibration.json holds a temperature + bias fit (biases != 0) and
    the temperature-only fit of the same synthetic rounds (`fit_calibration`)."""
    import torch

    from dspark_export.modeling.checkpoint import save_drafter
    from dspark_export.modeling.config import DrafterConfig
    from dspark_export.modeling.drafter import init_drafter
    from dspark_export.modeling.target import load_target
    from dspark_export.pipeline import BuildConfig, build_engine_dir
    from dspark_export.training.calibration import Rounds, fit_calibration

    rng = np.random.default_rng(3)
    z = rng.normal(0.0, 2.0, size=(6000, 4))
    rounds = Rounds(z.astype(np.float32), rng.random((6000, 4)) < 1 / (1 + np.exp(-(z / 2 + 0.8))),
                    np.ones((6000, 4), bool), ["x"] * 6000)
    fit = fit_calibration(rounds)
    assert any(fit["confidence_bias"])
    tmp = tmp_path_factory.mktemp("export-cal")
    target = load_target(tiny_target_dir)
    drafter = init_drafter(target, DrafterConfig.from_target(target.config, block_size=4, markov_rank=8))
    ckpt = save_drafter(drafter, tmp / "drafter", include_embeddings=False, dtype=torch.float16)
    (ckpt / "calibration.json").write_text(json.dumps({"method": "sts", **fit, "fitted_on": "synthetic rounds"}))
    out = tmp / "eng"
    build_engine_dir(BuildConfig(out=out, target=str(tiny_target_dir), drafter=str(ckpt), **BUCKETS))
    return out, fit


def test_consumers_get_the_temperature_only_fit_and_its_own_ece(calibrated_dir, tmp_path):
    """SGLang and TensorRT-LLM compute σ(z/T): the files carry the temperature-only fit and the ECE measured
    for it, never the biased fit's temperatures or ECE; the generic file keeps both fits."""
    from dspark_export.engines.export_profile import export_profile

    engine_dir, fit = calibrated_dir
    plain = fit["temperature_only"]
    assert plain["confidence_temperature"] != fit["confidence_temperature"]
    res = export_profile(engine_dir, "sglang", tmp_path / "s")
    sts = json.loads((tmp_path / "s" / "sglang_sts.json").read_text())
    assert sts["temperatures"] == plain["confidence_temperature"]
    assert sts["ece_after"] == plain["ece_after"] and sts["ece_before"] == plain["ece_before"]
    assert sts["num_samples"] == 6000 and any("sigmoid(z/T)" in n for n in res["notes"])
    export_profile(engine_dir, "generic", tmp_path / "g")
    gen = json.loads((tmp_path / "g" / "dspark_profile.json").read_text())
    assert gen["confidence_temperature"] == fit["confidence_temperature"]
    assert gen["confidence_bias"] == fit["confidence_bias"]
    assert gen["temperature_only"]["temperatures"] == plain["confidence_temperature"]


def test_a_biased_calibration_without_a_temperature_only_fit_is_refused(calibrated_dir, tmp_path):
    import shutil

    from dspark_export.engines.export_profile import export_profile
    from dspark_export.engines.manifest import Manifest
    from dspark_export.errors import ConfigError

    src, fit = calibrated_dir
    engine_dir = tmp_path / "copy"
    shutil.copytree(src, engine_dir)
    for p in [engine_dir, *engine_dir.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    old = {k: v for k, v in fit.items() if k != "temperature_only"}
    Manifest.load(engine_dir).replace_file("drafter/calibration.json", json.dumps(old).encode())
    with pytest.raises(ConfigError, match=r"calibration.json: temperature_only: no temperature-only STS fit"):
        export_profile(engine_dir, "sglang", tmp_path / "s")
    assert not (tmp_path / "s").exists()
    with pytest.raises(ConfigError, match="temperature_only"):
        export_profile(engine_dir, "trtllm", tmp_path / "t")
    export_profile(engine_dir, "generic", tmp_path / "g")      # our own file keeps the engine's fit, says none
    gen = json.loads((tmp_path / "g" / "dspark_profile.json").read_text())
    assert gen["confidence_bias"] == fit["confidence_bias"] and gen["temperature_only"]["temperatures"] is None


# -- schema: the fields each consumer's own loader reads (SGLang dspark_sps.py / dspark_sts.py, msgspec structs;
# TensorRT-LLM dspark_planner.py legacy table loader / dspark_sts.py), checked on the written files ---------------

DRAFTS = [{"R": 1, "median_ms": 5.0}, {"R": 2, "median_ms": 6.0}, {"R": 4, "median_ms": 9.0}]


def _ints(v):
    return isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _floats(v):
    return isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x)
                                       for x in v)


def _increasing(v):
    return all(b > a for a, b in zip(v, v[1:]))


def _check_sglang_sps(path):
    text = path.read_text()
    t = json.loads(text)
    assert '"bias_seconds"' not in text        # SGLang picks the additive struct by this substring
    assert _ints(t["sample_batch_tokens"]) and _increasing(t["sample_batch_tokens"])
    assert _floats(t["sample_steps_per_sec"]) and len(t["sample_steps_per_sec"]) == len(t["sample_batch_tokens"])
    assert isinstance(t["max_batch_tokens"], int) and t["max_batch_tokens"] >= t["sample_batch_tokens"][-1]
    return t


def _check_sglang_additive(path):
    text = path.read_text()
    t = json.loads(text)
    assert '"bias_seconds"' in text and isinstance(t["bias_seconds"], float) and t["bias_seconds"] > 0
    for probes, values in (("bs_probes", "alpha_seconds"), ("m_probes", "theta_seconds")):
        assert _ints(t[probes]) and _increasing(t[probes]) and _floats(t[values]) and len(t[values]) == len(t[probes])
    return t


def _check_sglang_sts(path, gamma):
    t = json.loads(path.read_text())
    assert _floats(t["temperatures"]) and len(t["temperatures"]) == gamma and min(t["temperatures"]) > 0
    assert isinstance(t["dataset"], str) and isinstance(t["num_samples"], int)
    for k in ("ece_before", "ece_after"):       # list[float] when present (msgspec rejects null)
        assert k not in t or (_floats(t[k]) and len(t[k]) == gamma)
    return t


TRT_V2_MARKERS = {"cost_tables", "engine_fingerprint", "engine_fingerprint_sha256", "measurements", "schema_version"}


def _check_trtllm_table(path):
    t = json.loads(path.read_text())
    assert not TRT_V2_MARKERS & set(t)         # any of them routes the file to the exact schema-v2 loader
    assert _ints(t["token_counts"]) and _increasing(t["token_counts"])
    assert _floats(t["step_time_ms"]) and min(t["step_time_ms"]) > 0 and len(t["step_time_ms"]) == len(t["token_counts"])
    assert isinstance(t["fixed_overhead_ms"], float) and t["fixed_overhead_ms"] >= 0
    assert t["batch_sizes"] == [] or (_ints(t["batch_sizes"]) and _increasing(t["batch_sizes"]))
    assert _floats(t["batch_overhead_ms"]) and len(t["batch_overhead_ms"]) == len(t["batch_sizes"])
    assert min(t["batch_overhead_ms"], default=0) >= 0 and t["minimum_predicted_gain"] >= 0
    assert t["_meta"]["lookup"] == "interp"
    engine = t["_meta"]["engine"]
    assert {"tp", "ep", "attention_dp", "block", "max_batch_size"} <= set(engine)
    return t


def _sglang_step_seconds(t, num_requests, m):
    """SGLang's additive model as its planner evaluates it: bias + α(R) + θ(m), clamped interpolation."""
    return (t["bias_seconds"] + float(np.interp(num_requests, t["bs_probes"], t["alpha_seconds"]))
            + float(np.interp(m, t["m_probes"], t["theta_seconds"])))


def _trtllm_step_ms(t, num_requests, tokens):
    return (float(np.interp(tokens, t["token_counts"], t["step_time_ms"])) + t["fixed_overhead_ms"]
            + (float(np.interp(num_requests, t["batch_sizes"], t["batch_overhead_ms"])) if t["batch_sizes"] else 0))


def _runtime(rows, drafts):
    return ThroughputProfile.from_json({"target": [{"B": r["B"], "sps": 1000 / r["median_ms"]} for r in rows],
                                        "drafter_block": drafts})


def test_both_consumers_price_a_step_as_the_runtime_does_drafter_cost_included():
    """For every B the engines can run and every R: SGLang's additive step time and TensorRT-LLM's step cost
    equal the runtime's 1/SPS(B) + d(R) (d from the smallest drafter bucket >= R, the largest beyond it)."""
    stairs, drafts = sps_staircase(ROWS), draft_staircase(DRAFTS)
    add, trt = _sglang_additive(stairs, drafts), _trtllm_cost(stairs, drafts)
    runtime = _runtime(ROWS, DRAFTS)
    for r in range(1, 7):
        for b in range(r, 17):
            want = float(runtime.step_seconds([b])[0]) + runtime.draft_seconds(r)
            assert _sglang_step_seconds(add, r, b) == pytest.approx(want, rel=1e-9), (r, b)
            assert _trtllm_step_ms(trt, r, b) / 1000 == pytest.approx(want, rel=1e-9), (r, b)


def test_sglang_budget_with_the_additive_table_is_the_runtime_capacity():
    """SGLang's planner (global argmax of τ(k) / step_time(R, R + k)) admits as many drafts as the runtime's
    global capacity search with the drafter cost; the plain SPS table (no d(R)) admits more."""
    from dspark_export.runtime.scheduler import _sorted_candidates, search_capacity, survival_probs

    stairs, drafts = sps_staircase(ROWS), draft_staircase(DRAFTS)
    add, plain = _sglang_additive(stairs, drafts), _sglang_sps(stairs)
    runtime = _runtime(ROWS, DRAFTS)
    rng = np.random.default_rng(5)
    differs = 0
    for _ in range(40):
        R = int(rng.integers(1, 5))
        conf = rng.uniform(0.3, 1.0, size=(R, 4))
        a = survival_probs(conf)
        _, ranked = _sorted_candidates(a)
        ranked = ranked[: 16 - R]
        tau = R + np.concatenate(([0.0], np.cumsum(ranked)))
        k = np.arange(tau.size)
        sg = int(np.argmax(tau / np.array([_sglang_step_seconds(add, R, R + i) for i in k])))
        assert sg == search_capacity(ranked, R, runtime, early_stop=False)
        probes = plain["sample_batch_tokens"]
        floor = [plain["sample_steps_per_sec"][max(0, bisect.bisect_right(probes, R + i) - 1)] for i in k]
        differs += int(np.argmax(tau * np.array(floor))) != sg
    assert differs > 0        # the drafter cost changes decisions: the additive file is the one to use


@pytest.fixture(scope="module")
def profiled_dir(engine_dir, tmp_path_factory):
    """The tiny directory with a TensorRT profile recorded beside the ONNX Runtime one (the ONNX Runtime rows
    under another device label: what `trt build` writes, without a GPU)."""
    import shutil

    from dspark_export.engines.manifest import Manifest

    out = tmp_path_factory.mktemp("trtprof") / "tiny"
    shutil.copytree(engine_dir, out)
    for p in [out, *out.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    sps = json.loads((out / "profile" / "sps.json").read_text())
    sps["device"] = {"backend": "tensorrt", "providers": ["TensorRT"], "gpu": "test label"}
    (out / "profile" / "tensorrt").mkdir()
    (out / "profile" / "tensorrt" / "sps.json").write_text(json.dumps(sps))
    m = Manifest.load(out)
    m.data.setdefault("backends", {})["tensorrt"] = {"profile": {"path": "profile/tensorrt/sps.json"}}
    m.record_files(["profile/tensorrt/sps.json"])
    m.save()
    return out


def test_written_files_match_the_consumers_schemas(profiled_dir, tmp_path):
    from dspark_export.engines.export_profile import export_profile

    res = export_profile(profiled_dir, "sglang", tmp_path / "s")
    sps = json.loads((profiled_dir / "profile" / "sps.json").read_text())
    for sfx, backend in (("", "onnxruntime"), (".tensorrt", "tensorrt")):
        plain = _check_sglang_sps(tmp_path / "s" / f"sglang_sps_table{sfx}.json")
        add = _check_sglang_additive(tmp_path / "s" / f"sglang_sps_additive{sfx}.json")
        assert plain["_meta"]["measured_on"]["backend"] == backend == add["_meta"]["measured_on"]["backend"]
        assert plain["_meta"]["measured_on"]["target_weights"] == "fp32"
        assert plain["max_batch_tokens"] == 8
        assert res["flags_by_profile"][backend]["--speculative-dspark-sps-table-path"].endswith(
            f"sglang_sps_additive{sfx}.json")
        assert add["alpha_seconds"][-1] == pytest.approx(max(r["median_ms"] for r in sps["drafter_block"]
                                                             if r["R"] == max(x["R"] for x in sps["drafter_block"]))
                                                         / 1000)
    _check_sglang_sts(tmp_path / "s" / "sglang_sts.json", 4)
    assert any("SGLANG_RAGGED_VERIFY_MODE" in n and "static" in n for n in res["notes"])
    res = export_profile(profiled_dir, "trtllm", tmp_path / "t")
    for sfx in ("", ".tensorrt"):
        t = _check_trtllm_table(tmp_path / "t" / f"trtllm_sps_table{sfx}.json")
        assert t["_meta"]["engine"]["block"] == 4 and t["_meta"]["engine"]["max_batch_size"] == 2
        assert t["batch_sizes"] and t["_meta"]["measured_on"]["drafter_lm_head"] in ("int8", "float32")
        yaml = (tmp_path / "t" / f"trtllm_speculative_config{sfx}.yaml").read_text()
        for line in ("enable_confidence_scheduling: true", "enable_ragged_verify: true",
                     f"confidence_sps_table_path: \"{tmp_path / 't' / f'trtllm_sps_table{sfx}.json'}\"",
                     f"confidence_sts_path: \"{tmp_path / 't' / 'trtllm_sts.json'}\""):
            assert line in yaml, line
    sts = json.loads((tmp_path / "t" / "trtllm_sts.json").read_text())
    assert sts["sts_temperatures"] == [1.0] * 4
    export_profile(profiled_dir, "generic", tmp_path / "g")
    assert {p.name for p in (tmp_path / "g").iterdir()} == {"dspark_profile.json", "dspark_profile.csv",
                                                            "dspark_profile.tensorrt.json",
                                                            "dspark_profile.tensorrt.csv"}
