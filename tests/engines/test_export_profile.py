"""`dspark-export export-profile`: SGLang / TensorRT-LLM / generic files reproduce the runtime's SPS(B) staircase."""

from __future__ import annotations

import bisect
import csv
import json

import numpy as np
import pytest

from dspark_export.cli import main as cli_main
from dspark_export.engines.export_profile import _sglang_sps, _trtllm_cost, sps_staircase
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


@pytest.mark.parametrize("fmt, names", [("sglang", {"sglang_sps_table.json", "sglang_sts.json"}),
                                        ("trtllm", {"trtllm_cost_table.json", "trtllm_calibration.json"}),
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
        assert json.loads((out / "trtllm_calibration.json").read_text()) == {"sts_temperatures": [1.0] * 4}
        cost = json.loads((out / "trtllm_cost_table.json").read_text())
        assert cost["token_counts"][-1] == 8
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
