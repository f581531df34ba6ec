"""`dspark-export inspect`: what an engine directory holds, whether it is intact, and (optionally) whether
its graphs would import into TensorRT.

`inspect_engine_dir` verifies the directory first (every manifest file present with its size and sha256,
no file the manifest does not list), then reads the graphs without their weights
(`onnx.load(..., load_external_data=False)`), the engine keys, the runtime settings, the throughput
profile and the tokenizer files into one JSON-able summary. With `trt_compat` it lowers every graph to
the form the TensorRT backend builds (`engines/trt/lowering.py`: `dspark` nodes become plugin nodes, their
ONNX function bodies go) and runs `engines.trt.ops.check_model` over the lowered graphs; those findings
decide the verdict. The canonical graphs' function bodies are checked too and reported as "fallback":
they are what a parser would import without the lowering (TensorRT 10.0-10.6 always, later releases when
our plugins are not registered). Nothing here prints; `InspectReport.format_text` renders the
human-readable tables for the CLI.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from ..errors import BuildError, EngineDirError, ProfileError
from .manifest import MANIFEST_NAME, Manifest
from .sps import SpsFile, read_sps
from .trt.ops import OPSET_RANGE, TABLE_SOURCE, TABLE_TRT_VERSION, Finding, check_model, our_plugins

log = logging.getLogger(__name__)

__all__ = ["InspectReport", "inspect_engine_dir", "DEFAULT_TRT_MINOR"]

#: the TensorRT 10 minor release checked against unless told otherwise (the operator table's edition)
DEFAULT_TRT_MINOR = int(TABLE_TRT_VERSION.split(".")[1])


@dataclass
class InspectReport:
    """The summary of one engine directory and, when asked for, its TensorRT findings.

    Attributes:
        summary: JSON-able summary (see `inspect_engine_dir`).
        trt: JSON-able TensorRT section, or None when not asked for.
        findings: the TensorRT findings (empty when not asked for).
    """

    summary: dict
    trt: dict | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def blocking(self) -> list[Finding]:
        return [f for f in self.findings if f.blocking]

    @property
    def exit_code(self) -> int:
        """1 when a graph would not import into TensorRT (with our plugins), else 0."""
        return 1 if self.trt is not None and self.blocking else 0

    def to_dict(self) -> dict:
        out = dict(self.summary)
        if self.trt is not None:
            out["trt_compat"] = self.trt
        return out

    def format_text(self) -> str:
        return _format(self)



def _count_nodes(nodes) -> int:
    """Nodes including those inside If/Loop/Scan subgraphs (the ops' greedy/mixed branches)."""
    total = 0
    for node in nodes:
        total += 1
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                total += _count_nodes(attr.g.node)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                total += sum(_count_nodes(g.node) for g in attr.graphs)
    return total

def inspect_engine_dir(root: Path, *, trt_compat: bool = False, trt_version: int = 10,
                       trt_minor: int = DEFAULT_TRT_MINOR) -> InspectReport:
    """Summarise (and check) the engine directory at `root`.

    Summary keys: dir, schema_version, tool, created_unix, source, models, plugins, integrity, graphs, engines,
    buckets, runtime, profile, calibration, report, tokenizer, versions, build.

    Raises:
        EngineDirError: not an engine directory, a listed file missing or altered (size or sha256), a file
            the manifest does not list, or a graph that is not readable ONNX. One line naming the file.
        ConfigError: `trt_version` is not a tabled TensorRT major.

    `trt_minor` is the TensorRT 10 minor release targeted: below 9 the plugin nodes of the lowered graphs
    are blocking (ahead-of-time Python plugins arrived in 10.9; `MIN_TRT_VERSION`).
    """
    root = Path(root)
    manifest = Manifest.load(root, verify=True)
    _check_no_unlisted(manifest)
    data = manifest.data
    models = {name: _load_graph(manifest, name) for name in data["graphs"]}
    files = data["files"]
    summary = {
        "dir": str(root),
        "schema_version": data["schema_version"],
        "tool": data.get("tool", {}),
        "created_unix": data.get("created_unix"),
        "source": data.get("source", {}),
        "models": _models(data),
        "plugins": data.get("plugins", {}),
        "integrity": {"verified": True, "files": len(files) + 1,
                      "bytes": sum(int(f["bytes"]) for f in files.values())
                      + (root / MANIFEST_NAME).stat().st_size,
                      "checked": "every listed file present with its size and sha256; no unlisted file",
                      "folders": _folders(files)},
        "graphs": {name: _graph_summary(manifest, name, model) for name, model in models.items()},
        "engines": _engines(manifest),
        "buckets": data.get("buckets", {}),
        "runtime": {**data["runtime"], "drafter_context_window": manifest.drafter_context_window},  # checked
        "profile": _profile(manifest),
        "calibration": _calibration(manifest),
        "report": data.get("report"),
        "tokenizer": [{"path": rel, "bytes": info["bytes"]} for rel, info in sorted(files.items())
                      if rel.startswith("tokenizer/")],
        "versions": data.get("versions", {}),
        "build": data.get("build", {}),
    }
    report = InspectReport(summary)
    if trt_compat:
        report.findings, report.trt = _trt_section(models, data["runtime"], trt_version, trt_minor)
    return report


# -- integrity -------------------------------------------------------------------------------------------

def _check_no_unlisted(manifest: Manifest) -> None:
    listed = set(manifest.data["files"])
    for path in sorted(manifest.root.rglob("*")):
        if path.is_dir():
            continue
        rel = path.relative_to(manifest.root).as_posix()
        if rel != MANIFEST_NAME and rel not in listed:
            raise EngineDirError(f"{manifest.root}: file {rel!r} is not listed in the manifest (an engine directory "
                                 "holds only the files its manifest lists; remove it or rebuild)")


def _load_graph(manifest: Manifest, name: str) -> onnx.ModelProto:
    path = manifest.graph_path(name)
    try:
        return onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError) as e:
        raise EngineDirError(f"{path}: graphs.{name}: not a readable ONNX model ({type(e).__name__}: {e})") from e


