"""`dspark-export report`: one self-contained HTML page (figures inlined as PNG data URIs) plus the same
figures as PNG files and the page's data as `report.json`.

What it shows, from the engine directory: the engines built (graph, backend, buckets, file sizes), the
target latency per bucket B with its p10-p90 spread and the SPS(B) curve the scheduler reads, the
drafter latency per request count, the drafter calibration (STS temperatures, ECE per position, the
reliability diagram when the calibration file holds its bins) and, when given, the `bench acceptance`,
`bench serve` and `bench peers` results.

Where it goes: by default into `<engine dir>/report/`, listed in the manifest with sizes and sha256
(`Manifest.replace_folder`), so `inspect` still verifies the directory after the report is regenerated;
with `out` elsewhere the engine directory is not touched. `build` writes it last, and `profile`
regenerates it when one exists.

Rendering: jinja2 template `templates/report.html.j2` (autoescaped), matplotlib figures (`figures.py`).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import __version__
from ..engines.manifest import MANIFEST_NAME, Manifest
from ..engines.ort.runner import uses_shared_session
from ..engines.sps import SpsFile, ThroughputProfile, profile_path, read_sps
from ..errors import ConfigError, EngineDirError, ProfileError
from .. import figures

log = logging.getLogger(__name__)

__all__ = ["ReportInputs", "collect", "render", "write_report", "render_into_manifest", "REPORT_DIR",
           "load_json_input"]

#: the report's folder inside an engine directory
REPORT_DIR = "report"
HTML_NAME = "index.html"
DATA_NAME = "report.json"


@dataclass
class ReportInputs:
    """Optional results shown beside the engine directory's own data (each a parsed JSON object).

    Attributes:
        acceptance: a `bench acceptance` result (--json / acceptance.json).
        serve: a `bench serve` result (--json / serve_bench.json).
        peers: a `bench peers` result (--json).
        calibration: a calibration.json (overrides the one the engine directory records).
        calibration_source: where `calibration` came from (shown on the page).
    """

    acceptance: dict | None = None
    serve: dict | None = None
    peers: dict | None = None
    calibration: dict | None = None
    calibration_source: str | None = None


def load_json_input(path: str | Path, what: str, required: tuple[str, ...]) -> dict:
    """Read a JSON object with `required` keys.

    Raises:
        ConfigError: the file is missing, not JSON, not an object, or lacks a required key (named).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{what} {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{what} {path}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: expected a JSON object, found {type(data).__name__}")
    missing = [k for k in required if k not in data]
    if missing:
        raise ConfigError(f"{what} {path}: expected the keys {list(required)} of a {what} result, missing {missing}")
    return data


# -- data -----------------------------------------------------------------------------------------------

def _profile(manifest: Manifest) -> dict | None:
    rel = (manifest.data.get("profile") or {}).get("path")
    path = profile_path(manifest)
    if path is None:
        return None
    try:
        sps = read_sps(path)
        target, drafter = sps.target, sps.drafter_block
    except ProfileError as e:
        raise EngineDirError(str(e)) from None
    buckets = [int(r["B"]) for r in target]
    latency = {int(r["B"]): float(r["median_ms"]) for r in target}
    rows = []
    for i, r in enumerate(target):
        # the engine that serves B tokens: the fastest measured bucket >= B (EngineSet.bucket_for)
        served = min(buckets[i:], key=lambda b: (latency[b], b))
        rows.append({"B": int(r["B"]), "median_ms": r["median_ms"], "p10_ms": r["p10_ms"], "p90_ms": r["p90_ms"],
                     "sps": r["sps"], "served_by": served, "effective_sps": round(1000.0 / latency[served], 3)})
    # whether the runtime prices B between buckets by interpolation: its target engines run a pass's own rows
    # on ONNX Runtime's shared session (`OrtRunner.padded_rows`, `ThroughputProfile.exact_rows`)
    exact_rows = any(k.graph == "target" and k.backend == "onnxruntime" and uses_shared_session(k)
                     for k in manifest.engine_keys())
    return {"path": rel, "context_len": sps.get("context_len"), "warmup": sps.get("warmup"),
            "repeats": sps.get("repeats"), "layout": sps.get("layout"), "device": sps.device,
            "target": rows, "drafter_block": drafter, "attention": _attention(sps),
            "warnings": sps.warnings, "exact_rows": exact_rows}


def _attention(sps: SpsFile) -> dict | None:
    """The layout-cost fit for the report (checked as the runtime reads it), its layout rows reduced to the
    fields the table shows (None where one is missing)."""
    from ..engines.inspect import attention_summary

    fit = attention_summary(sps)
    if fit is not None:
        keys = ("S", "Q", "P", "rows", "N", "median_ms", "fit_ms")
        fit["layouts"] = [{k: (r.get(k) if isinstance(r.get(k), (int, float)) else None) for k in keys}
                          for r in fit["layouts"]]
    return fit


def _engines(manifest: Manifest) -> list[dict]:
    files = manifest.data["files"]
    out: dict[tuple[str, str], dict] = {}
    for key in manifest.engine_keys():
        row = out.setdefault((key.graph, key.backend), {"graph": key.graph, "backend": key.backend, "dim": key.dim,
                                                        "buckets": [], "engine_files_bytes": 0})
        row["buckets"].append(key.bucket)
        row["engine_files_bytes"] += int(files.get(key.path, {}).get("bytes", 0))
    for row in out.values():
        g = manifest.data["graphs"].get(row["graph"], {})
        row["buckets"].sort()
        row["graph_path"] = g.get("path")
        row["graph_bytes"] = int(files.get(g.get("path"), {}).get("bytes", 0))
        row["data_path"] = g.get("data")
        row["data_bytes"] = int(files.get(g.get("data"), {}).get("bytes", 0)) if g.get("data") else 0
    return list(out.values())


def _calibration(manifest: Manifest, inputs: ReportInputs) -> dict:
    """The calibration shown: an explicit file, the engine directory's copy, or the drafter folder's file
    named by the manifest (older builds); its temperatures are compared with the engine's."""
    engine_t = [float(t) for t in manifest.runtime["confidence_temperature"]]
    data, source = inputs.calibration, inputs.calibration_source
    if data is None:
        rel = (manifest.data.get("calibration") or {}).get("path")
        drafter_dir = (manifest.data.get("source", {}).get("drafter") or {}).get("path")
        if rel:
            path, source = manifest.path_of(rel, "calibration.path"), rel
        elif drafter_dir and (Path(drafter_dir) / "calibration.json").is_file():
            path = Path(drafter_dir) / "calibration.json"
            source = f"{path} (the drafter folder named in the manifest)"
        else:
            path = None
        if path is not None:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                log.warning("report: calibration %s is not readable JSON (%s); left out", path, e)
                data, source = None, None
    engine_b = manifest.confidence_bias
    out = {"engine_temperatures": engine_t, "engine_biases": engine_b,
           "calibrated": any(abs(t - 1.0) > 1e-9 for t in engine_t) or any(engine_b),
           "source": source, "method": None, "file_temperatures": None, "matches_engine": None,
           "ece_before": None, "ece_after": None, "mean_ece_before": None, "mean_ece_after": None,
           "rounds": None, "bins": None, "reliability": None, "fitted_on": None}
    if isinstance(data, dict):
        temps = data.get("confidence_temperature")
        out.update({k: data.get(k) for k in ("method", "ece_before", "ece_after", "mean_ece_before",
                                             "mean_ece_after", "rounds", "bins", "reliability", "fitted_on")})
        out["file_temperatures"] = temps
        out["matches_engine"] = (isinstance(temps, list) and len(temps) == len(engine_t)
                                 and all(abs(float(a) - b) < 1e-6 for a, b in zip(temps, engine_t)))
    return out


def _acceptance(result: dict) -> dict:
    rows = [{"dataset": name, "domain": d.get("domain"), "samples": d.get("samples"),
             "acceptance_length": d.get("acceptance_length"), "rounds": d.get("rounds"),
             "mean_verify_len": d.get("mean_verify_len"), "tokens_per_s": d.get("tokens_per_s"),
             "identical": d.get("identical"), "conditional_acceptance": d.get("conditional_acceptance")}
            for name, d in result["datasets"].items()]
    cfg = result.get("config", {})
    return {"policy": result.get("policy"), "block_size": result.get("block_size"), "rows": rows,
            "domains": result.get("domains", {}), "macro": result.get("macro"), "identity": result.get("identity"),
            "max_new_tokens": cfg.get("max_new_tokens"), "temperature": cfg.get("temperature"),
            "engine_dir": result.get("engine_dir"), "drafter_trained": result.get("drafter_trained")}


def collect(manifest: Manifest, inputs: ReportInputs | None = None) -> dict:
    """The report's data (what `report.json` holds), from a loaded manifest and optional results.

    Raises:
        EngineDirError: the profile the manifest names is unreadable.
    """
    inputs = inputs or ReportInputs()
    d = manifest.data
    src = d.get("source", {})
    drafter = {k: v for k, v in (src.get("drafter") or {}).items() if k != "confidence_temperature"}
    r = manifest.runtime
    files = d["files"]
    return {
        "generated_unix": int(time.time()),
        "generator": {"name": "dspark-export", "version": __version__},
        "dir": str(manifest.root),
        "tool": d.get("tool", {}),
        "created_unix": d.get("created_unix"),
        "versions": d.get("versions", {}),
        "models": {"target": src.get("target", {}), "drafter": drafter},
        "runtime": {k: r.get(k) for k in ("block_size", "max_context", "vocab_size", "eos_token_ids",
                                          "drafter_trained", "chat_template")},
        "buckets": d.get("buckets", {}),
        "engines": _engines(manifest),
        "total_bytes": sum(int(f["bytes"]) for rel, f in files.items() if not rel.startswith(REPORT_DIR + "/")),
        "build_seconds": (d.get("build") or {}).get("seconds", {}),
        "profile": _profile(manifest),
        "calibration": _calibration(manifest, inputs),
        "acceptance": _acceptance(inputs.acceptance) if inputs.acceptance else None,
        "serve": ({"rows": inputs.serve["results"], "identity": inputs.serve.get("identity"),
                   "config": inputs.serve.get("config", {})} if inputs.serve else None),
        "peers": inputs.peers,
    }


# -- rendering ------------------------------------------------------------------------------------------

def _sps_figure(target_rows: list[dict], exact_rows: bool) -> bytes:
    """`figures.sps_figure` of the profile's target rows, SPS(B) as the scheduler reads it (`exact_rows`: ONNX
    Runtime's shared sessions run B rows, so a B between buckets is interpolated, `ThroughputProfile.exact_rows`)."""
    prof = ThroughputProfile.from_json({"target": target_rows}, exact_rows=exact_rows)
    every = np.arange(1, prof.max_tokens + 1)
    return figures.sps_figure(prof.buckets, prof.steps_per_s, every, prof.sps(every), exact_rows)


def _figures(data: dict) -> list[dict]:
    """[{"name", "file", "title", "caption", "png"}] in page order; absent data gives no figure."""
    out = []

    def add(name, title, caption, draw, *args):
        try:
            png = draw(*args)
        except Exception as e:  # a figure that cannot be drawn is reported on the page, not fatal
            log.warning("report: figure %s not drawn (%s: %s)", name, type(e).__name__, e)
            out.append({"name": name, "file": None, "title": title, "caption": f"not drawn: {e}", "png": None})
            return
        out.append({"name": name, "file": f"{name}.png", "title": title, "caption": caption, "png": png})

    p = data["profile"]
    if p and p["target"]:
        add("latency", "Target latency vs bucket B",
            "Median step latency of each target engine with a verification-shaped batch; bars span p10 to p90 "
            f"of {p.get('repeats')} timed runs after {p.get('warmup')} warm-up runs.",
            figures.latency_figure, p["target"], p.get("context_len"))
        exact = bool(p.get("exact_rows"))
        add("sps", "SPS(B) " + ("between buckets" if exact else "staircase"),
            "Steps per second of each bucket (points) and SPS(B) for every B as the scheduler reads it: "
            + ("a pass runs its own B rows, so a B between buckets is priced by interpolating the latency between "
               "theirs." if exact else "the fastest engine whose bucket holds B tokens."), _sps_figure, p["target"], exact)
    if p and p["drafter_block"]:
        add("drafter", "Drafter latency vs request count",
            "Median latency of the drafter block engine per request bucket R (bars: p10 to p90).",
            figures.drafter_figure, p["drafter_block"])
    c = data["calibration"]
    if c.get("reliability"):
        add("reliability", "Reliability diagram",
            "Observed vs predicted survival (all drafts up to the position accepted) per draft position, before "
            "(T = 1) and after Sequential Temperature Scaling, on the calibration file's replayed rounds.",
            figures.reliability_figure, c["reliability"])
    if c.get("ece_after"):
        add("ece", "ECE per position", "Expected calibration error of the survival per draft position "
            f"({c.get('bins') or '?'} equal-width bins), before and after STS.",
            figures.ece_figure, c.get("ece_before"), c["ece_after"])
    if data.get("acceptance_raw"):
        add("acceptance", "Acceptance", "τ per dataset and the conditional acceptance per draft position "
            "(bench acceptance).", figures.acceptance_figure, data["acceptance_raw"])
    if data.get("serve"):
        add("serve", "Serving", "Aggregate throughput vs per-user speed per policy, one point per concurrency "
            "(bench serve).", figures.serve_figure, {"results": data["serve"]["rows"]})
    if data.get("peers"):
        add("peers", "Peers", "Single-user greedy tokens/s of each system on the same prompts in one run "
            "(bench peers).", figures.peers_figure, data["peers"])
    return out


def _environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("dspark_export.report", "templates"),
                             autoescape=jinja2.select_autoescape(["html", "j2"]),
                             trim_blocks=True, lstrip_blocks=True)

    def size(n):
        if n is None:
            return "–"
        for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if n >= div:
                return f"{n / div:.1f} {unit}"
        return f"{n} B"

    def num(x, spec="{:.2f}"):
        return "–" if x is None else spec.format(x)

    def when(unix):
        return "–" if unix is None else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(unix))

    env.filters.update(size=size, num=num, when=when)
    return env


