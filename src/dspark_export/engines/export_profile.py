"""`dspark-export export-profile`: the throughput profile SPS(B) and the STS calibration in the file formats
that serving engines with DSpark support read.

Formats (confirmed from each project's loader source, not from a published schema; re-check when upgrading):

- ``sglang``: SGLang's DSpark server flags ``--speculative-dspark-sps-table-path`` and
  ``--speculative-dspark-confidence-sts-path`` (sgl-project/sglang, PR #30261;
  ``python/sglang/srt/speculative/dspark_components/dspark_sps.py`` ``SpsCostTable`` and ``dspark_sts.py``
  ``DSparkStsCalibration``, read with msgspec). SPS table: ``{"sample_batch_tokens": [int, strictly
  increasing], "sample_steps_per_sec": [float], "max_batch_tokens": int}``; SGLang looks B up by the largest
  probe ≤ B (a floor), clamped at both ends. STS: ``{"temperatures": [γ floats > 0], "dataset", "num_samples",
  "ece_before", "ece_after"}``.
- ``trtllm``: TensorRT-LLM's ``DSparkDecodingConfig.confidence_cost_table_path`` and
  ``confidence_calibration_path`` (NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/speculative/dspark_planner.py``
  legacy cost table, ``dspark_sts.py``). Cost table: ``{"token_counts": [int, strictly increasing],
  "step_time_ms": [float > 0], "minimum_predicted_gain": float}`` looked up by clamped linear interpolation
  over the total verified tokens (bonus included), so a flat shelf is written as two breakpoints with equal
  values. Calibration: ``{"sts_temperatures": [γ floats]}``. TensorRT-LLM's schema-v2 exact tables need a
  GPU/CUDA-graph fingerprint of the serving engine and are not written.
- ``vllm``: not exportable. vLLM's adaptive verification profiles its step costs itself at startup from its
  captured CUDA graphs (``docs/features/speculative_decoding/adaptive_verification.md``); it documents no file
  to load, only ``VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN``.
- ``generic``: this project's own labelled JSON and CSV (per bucket: median/p10/p90 ms, SPS, the bucket that
  serves it, the SPS the scheduler uses), for any other consumer.

Both SPS conversions reproduce exactly the staircase our runtime uses: B tokens are served by the fastest
measured engine whose bucket is ≥ B (`EngineSet.bucket_for`). An SPS table describes the hardware and engine
it was measured on (here ONNX Runtime on this machine); the STS temperatures describe the drafter and carry
over to any engine serving the same drafter.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from ..errors import ConfigError, ProfileError
from .manifest import Manifest
from .sps import profile_path, read_sps

__all__ = ["FORMATS", "export_profile", "sps_staircase", "VLLM_NOTE"]

FORMATS = ("sglang", "trtllm", "generic", "vllm")
VLLM_NOTE = ("vLLM documents no file format for its adaptive-verification cost profile: it measures step costs "
             "itself at startup from its captured CUDA graphs (set VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN "
             "to the context you serve); use --format generic for this engine directory's table")
#: TensorRT-LLM's runtime default for profiler artifacts (its loader's `minimum_predicted_gain` default)
TRTLLM_MIN_GAIN = 0.01


def sps_staircase(target_rows: list[dict]) -> list[dict]:
    """Per bucket B (ascending): the serving bucket (fastest measured bucket ≥ B), its median ms and SPS.

    Raises:
        ProfileError: no rows, or a row without integer B / positive median_ms.
    """
    try:
        rows = sorted(({"B": int(r["B"]), "median_ms": float(r["median_ms"])} for r in target_rows),
                      key=lambda r: r["B"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"profile: every target row needs an integer 'B' and a numeric 'median_ms' ({e!r})") from None
    if not rows or any(r["median_ms"] <= 0 for r in rows) or len({r["B"] for r in rows}) != len(rows):
        raise ProfileError("profile: expected distinct buckets with positive median_ms")
    out = []
    for i, r in enumerate(rows):
        best = min(rows[i:], key=lambda x: (x["median_ms"], x["B"]))
        out.append({"B": r["B"], "served_by": best["B"], "step_ms": best["median_ms"],
                    "sps": round(1000.0 / best["median_ms"], 6)})
    return out


def _sglang_sps(stairs: list[dict]) -> dict:
    # SGLang floors B to the largest probe <= B, so bucket b_i's value starts at b_{i-1} + 1.
    probes, prev = [], 0
    for s in stairs:
        probes.append((prev + 1, s["sps"]))
        prev = s["B"]
    return {"sample_batch_tokens": [p for p, _ in probes], "sample_steps_per_sec": [v for _, v in probes],
            "max_batch_tokens": stairs[-1]["B"]}


def _trtllm_cost(stairs: list[dict]) -> dict:
    # Linear interpolation between breakpoints: each bucket's shelf (b_{i-1}, b_i] is two equal breakpoints.
    counts, times, prev = [], [], 0
    for s in stairs:
        for b in dict.fromkeys((prev + 1, s["B"])):
            counts.append(b)
            times.append(s["step_ms"])
        prev = s["B"]
    return {"token_counts": counts, "step_time_ms": times, "minimum_predicted_gain": TRTLLM_MIN_GAIN}


def _calibration(manifest: Manifest) -> dict:
    """The temperature-only STS fit (σ(z/T), what the consumers compute) and its own ECE.

    Taken from the directory's calibration.json (`training.calibration.temperature_only`); without that file the
    manifest's temperatures are used when its biases are all 0 (they are then a temperature-only fit, ECE
    unknown).

    Raises:
        ConfigError: the engine applies per-position biases and no temperature-only fit is recorded (a
            calibration.json written before `fit_calibration`): exporting its temperatures without the biases
            would hand the consumer a fit that was never scored.
    """
    from ..training.calibration import temperature_only

    cal = manifest.calibration() or {}
    fit = temperature_only(cal) if cal else None
    if fit is None and not any(manifest.confidence_bias):
        fit = {"confidence_temperature": manifest.runtime["confidence_temperature"]}
    if fit is None:
        where = (manifest.data.get("calibration") or {}).get("path") or "the drafter's calibration.json"
        raise ConfigError(f"{manifest.root / where}: temperature_only: no temperature-only STS fit recorded, and the "
                          f"engine's calibration adds per-position biases {manifest.confidence_bias} that SGLang and "
                          "TensorRT-LLM cannot apply (they compute sigmoid(z/T)); re-run `scripts/train_drafter.py "
                          "calibrate` (it fits both) and rebuild")
    temps = [float(t) for t in fit["confidence_temperature"]]
    return {"temperatures": temps, "ece_before": fit.get("ece_before"), "ece_after": fit.get("ece_after"),
            "mean_ece_before": fit.get("mean_ece_before"), "mean_ece_after": fit.get("mean_ece_after"),
            "rounds": fit.get("rounds"), "fitted_on": cal.get("fitted_on")}


def export_profile(engine_dir: str | Path, fmt: str, out: str | Path) -> dict:
    """Write the profile (and calibration) of `engine_dir` in format `fmt` into the folder `out`.

    Returns:
        {"format", "files": {role: path}, "flags": {server flag / config field: path}, "notes": [str]}.
    Raises:
        ConfigError: an unknown format, `vllm` (no documented file format), or an engine directory
            without a throughput profile.
        EngineDirError: the directory is not a complete, intact engine directory.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format: expected one of {', '.join(FORMATS)}, found {fmt!r}")
    if fmt == "vllm":
        raise ConfigError(f"--format vllm: {VLLM_NOTE}")
    manifest = Manifest.load(Path(engine_dir), verify=True)
    path = profile_path(manifest)
    if path is None:
        raise ConfigError(f"{engine_dir}: no throughput profile recorded; run `dspark-export profile --engine-dir "
                          f"{engine_dir}` first")
    sps = read_sps(path)
    stairs = sps_staircase(sps.get("target") or [])
    cal = _calibration(manifest)
    full_cal = manifest.calibration() or {}
    block = int(manifest.runtime["block_size"])
    calibrated = any(abs(t - 1.0) > 1e-9 for t in cal["temperatures"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    notes = [f"SPS measured on {sps.get('device', {}).get('backend', '?')} "
             f"{','.join(sps.get('device', {}).get('providers', []))} at context {sps.get('context_len')}: it "
             "describes that engine on this machine; profile the serving engine itself for its own table"]
    if not calibrated:
        notes.append("the drafter is uncalibrated (all STS temperatures 1)")
    biases = manifest.confidence_bias
    if any(biases) and fmt in ("sglang", "trtllm"):
        notes.append(f"{fmt} computes sigmoid(z/T): the file holds the temperature-only STS fit of the same held-out "
                     f"rounds (mean ECE {cal['mean_ece_after']}), not this engine's temperature + bias fit "
                     f"(biases {biases})")
    files: dict[str, Path] = {}
    flags: dict[str, str] = {}

    def write(name: str, role: str, data: str) -> Path:
        path = out / name
        path.write_text(data, encoding="utf-8")
        files[role] = path
        return path

    if fmt == "sglang":
        p = write("sglang_sps_table.json", "sps_table", json.dumps(_sglang_sps(stairs), indent=1) + "\n")
        flags["--speculative-dspark-sps-table-path"] = str(p)
        sts = {"temperatures": cal["temperatures"], "dataset": cal["fitted_on"] or "", "num_samples": cal["rounds"] or 0}
        if cal["ece_before"] and cal["ece_after"]:
            sts.update(ece_before=cal["ece_before"], ece_after=cal["ece_after"])
        p = write("sglang_sts.json", "sts", json.dumps(sts, indent=1) + "\n")
        flags["--speculative-dspark-confidence-sts-path"] = str(p)
    elif fmt == "trtllm":
        p = write("trtllm_cost_table.json", "cost_table", json.dumps(_trtllm_cost(stairs), indent=1) + "\n")
        flags["confidence_cost_table_path"] = str(p)
        p = write("trtllm_calibration.json", "calibration",
                  json.dumps({"sts_temperatures": cal["temperatures"]}, indent=1) + "\n")
        flags["confidence_calibration_path"] = str(p)
        notes.append("TensorRT-LLM: enable with DSparkDecodingConfig(enable_confidence_scheduling=True, ...)")
    else:
        generic = {"format": "dspark-export generic SPS profile", "version": 1, "block_size": block,
                   "context_len": sps.get("context_len"), "device": sps.get("device", {}),
                   "lookup": "B verification tokens (one anchor/bonus row per request plus its drafts) are served by "
                             "the bucket in served_by; sps is that bucket's 1000 / median_ms",
                   "buckets": [{**{k: r.get(k) for k in ("B", "median_ms", "p10_ms", "p90_ms")},
                                "served_by": s["served_by"], "sps": s["sps"]}
                               for r, s in zip(sps.target, stairs)],
                   "drafter_block": sps.get("drafter_block", []),
                   "confidence_temperature": [float(t) for t in manifest.runtime["confidence_temperature"]],
                   "confidence_bias": biases, "ece_before": full_cal.get("ece_before"),
                   "ece_after": full_cal.get("ece_after"),
                   "temperature_only": {k: cal[k] for k in ("temperatures", "ece_before", "ece_after",
                                                            "mean_ece_after", "rounds")}}
        write("dspark_profile.json", "json", json.dumps(generic, indent=1) + "\n")
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["B", "median_ms", "p10_ms", "p90_ms", "served_by", "sps"])
        for row in generic["buckets"]:
            w.writerow([row["B"], row["median_ms"], row["p10_ms"], row["p90_ms"], row["served_by"], row["sps"]])
        write("dspark_profile.csv", "csv", buf.getvalue())
    return {"format": fmt, "files": {k: str(v) for k, v in files.items()}, "flags": flags, "notes": notes}