# -- summary pieces --------------------------------------------------------------------------------------

def _value_info(vi: onnx.ValueInfoProto) -> dict:
    tt = vi.type.tensor_type
    shape = None
    if tt.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
    dtype = onnx.TensorProto.DataType.Name(tt.elem_type).lower() if tt.elem_type else "?"
    return {"name": vi.name, "dtype": dtype, "shape": shape}


def _graph_summary(manifest: Manifest, name: str, model: onnx.ModelProto) -> dict:
    entry = manifest.data["graphs"][name]
    files = manifest.data["files"]
    data_rel = entry.get("data")
    return {
        "path": entry["path"],
        "bytes": files.get(entry["path"], {}).get("bytes"),
        "data": data_rel,
        "data_bytes": files.get(data_rel, {}).get("bytes") if data_rel else None,
        "ir_version": model.ir_version,
        "opset_imports": {(o.domain or "ai.onnx"): o.version for o in model.opset_import},
        "nodes": _count_nodes(model.graph.node),
        "initializers": len(model.graph.initializer),
        "functions": [{"name": f"{f.domain}::{f.name}", "overload": f.overload or None, "nodes": _count_nodes(f.node)}
                      for f in model.functions],
        "inputs": [_value_info(v) for v in model.graph.input],
        "outputs": [_value_info(v) for v in model.graph.output],
    }


def _folders(files: dict) -> dict:
    """{top-level folder: {"files", "bytes"}} over the listed files."""
    out: dict[str, dict] = {}
    for rel, info in sorted(files.items()):
        folder = rel.split("/", 1)[0] if "/" in rel else "."
        f = out.setdefault(folder, {"files": 0, "bytes": 0})
        f["files"] += 1
        f["bytes"] += int(info["bytes"])
    return out