def render(data: dict, acceptance_raw: dict | None = None) -> tuple[str, dict[str, bytes]]:
    """(HTML page, {file name: PNG bytes}). The page inlines every figure as a data URI, so it stands alone.

    Args:
        data: `collect` output.
        acceptance_raw: the full `bench acceptance` result, for its figure.
    """
    figs = _figures({**data, "acceptance_raw": acceptance_raw})
    for f in figs:
        f["data_uri"] = ("data:image/png;base64," + base64.b64encode(f["png"]).decode()) if f["png"] else None
    html = _environment().get_template("report.html.j2").render(d=data, figures={f["name"]: f for f in figs})
    return html, {f["file"]: f["png"] for f in figs if f["png"]}


def _files(manifest: Manifest, inputs: ReportInputs) -> tuple[dict, dict[str, bytes]]:
    data = collect(manifest, inputs)
    html, pngs = render(data, inputs.acceptance)
    files = {HTML_NAME: html.encode("utf-8"), DATA_NAME: (json.dumps(data, indent=1) + "\n").encode(), **pngs}
    return data, files


def render_into_manifest(manifest: Manifest, inputs: ReportInputs | None = None) -> dict:
    """Write `<engine dir>/report/` and list it in the manifest (re-sealed). Returns the report data."""
    inputs = inputs or ReportInputs()
    data, files = _files(manifest, inputs)
    manifest.replace_folder(REPORT_DIR, files, section="report",
                            entry={"path": f"{REPORT_DIR}/{HTML_NAME}", "data": f"{REPORT_DIR}/{DATA_NAME}",
                                   "generated_unix": data["generated_unix"]})
    return data


