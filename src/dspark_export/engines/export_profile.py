"""`dspark-export export-profile`: the throughput profile (SPS(B) and the drafter cost d(R)) and the STS
calibration in the file formats that serving engines with DSpark support read as they are.

Formats, confirmed in each consumer's own loading code (read, not copied; the files and commits are the
ones docs/ARCHITECTURE.md "Exporting the profile for serving engines" names; re-check when upgrading):

- ``sglang`` (sgl-project/sglang, ``python/sglang/srt/speculative/dspark_components/``: ``dspark_sps.py``
  @ 45b76f55, ``dspark_sts.py`` @ 9e16e2d0, ``dspark_planner.py`` @ 00c3cffa; msgspec structs, unknown keys
  ignored). ``--speculative-dspark-sps-table-path`` takes either the SPS table ``{"sample_batch_tokens":
  [int, strictly increasing], "sample_steps_per_sec": [float], "max_batch_tokens": int}`` (looked up at the
  largest probe ≤ B, clamped at both ends, so beyond the last probe it keeps the last SPS) or, when the
  file's text contains ``"bias_seconds"``, the additive cost model ``{"bias_seconds": float > 0,
  "bs_probes": [int], "alpha_seconds": [float], "m_probes": [int], "theta_seconds": [float]}`` whose step
  time is bias + α(R) + θ(R + k), both terms clamped linear interpolations: α carries the drafter cost
  d(R), θ the target step. The planner reads the table only when ``SGLANG_RAGGED_VERIFY_MODE`` is not
  ``static`` (under ``static``, SGLang's default, it warns that the flag is a no-op and builds no confidence
  head). ``--speculative-dspark-confidence-sts-path``: ``{"temperatures": [γ floats > 0], "dataset",
  "num_samples": int, "ece_before": [float], "ece_after": [float]}``; SGLang computes σ(z_k / T_k).
- ``trtllm`` (NVIDIA/TensorRT-LLM, ``tensorrt_llm/_torch/speculative/``: ``dspark_planner.py`` @ 52cd02d5,
  ``dspark_sts.py`` @ 0ee1e73f, and the DSpark worker's table check): ``DSparkDecodingConfig`` fields
  ``confidence_sps_table_path`` and ``confidence_sts_path`` (the spelling of PR #17056; PR #18392 names the
  table ``confidence_sps_cost_table_path``; TensorRT-LLM main's config had neither when checked), with
  ``enable_confidence_scheduling`` and ``enable_ragged_verify`` both true (the config rejects scheduling
  without ragged verify, and ragged verify without a table). Table (legacy, interpolating loader):
  ``{"token_counts": [int, strictly increasing], "step_time_ms": [float > 0], "fixed_overhead_ms",
  "batch_sizes": [int], "batch_overhead_ms": [float ≥ 0], "minimum_predicted_gain"}``; step cost =
  θ(total verified tokens, bonus included) + fixed + α(R), clamped linear interpolation, so a flat shelf is
  two breakpoints with equal values; ``batch_sizes``/``batch_overhead_ms`` carry d(R). ``_meta.lookup =
  "interp"`` silences the loader's old-format warning and ``_meta.engine`` is compared key by key with the
  serving engine (tp, ep, attention_dp, block, max_batch_size: a mismatch refuses the table). A table with
  any of ``schema_version``, ``cost_tables``, ``engine_fingerprint``, ``measurements`` goes to the exact
  schema-v2 loader instead, which needs per-(G, V) CUDA-graph cells and a live engine fingerprint: not
  written. STS: ``{"sts_temperatures": [γ floats]}`` (``temperatures`` also accepted), σ(z_k / T_k).
- ``vllm``: not exportable. vLLM's adaptive verification profiles its step costs itself at startup from its
  captured CUDA graphs (``docs/features/speculative_decoding/adaptive_verification.md``); it documents no file
  to load, only ``VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN``.
- ``generic``: this project's own labelled JSON and CSV (per bucket: median/p10/p90 ms, SPS, the bucket that
  serves it, the SPS the scheduler uses), the drafter rows and both calibrations, for any other consumer.

Every conversion reproduces the runtime's pricing (`runtime.scheduler.ThroughputProfile`): B verification
tokens are served by the fastest measured bucket ≥ B (`EngineSet.bucket_for`), R requests' drafter block by
the smallest drafter bucket ≥ R, and a step costs 1/SPS(B) + d(R). Not carried: the layout cost (neither
format has a place for it) and "B beyond the largest bucket cannot run" (both consumers clamp). Every file
says what it was measured on (backend, device, weight formats) under ``_meta``; the TensorRT profile
(``profile/tensorrt/sps.json``) is exported beside the ONNX Runtime one when the directory has it.
The STS files hold the temperature-only fit (`training.calibration.temperature_only`), the one σ(z/T)
consumers can apply, with its own ECE.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from ..errors import ConfigError, ProfileError
from .manifest import Manifest
from .sps import SpsFile, read_sps

__all__ = ["FORMATS", "export_profile", "sps_staircase", "draft_staircase", "VLLM_NOTE"]

FORMATS = ("sglang", "trtllm", "generic", "vllm")
VLLM_NOTE = ("vLLM documents no file format for its adaptive-verification cost profile: it measures step costs "
             "itself at startup from its captured CUDA graphs (set VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN "
             "to the context you serve); use --format generic for this engine directory's table")
#: TensorRT-LLM's runtime default for profiler artifacts (its loader's `minimum_predicted_gain` default)
TRTLLM_MIN_GAIN = 0.01
#: the consumers' own commits confirmed (the files named in the module docstring)
CONFIRMED = {"sglang": "sgl-project/sglang python/sglang/srt/speculative/dspark_components: dspark_sps.py@45b76f55, "
                       "dspark_sts.py@9e16e2d0, dspark_planner.py@00c3cffa",
             "trtllm": "NVIDIA/TensorRT-LLM tensorrt_llm/_torch/speculative: dspark_planner.py@52cd02d5 (legacy "
                       "table loader), dspark_sts.py@0ee1e73f; DSparkDecodingConfig field names of PR #17056"}


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


def draft_staircase(drafter_rows: list[dict]) -> list[dict]:
    """d(R) per drafter request bucket (ascending): {"R", "ms"} as the runtime prices it (the smallest bucket
    ≥ R; `ThroughputProfile.draft_seconds`). Empty without rows.

    Raises:
        ProfileError: a row without integer R / non-negative median_ms, or repeated buckets.
    """
    try:
        rows = sorted((int(r["R"]), float(r["median_ms"])) for r in drafter_rows or [])
    except (KeyError, TypeError, ValueError) as e:
        raise ProfileError(f"profile: every drafter_block row needs an integer 'R' and a numeric 'median_ms' "
                           f"({e!r})") from None
    if any(ms < 0 for _, ms in rows) or len({r for r, _ in rows}) != len(rows):
        raise ProfileError("profile: expected distinct drafter buckets with median_ms >= 0")
    return [{"R": r, "ms": ms} for r, ms in rows]


def _shelves(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    """Breakpoints for a clamped linear interpolation that reproduces a step function: the value v_i of bucket
    b_i holds on (b_{i-1}, b_i], written as two breakpoints (b_{i-1} + 1, v_i), (b_i, v_i) (one when equal)."""
    xs, ys, prev = [], [], 0
    for b, v in points:
        for x in dict.fromkeys((prev + 1, b)):
            xs.append(x)
            ys.append(v)
        prev = b
    return xs, ys


def _sglang_sps(stairs: list[dict]) -> dict:
    # SGLang floors B to the largest probe <= B, so bucket b_i's value starts at b_{i-1} + 1.
    probes, prev = [], 0
    for s in stairs:
        probes.append((prev + 1, s["sps"]))
        prev = s["B"]
    return {"sample_batch_tokens": [p for p, _ in probes], "sample_steps_per_sec": [v for _, v in probes],
            "max_batch_tokens": stairs[-1]["B"]}


def _sglang_additive(stairs: list[dict], drafts: list[dict]) -> dict:
    """SGLang's additive cost model: bias + α(R) + θ(m), m = R + admitted drafts = B. θ is the target staircase
    less its cheapest step (the bias, > 0 as SGLang requires), α the drafter staircase d(R); seconds."""
    bias = min(s["step_ms"] for s in stairs)
    m, theta = _shelves([(s["B"], (s["step_ms"] - bias) / 1000.0) for s in stairs])
    bs, alpha = _shelves([(d["R"], d["ms"] / 1000.0) for d in drafts])
    return {"bias_seconds": bias / 1000.0, "bs_probes": bs, "alpha_seconds": alpha, "m_probes": m,
            "theta_seconds": theta}


def _trtllm_cost(stairs: list[dict], drafts: list[dict] | None = None) -> dict:
    """TensorRT-LLM's interpolating table: θ over total verified tokens (bonus included) and, where the drafter
    cost is known, α(R) as batch_sizes / batch_overhead_ms; ms."""
    counts, times = _shelves([(s["B"], s["step_ms"]) for s in stairs])
    bs, overhead = _shelves([(d["R"], d["ms"]) for d in drafts or []])
    return {"token_counts": counts, "step_time_ms": times, "fixed_overhead_ms": 0.0, "batch_sizes": bs,
            "batch_overhead_ms": overhead, "minimum_predicted_gain": TRTLLM_MIN_GAIN}


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
    from ..modeling.loading import temperature_only

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


def _profiles(manifest: Manifest) -> list[tuple[str, str, SpsFile]]:
    """(backend, relative path, read sps.json) of every measured profile: ONNX Runtime's, then TensorRT's."""
    found = []
    rel = (manifest.data.get("profile") or {}).get("path")
    trt = ((manifest.data.get("backends") or {}).get("tensorrt") or {}).get("profile") or {}
    for backend, path in (("onnxruntime", rel), ("tensorrt", trt.get("path"))):
        if path:
            where = "profile.path" if backend == "onnxruntime" else "backends.tensorrt.profile.path"
            found.append((backend, path, read_sps(manifest.path_of(path, where))))
    return found


def _measured_on(manifest: Manifest, backend: str, rel: str, sps: SpsFile) -> dict:
    """What a profile describes: the engines it timed (backend, device, weight formats) and how."""
    spec = (manifest.data.get("graphs") or {}).get("drafter_block", {}).get("spec", {})
    build = manifest.data.get("build_config") or {}
    return {"tool": f"dspark-export {manifest.data.get('tool', {}).get('version', '?')}", "profile": rel,
            "backend": (sps.get("device") or {}).get("backend", backend), "device": sps.get("device") or {},
            "target_weights": build.get("weights") or "fp32", "drafter_lm_head": spec.get("lm_head_dtype", "float32"),
            "drafter_approximations": [a.get("name") + "=" + str(a.get("value")) for a in
                                       (manifest.data.get("source", {}).get("drafter", {}).get("approximations")
                                        or [])],
            "block_size": int(manifest.runtime["block_size"]), "context_len": sps.get("context_len"),
            "repeats": sps.get("repeats"),
            "scope": "these engines on the machine that ran `dspark-export profile`: profile the serving engine for "
                     "its own table"}


def _trtllm_config(table: str, sts: str) -> str:
    """The `speculative_config` block of a TensorRT-LLM LLM-API YAML that loads the two files."""
    return ("# TensorRT-LLM DSpark (DSparkDecodingConfig field names of PR #17056; PR #18392 spells the table\n"
            "# field confidence_sps_cost_table_path). Merge into your extra LLM-API options YAML.\n"
            "speculative_config:\n  decoding_type: DSpark\n  enable_confidence_scheduling: true\n"
            "  enable_ragged_verify: true\n"
            f"  confidence_sps_table_path: {json.dumps(table)}\n  confidence_sts_path: {json.dumps(sts)}\n")


def export_profile(engine_dir: str | Path, fmt: str, out: str | Path) -> dict:
    """Write the profile (and calibration) of `engine_dir` in format `fmt` into the folder `out`.

    Returns:
        {"format", "files": {role: path}, "flags": {server flag / config field: path} (the ONNX Runtime
        profile's), "flags_by_profile": {backend: flags}, "confirmed": consumer code checked, "notes": [str]}.
    Raises:
        ConfigError: an unknown format, `vllm` (no documented file format), an engine directory without a
            throughput profile, or (sglang, trtllm) a biased calibration without a temperature-only fit.
        ProfileError: a profile that is not a valid sps.json.
        EngineDirError: the directory is not a complete, intact engine directory.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format: expected one of {', '.join(FORMATS)}, found {fmt!r}")
    if fmt == "vllm":
        raise ConfigError(f"--format vllm: {VLLM_NOTE}")
    manifest = Manifest.load(Path(engine_dir), verify=True)
    profiles = _profiles(manifest)
    if not profiles:
        raise ConfigError(f"{engine_dir}: no throughput profile recorded; run `dspark-export profile --engine-dir "
                          f"{engine_dir}` first")
    tables = [(backend, rel, sps, sps_staircase(sps.target), draft_staircase(sps.drafter_block))
              for backend, rel, sps in profiles]
    block = int(manifest.runtime["block_size"])
    try:
        cal = _calibration(manifest)
    except ConfigError:
        if fmt != "generic":      # the generic file keeps the engine's own fit; a missing plain fit is named there
            raise
        cal = dict.fromkeys(("temperatures", "ece_before", "ece_after", "mean_ece_before", "mean_ece_after", "rounds",
                             "fitted_on"))
    full_cal = manifest.calibration() or {}
    biases = manifest.confidence_bias
    calibrated = any(abs(float(t) - 1.0) > 1e-9 for t in manifest.runtime["confidence_temperature"]) or any(biases)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    notes = []
    for backend, rel, sps, _, drafts in tables:
        dev = sps.get("device") or {}
        notes.append(f"{rel}: measured on {dev.get('backend', backend)} {','.join(dev.get('providers', []))} at "
                     f"context {sps.get('context_len')}: it describes those engines on that machine; profile the "
                     "serving engine itself for its own table")
        if not drafts:
            notes.append(f"{rel}: no drafter_block rows, so no drafter cost d(R) is exported")
    if not calibrated:
        notes.append("the drafter is uncalibrated (all STS temperatures 1)")
    if any(biases) and fmt in ("sglang", "trtllm"):
        notes.append(f"{fmt} computes sigmoid(z/T): the file holds the temperature-only STS fit of the same held-out "
                     f"rounds (mean ECE {cal['mean_ece_after']}), not this engine's temperature + bias fit "
                     f"(biases {biases})")
    if any(sps.get("attention") for _, _, sps, _, _ in tables) and fmt != "generic":
        notes.append(f"the layout cost (sps.json 'attention') has no place in the {fmt} format: not exported")
    files: dict[str, Path] = {}
    by_profile: dict[str, dict] = {}

    def write(name: str, role: str, data: str) -> Path:
        path = out / name
        path.write_text(data, encoding="utf-8")
        files[role] = path
        return path

    def dump(obj) -> str:
        return json.dumps(obj, indent=1) + "\n"

    cal_meta = {"fit": "temperature-only STS (paper 3.2.1), sigmoid(z_k / T_k)", "fitted_on": cal["fitted_on"],
                "rounds": cal["rounds"], "mean_ece_before": cal["mean_ece_before"],
                "mean_ece_after": cal["mean_ece_after"]}
    if fmt == "sglang":
        sts = {"temperatures": cal["temperatures"], "dataset": cal["fitted_on"] or "", "num_samples": cal["rounds"] or 0}
        if cal["ece_before"] and cal["ece_after"]:
            sts.update(ece_before=cal["ece_before"], ece_after=cal["ece_after"])
        sts_path = write("sglang_sts.json", "sts", dump({**sts, "_meta": {**cal_meta, "confirmed": CONFIRMED[fmt]}}))
        for backend, rel, sps, stairs, drafts in tables:
            sfx = "" if backend == "onnxruntime" else f".{backend}"
            meta = {"measured_on": _measured_on(manifest, backend, rel, sps), "confirmed": CONFIRMED[fmt],
                    "read_when": "SGLANG_RAGGED_VERIFY_MODE is not static",
                    "beyond_last_probe": f"clamped to the last probe; these engines cannot run more than "
                                         f"{stairs[-1]['B']} verification tokens in one step"}
            plain = write(f"sglang_sps_table{sfx}.json", f"sps_table{sfx}", dump({
                **_sglang_sps(stairs), "_meta": {**meta, "lookup": "largest probe <= B (floor); no drafter cost "
                                                 "(see the additive cost file beside it)"}}))
            flag = plain
            if drafts:
                flag = write(f"sglang_sps_additive{sfx}.json", f"sps_additive{sfx}", dump({
                    **_sglang_additive(stairs, drafts),
                    "_meta": {**meta, "lookup": "bias + alpha(R) + theta(R + drafts), clamped linear "
                                                "interpolation; alpha is the drafter cost d(R)"}}))
            by_profile[backend] = {"--speculative-dspark-sps-table-path": str(flag),
                                   "--speculative-dspark-confidence-sts-path": str(sts_path)}
        notes.append("SGLang reads --speculative-dspark-sps-table-path only when SGLANG_RAGGED_VERIFY_MODE is not "
                     "'static' (its default; under 'static' it warns that the flag is a no-op), and clamps B beyond "
                     "the last probe to the last value")
    elif fmt == "trtllm":
        sts = {"sts_temperatures": cal["temperatures"], "num_samples": cal["rounds"] or 0,
               "dataset": cal["fitted_on"] or ""}
        if cal["ece_before"] and cal["ece_after"]:
            sts.update(ece_before=cal["ece_before"], ece_after=cal["ece_after"])
        sts_path = write("trtllm_sts.json", "sts", dump({**sts, "_meta": {**cal_meta, "confirmed": CONFIRMED[fmt]}}))
        for backend, rel, sps, stairs, drafts in tables:
            sfx = "" if backend == "onnxruntime" else f".{backend}"
            measured = _measured_on(manifest, backend, rel, sps)
            engine = {"block": block, "tp": 1, "ep": 1, "attention_dp": False,
                      "max_batch_size": int(manifest.data["buckets"]["requests"][-1]),
                      "backend": measured["backend"], "target_weights": measured["target_weights"],
                      "drafter_lm_head": measured["drafter_lm_head"]}
            table = write(f"trtllm_sps_table{sfx}.json", f"sps_table{sfx}", dump({
                **_trtllm_cost(stairs, drafts),
                "_meta": {"lookup": "interp", "engine": engine, "measured_on": measured, "confirmed": CONFIRMED[fmt],
                          "units": "token_counts: total verified tokens (one bonus/anchor per request plus its "
                                   "drafts); batch_overhead_ms: the drafter block d(R)"}}))
            config = write(f"trtllm_speculative_config{sfx}.yaml", f"config{sfx}", _trtllm_config(str(table),
                                                                                                 str(sts_path)))
            by_profile[backend] = {"confidence_sps_table_path": str(table), "confidence_sts_path": str(sts_path),
                                   "config": str(config)}
        notes.append("TensorRT-LLM: DSparkDecodingConfig(enable_confidence_scheduling=True, enable_ragged_verify=True,"
                     " confidence_sps_table_path=..., confidence_sts_path=...) (PR #17056 names; PR #18392 calls the "
                     "table field confidence_sps_cost_table_path); the table's _meta.engine (tp 1, ep 1, no attention "
                     "DP, block, max_batch_size) is compared with the serving engine, which refuses a mismatch; the "
                     "exact schema-v2 tables (per CUDA-graph cell, live engine fingerprint) are not written")
    else:
        for backend, rel, sps, stairs, drafts in tables:
            sfx = "" if backend == "onnxruntime" else f".{backend}"
            generic = {"format": "dspark-export generic SPS profile", "version": 2, "block_size": block,
                       "context_len": sps.get("context_len"), "device": sps.get("device", {}),
                       "measured_on": _measured_on(manifest, backend, rel, sps),
                       "lookup": "B verification tokens (one anchor/bonus row per request plus its drafts) are served "
                                 "by the bucket in served_by; sps is that bucket's 1000 / median_ms; a step of R "
                                 "requests also pays the drafter block d(R) (smallest drafter bucket >= R)",
                       "buckets": [{**{k: r.get(k) for k in ("B", "median_ms", "p10_ms", "p90_ms")},
                                    "served_by": st["served_by"], "sps": st["sps"]}
                                   for r, st in zip(sps.target, stairs)],
                       "drafter_block": sps.get("drafter_block", []), "attention": sps.get("attention"),
                       "confidence_temperature": [float(t) for t in manifest.runtime["confidence_temperature"]],
                       "confidence_bias": biases, "ece_before": full_cal.get("ece_before"),
                       "ece_after": full_cal.get("ece_after"),
                       "temperature_only": {k: cal[k] for k in ("temperatures", "ece_before", "ece_after",
                                                                "mean_ece_after", "rounds")}}
            write(f"dspark_profile{sfx}.json", f"json{sfx}", dump(generic))
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            w.writerow(["B", "median_ms", "p10_ms", "p90_ms", "served_by", "sps"])
            for row in generic["buckets"]:
                w.writerow([row["B"], row["median_ms"], row["p10_ms"], row["p90_ms"], row["served_by"], row["sps"]])
            write(f"dspark_profile{sfx}.csv", f"csv{sfx}", buf.getvalue())
    return {"format": fmt, "files": {k: str(v) for k, v in files.items()},
            "flags": by_profile.get("onnxruntime") or next(iter(by_profile.values()), {}),
            "flags_by_profile": by_profile, "confirmed": CONFIRMED.get(fmt), "notes": notes}