def _models(data: dict) -> dict:
    """The target and drafter: where they came from (manifest `source`) and their shapes (graph specs)."""
    src, graphs = data.get("source", {}), data.get("graphs", {})
    t_spec = graphs.get("target", {}).get("spec", {})
    d_spec = graphs.get("drafter_block", {}).get("spec", {})
    target = {**src.get("target", {}), **{k: t_spec[k] for k in ("num_layers", "hidden_size", "num_heads",
                                                                  "num_kv_heads", "head_dim", "vocab_size",
                                                                  "max_position_embeddings", "tap_layer_ids")
                                          if k in t_spec}}
    drafter = {k: v for k, v in src.get("drafter", {}).items() if k != "confidence_temperature"}
    drafter.update({k: d_spec[k] for k in ("num_layers", "hidden_size", "feature_size", "block_size", "markov_rank",
                                           "has_confidence", "mask_token_id", "lm_head_dtype", "draft_vocab_size",
                                           "layer_weights") if k in d_spec})
    return {"target": target, "drafter": drafter}


def _calibration(manifest: Manifest) -> dict:
    """The STS temperatures the engine applies and, when the directory keeps the drafter's calibration.json
    (`build` copies it to drafter/calibration.json), the fit's ECE before/after."""
    temps = [float(t) for t in manifest.runtime["confidence_temperature"]]
    biases = manifest.confidence_bias
    out = {"temperatures": temps, "biases": biases,
           "calibrated": any(abs(t - 1.0) > 1e-9 for t in temps) or any(biases), "path": None,
           "method": None, "rounds": None, "ece_before": None, "ece_after": None, "mean_ece_before": None,
           "mean_ece_after": None, "reliability_bins": False}
    cal = manifest.calibration()
    if cal is not None:
        out.update(path=manifest.data["calibration"]["path"], method=cal.get("method"), rounds=cal.get("rounds"),
                   ece_before=cal.get("ece_before"), ece_after=cal.get("ece_after"),
                   mean_ece_before=cal.get("mean_ece_before"), mean_ece_after=cal.get("mean_ece_after"),
                   reliability_bins=bool(cal.get("reliability")))
        from ..modeling.loading import temperature_only

        plain = temperature_only(cal)
        out["temperature_only"] = ({"temperatures": plain.get("confidence_temperature"),
                                    "mean_ece_after": plain.get("mean_ece_after")} if plain else None)
    return out


def _engines(manifest: Manifest) -> dict:
    out: dict[str, dict] = {}
    for key in manifest.engine_keys():
        e = out.setdefault(key.graph, {"backend": key.backend, "dim": key.dim, "buckets": []})
        if (e["backend"], e["dim"]) != (key.backend, key.dim):  # a second backend: keep them apart
            e = out.setdefault(f"{key.graph}@{key.backend}", {"backend": key.backend, "dim": key.dim, "buckets": []})
        e["buckets"].append(key.bucket)
    for e in out.values():
        e["buckets"].sort()
    return out


def _profile(manifest: Manifest) -> dict | None:
    entry = manifest.data.get("profile")
    if not entry or not entry.get("path"):
        return None
    try:
        sps = read_sps(manifest.path_of(entry["path"], "profile.path"))
    except ProfileError as e:
        raise EngineDirError(str(e)) from e
    rows = [{k: row.get(k) for k in ("B", "median_ms", "p10_ms", "p90_ms", "sps")} for row in sps.get("target", [])]
    return {"path": entry["path"], "context_len": sps.get("context_len"), "warmup": sps.get("warmup"),
            "repeats": sps.get("repeats"), "layout": sps.get("layout"), "device": sps.device,
            "target": rows, "warnings": sps.warnings, "attention": attention_summary(sps)}