def write_report(engine_dir: str | Path, out: str | Path | None = None, inputs: ReportInputs | None = None,
                 verify: bool = True) -> Path:
    """Render the report of `engine_dir` and return the HTML page's path.

    Args:
        engine_dir: a built engine directory (verified first unless `verify` is False).
        out: output folder; None = `<engine_dir>/report` (listed in the manifest). A folder elsewhere leaves
            the engine directory untouched; a folder inside the engine directory other than `report/` is refused
            (it would be an unlisted file there).
        inputs: optional benchmark results and calibration.
    Raises:
        EngineDirError: the directory is not a complete, intact engine directory.
        ConfigError: `out` is inside the engine directory but is not its report folder.
    """
    root = Path(engine_dir)
    manifest = Manifest.load(root, verify=verify)
    inputs = inputs or ReportInputs()
    default = (root / REPORT_DIR).resolve()
    target = default if out is None else Path(out).resolve()
    if target == default:
        try:
            render_into_manifest(manifest, inputs)
        except PermissionError as e:
            raise ConfigError(f"report: cannot write into {root} ({e.strerror}); pass --out with a folder "
                              "outside the engine directory") from None
        return default / HTML_NAME
    root_r = root.resolve()
    if target == root_r or root_r in target.parents:
        raise ConfigError(f"--out {out}: inside the engine directory {root} but not its {REPORT_DIR}/ folder; "
                          f"files there must be listed in {MANIFEST_NAME} (omit --out to write {REPORT_DIR}/, or "
                          "choose a folder outside)")
    _, files = _files(manifest, inputs)
    target.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (target / name).write_bytes(content)
    return target / HTML_NAME