def attention_summary(sps: SpsFile) -> dict | None:
    """The layout-cost fit of a read sps.json, checked as the runtime reads it: {"ms_per_row_entry",
    "ms_per_slot_entry", "max_error_pct" (None when absent), "underdetermined", "layouts": [rows that are
    objects]}; None without a fit.

    Raises:
        EngineDirError: the fit (or a target row's S, Q, P under it) is malformed; names the file and the field.
    """
    fit = sps.get("attention")
    if not fit:
        return None
    try:
        sps.throughput()
    except ProfileError as e:
        raise EngineDirError(str(e)) from e
    err = fit.get("max_error_pct")
    layouts = fit.get("layouts")
    return {"ms_per_row_entry": float(fit["ms_per_row_entry"]), "ms_per_slot_entry": float(fit["ms_per_slot_entry"]),
            "max_error_pct": float(err) if isinstance(err, (int, float)) and not isinstance(err, bool) else None,
            "underdetermined": bool(fit.get("underdetermined")),
            "layouts": [r for r in layouts if isinstance(r, dict)] if isinstance(layouts, list) else []}


# -- TensorRT ------------------------------------------------------------------------------------------

def _trt_section(models: dict, runtime: dict, trt_version: int, trt_minor: int) -> tuple[list[Finding], dict]:
    """Check the lowered graphs (what the TensorRT backend builds) and, for the record, the canonical graphs'
    function bodies (what a parser would import without the lowering and without our plugins)."""
    from ..plugins.common.tensorrt_spec import MIN_TRT_VERSION
    from .trt.lowering import lower_model

    plugins = our_plugins()
    dims = {"V": int(runtime["vocab_size"])}  # the contract's symbolic vocabulary dim
    findings: list[Finding] = []
    plugin_nodes: list[dict] = []
    lowering: dict[str, dict] = {}
    opsets = {}
    for name, model in models.items():
        opsets[name] = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
        # canonical graph: only the findings inside plugin function bodies add anything the lowered graph lacks
        findings += [f for f in check_model(model, name, trt_major=trt_version, plugins=plugins, dims=dims)
                     if f.fallback]
        try:
            lowered = lower_model(model, name)
        except BuildError as e:
            findings.append(Finding(name, "", "", f"lowering failed: {e}", rule="lowering"))
            continue
        lowering[name] = lowered.summary()
        nodes: list[dict] = []
        findings += check_model(lowered.model, name, trt_major=trt_version, plugins=plugins, dims=dims,
                                plugin_nodes=nodes)
        for p in nodes:
            p["fields"] = next((x["fields"] for x in lowered.plugin_nodes if x["node"] == p["node"]), {})
            if (trt_version, trt_minor) < MIN_TRT_VERSION:
                findings.append(Finding(name, p["node"], p["op"], f"the ahead-of-time Python plugin needs TensorRT "
                                        f">= {MIN_TRT_VERSION[0]}.{MIN_TRT_VERSION[1]}, targeted "
                                        f"{trt_version}.{trt_minor}", rule="plugin-trt-minor"))
        plugin_nodes += nodes
    blocking = [f for f in findings if f.blocking]
    return findings, {
        "trt_version": trt_version,
        "trt_minor": trt_minor,
        "table": {"source": TABLE_SOURCE, "trt_version": TABLE_TRT_VERSION, "opset_range": list(OPSET_RANGE)},
        "opsets": opsets,
        "plugins": plugins,
        "plugin_nodes": plugin_nodes,
        "lowering": lowering,
        "verdict": "unsupported" if blocking else "supported",
        "counts": {"blocking": len(blocking),
                   "fallback_errors": sum(f.severity == "error" and bool(f.fallback) for f in findings),
                   "warnings": sum(f.severity == "warning" for f in findings)},
        "findings": [f.to_dict() for f in findings],
    }


# -- text ---------------------------------------------------------------------------------------------

def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _shape(v: dict) -> str:
    return "[" + ",".join(str(d) for d in v["shape"]) + "]" if v["shape"] is not None else "[?]"


def _group_io(values: list[dict]) -> list[list[str]]:
    """One row per value; a per-layer family (`past_key.0` … `past_key.29`, possibly interleaved with another
    family) of one dtype and shape folds into one row `past_key.{0..29}` at its first member's place."""
    families: dict[tuple, list[int]] = {}
    keys = []
    for v in values:
        m = re.fullmatch(r"(.*\.)(\d+)", v["name"])
        key = (m.group(1), v["dtype"], str(v["shape"])) if m else (v["name"], None, None)
        keys.append(key)
        if m:
            families.setdefault(key, []).append(int(m.group(2)))
    rows, done = [], set()
    for v, key in zip(values, keys):
        idx = families.get(key)
        if idx is not None and len(idx) > 1 and sorted(idx) == list(range(min(idx), max(idx) + 1)):
            if key in done:
                continue
            done.add(key)
            rows.append([f"{key[0]}{{{min(idx)}..{max(idx)}}}", v["dtype"], _shape(v)])
        else:
            rows.append([v["name"], v["dtype"], _shape(v)])
    return rows


def _buckets(b: list[int]) -> str:
    return "{" + ",".join(str(x) for x in b) + "}"


def _format(report: InspectReport) -> str:
    s = report.summary
    out: list[str] = []
    tool = s.get("tool", {})
    integ = s["integrity"]
    out.append(f"engine directory  {s['dir']}")
    out.append(f"  manifest schema {s['schema_version']}, built by {tool.get('name', '?')} {tool.get('version', '?')}; "
               f"integrity ok: {integ['files']} files, {_size(integ['bytes'])}, sizes and sha256 match, "
               "no unlisted files")
    folders = ", ".join(f"{k} {v['files']} ({_size(v['bytes'])})" for k, v in integ.get("folders", {}).items())
    if folders:
        out.append(f"  files    {folders}")
    models = s.get("models") or {}
    t, d = models.get("target", {}), models.get("drafter", {})
    tdesc = ", ".join(x for x in (t.get("model_type"), f"{t['num_layers']} layers" if "num_layers" in t else None,
                                  f"hidden {t['hidden_size']}" if "hidden_size" in t else None,
                                  f"heads {t['num_heads']}/{t['num_kv_heads']} kv × {t['head_dim']}"
                                  if {"num_heads", "num_kv_heads", "head_dim"} <= set(t) else None,
                                  f"vocab {t['vocab_size']}" if "vocab_size" in t else None,
                                  "embedded default" if t.get("embedded_default") else None) if x)
    out.append(f"  target   {t.get('path', '?')} ({tdesc})")
    trained = "trained" if d.get("is_trained") else "NOT trained"
    ddesc = ", ".join(f"{k} {d[k]}" for k in ("kind", "path", "seed", "num_layers", "block_size", "markov_rank",
                                              "feature_size") if d.get(k) is not None)
    conf = "confidence head" if d.get("has_confidence") else "no confidence head"
    conf += f", LM head {d.get('lm_head_dtype', 'float32')}"
    conf += f", draft vocabulary {d['draft_vocab_size'] or 'full'}" if d.get("draft_vocab_size") is not None else ""
    conf += f", layers {d['layer_weights']}" if d.get("layer_weights") else ""
    out.append(f"  drafter  {trained} ({ddesc}, {conf}); target layers {d.get('target_layer_ids', '?')}")
    approx = d.get("approximations")
    if approx is not None:
        out.append("  drafting " + ("; ".join(f"approximation {a.get('name')}={a.get('value')}: {a.get('effect')}"
                                              for a in approx) if approx
                                    else "exact (no approximation: drafts as the checkpoint's float32 weights)"))
    r = s["runtime"]
    out.append(f"  runtime  block_size {r['block_size']}, max_context {r['max_context']}, vocab {r['vocab_size']}, "
               f"eos {r['eos_token_ids']}, mask token {r.get('mask_token_id', '-')}, "
               f"chat template {'yes' if r.get('chat_template') else 'no'}, "
               f"confidence temperature {r['confidence_temperature']}, drafter context "
               + ("every row" if not r.get("drafter_context_window") else
                  "first {} + last {} rows".format(*r["drafter_context_window"])))

    out.append("")
    out.append("graphs")
    rows = [["graph", "file", "size", "data", "nodes", "opsets", "functions"]]
    for name, g in s["graphs"].items():
        fns = ", ".join(f"{f['name']}{'[' + f['overload'] + ']' if f['overload'] else ''} ({f['nodes']} nodes)"
                        for f in g["functions"]) or "-"
        rows.append([name, g["path"], _size(g["bytes"]), _size(g["data_bytes"]) if g["data"] else "-",
                     str(g["nodes"]), " ".join(f"{k} {v}" for k, v in g["opset_imports"].items()), fns])
    out += _table(rows)
    for name, g in s["graphs"].items():
        out.append(f"  {name}: {len(g['inputs'])} inputs, {len(g['outputs'])} outputs")
        io = [["in", *row] for row in _group_io(g["inputs"])] + [["out", *row] for row in _group_io(g["outputs"])]
        out += _table(io, indent="    ")

    out.append("")
    out.append("engines")
    rows = [["graph", "backend", "dim", "buckets"]]
    rows += [[name, e["backend"], e["dim"], _buckets(e["buckets"])] for name, e in s["engines"].items()]
    out += _table(rows)

    out.append("")
    p = s.get("profile")
    if p is None:
        out.append("profile  none recorded")
    else:
        out.append(f"profile  {p['path']}: context {p['context_len']} tokens, {p['warmup']} warm-up + {p['repeats']} "
                   f"timed runs, {p.get('device', {}).get('backend', '?')} "
                   f"{','.join(p.get('device', {}).get('providers', []))}")
        rows = [["B", "median ms", "p10 ms", "p90 ms", "SPS"]]
        rows += [[str(x["B"]), f"{x['median_ms']:.3f}", f"{x['p10_ms']:.3f}", f"{x['p90_ms']:.3f}", f"{x['sps']:.2f}"]
                 for x in p["target"]]
        out += _table(rows)
        a = p.get("attention")
        if not a:
            out.append("  layout cost: not measured (a profile from before it; `dspark-export profile` re-measures)")
        elif a["underdetermined"]:
            out.append(f"  layout cost: not used (its {len(a['layouts'])} layouts could not separate the coefficients)")
        else:
            err = "?" if a["max_error_pct"] is None else f"{a['max_error_pct']:g}"
            out.append(f"  layout cost: c_a {a['ms_per_row_entry']:.3g} ms per query row per KV entry, c_kv "
                       f"{a['ms_per_slot_entry']:.3g} ms per slot per KV entry, largest error {err} % "
                       f"on {len(a['layouts'])} layouts")
        out += [f"  warning: {w}" for w in p["warnings"]] or ["  warnings: none"]

    out.append("")
    c = s.get("calibration") or {}
    if c:
        line = (f"calibration  STS temperatures {c['temperatures']}"
                + (f", biases {c['biases']}" if any(c.get("biases") or []) else "") if c["calibrated"]
                else "calibration  none (all confidence temperatures 1)")
        if c.get("path"):
            ece = (f"; mean ECE {c['mean_ece_before']:.4f} -> {c['mean_ece_after']:.4f}"
                   if c.get("mean_ece_before") is not None and c.get("mean_ece_after") is not None else "")
            line += (f"; {c['path']} ({c.get('method') or '?'}, {c.get('rounds') or '?'} rounds{ece}"
                     f"{', reliability bins' if c.get('reliability_bins') else ''})")
        out.append(line)
        plain = c.get("temperature_only")
        if c.get("path") and any(c.get("biases") or []):
            out.append("  for sigmoid(z/T) servers (export-profile): " + (
                f"temperature-only STS {plain['temperatures']}, mean ECE {plain['mean_ece_after']}" if plain
                else "no temperature-only fit recorded (re-run scripts/train_drafter.py calibrate)"))
    rep = s.get("report")
    out.append(f"report     {rep['path']}" if rep else "report     none (dspark-export report DIR writes one)")
    out.append("tokenizer  " + ", ".join(f"{t['path'].removeprefix('tokenizer/')} ({_size(t['bytes'])})"
                                         for t in s["tokenizer"]))
    out.append("versions   " + ", ".join(f"{k} {v}" for k, v in s.get("versions", {}).items()))
    plug = s.get("plugins") or {}
    out.append("plugins    " + (", ".join(f"{k} v{v}" for k, v in plug.items()) or "none"))

    if report.trt is not None:
        out.append("")
        out += _format_trt(report)
    return "\n".join(out)


def _format_trt(report: InspectReport) -> list[str]:
    from ..plugins.common.tensorrt_spec import MIN_TRT_VERSION

    trt = report.trt
    lo, hi = trt["table"]["opset_range"]
    out = [f"TensorRT {trt['trt_version']} compatibility (table: {trt['table']['source']})"]
    for name, opset in trt["opsets"].items():
        ok = opset is not None and lo <= opset <= hi
        out.append(f"  {name}: opset {opset} {'inside' if ok else 'OUTSIDE'} the tabled range {lo}-{hi}")
    for name, low in trt.get("lowering", {}).items():
        if low["dropped_functions"]:
            out.append(f"  lowered {name}: dropped local functions {', '.join(low['dropped_functions'])}")
        for head in low.get("int8_heads", []):
            out.append(f"  lowered {name}: int8 LM head → weight-only DequantizeLinear + MatMul ({head})")
    for p in trt["plugin_nodes"]:
        fields = ", ".join(f"{k}={v}" for k, v in p.get("fields", {}).items())
        out.append(f"  plugin node {p['graph']}: {p['node']} -> {p['op']} v{p['version']} (TensorRT plugin "
                   f"{p['op'].split('::')[-1]} in namespace {p['op'].split('::')[0]}, aot=1; {fields}; needs "
                   f"TensorRT >= {MIN_TRT_VERSION[0]}.{MIN_TRT_VERSION[1]} with "
                   "dspark_export.plugins.tensorrt_plugins registered)")

    def rows_of(fs: list[Finding]) -> list[str]:
        rows = [["graph", "node", "op", "where", "reason"]]
        rows += [[f.graph, f.node, f.op, f.scope or "graph", f.reason] for f in fs]
        return _table(rows, indent="    ") if fs else ["    none"]

    blocking = report.blocking
    fallback = [f for f in report.findings if f.severity == "error" and f.fallback]
    warnings = [f for f in report.findings if f.severity == "warning"]
    out.append(f"  lowered graphs (what the TensorRT backend builds), would not parse ({len(blocking)}):")
    out += rows_of(blocking)
    by_plugin: dict[str, list[Finding]] = {}
    for f in fallback:
        by_plugin.setdefault(f.fallback, []).append(f)
    out.append(f"  canonical graphs without the lowering: errors inside the ops' ONNX function bodies "
               f"({len(fallback)}; what TensorRT 10.0-10.6, or a later release without our plugins registered, would import; the "
               "lowered graphs have no function bodies):")
    out += rows_of(fallback)
    out.append(f"  warnings ({len(warnings)}):")
    out += rows_of(warnings)
    out.append(f"  verdict: {trt['verdict']} on TensorRT {trt['trt_version']}.{trt.get('trt_minor', '?')} for the "
               f"lowered graphs with our plugins registered ({len(blocking)} blocking; {len(fallback)} errors in "
               f"the canonical graphs' function bodies, which block only without the lowering; "
               f"{len(warnings)} warnings)")
    return out
