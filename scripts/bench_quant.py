"""Weight formats side by side: one target step per bucket, where a step's time goes, and `ar` decoding.

Given engine directories of the same model built with different `--weights` (fp32, int8, int4):

- ``step``: one target pass per bucket B (the profiler's verification-shaped feed at `--context`), timed
  through the runtime's own engines (`EngineSet`, shared prepacked session, `--threads`), interleaved over
  the formats round after round, so a change of machine load falls on every format alike; median, p10 and
  t(B)/t(1) per format, and each format's sps.json (as built: SPS(B) and the layout-cost fit) beside it.
- ``breakdown``: one B = 1 step under ONNX Runtime's profiler: the share of kernel time in weight-streaming
  ops (MatMulNBits / MatMul / Gemm with a weight), attention (everything under ``/attn/`` but its
  projections, and the masks shared by every layer), other ops, and host time (the runner's wall time
  minus ORT's model_run: Python, feed checks, output copies).
- ``decode``: greedy `ar` tokens/s on chat prompts (the first `--per-dataset` prompts of each dataset), 128
  new tokens, prompt 1 on every format, then prompt 2, ..., `--repeats` times; and each format's greedy
  agreement with the first format (fp32): the first generated position where the tokens differ.

Writes ``<out>/quant.json`` and ``<out>/quant.md``. Example (reports/quant/ was made with this)::

    python scripts/bench_quant.py --engine-dir fp32=/tmp/eng/fp32 --engine-dir int8=/tmp/eng/int8 \\
        --engine-dir int4=/tmp/eng/int4 --out reports/quant
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from dspark_export.plugins import cpu_ops


def _engines(path: Path, threads: int):
    from dspark_export.engines.engine_set import EngineSet

    return EngineSet.open(path, verify=False, threads=threads).activate_all()


def _target_runner(engines, bucket: int):
    return engines.runner("target", bucket)


def step_table(dirs: dict[str, Path], buckets: list[int], context: int, rounds: int, threads: int) -> dict:
    from dspark_export.engines.profiler import engine_feed

    engines = {name: _engines(path, threads) for name, path in dirs.items()}
    feeds = {name: {b: engine_feed(e.manifest.data["graphs"], "target", b, context) for b in buckets}
             for name, e in engines.items()}
    times = {name: {b: [] for b in buckets} for name in dirs}
    for name, e in engines.items():  # warm-up
        for b in buckets:
            for _ in range(2):
                _target_runner(e, b).infer(feeds[name][b])
    for _ in range(rounds):
        for b in buckets:
            for name, e in engines.items():
                runner = _target_runner(e, b)
                t0 = time.perf_counter()
                runner.infer(feeds[name][b])
                times[name][b].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for name in dirs:
        med = {b: float(np.median(times[name][b])) for b in buckets}
        out[name] = {"median_ms": {b: round(med[b], 2) for b in buckets},
                     "p10_ms": {b: round(float(np.percentile(times[name][b], 10)), 2) for b in buckets},
                     "p90_ms": {b: round(float(np.percentile(times[name][b], 90)), 2) for b in buckets},
                     "t_over_t1": {b: round(med[b] / med[buckets[0]], 3) for b in buckets}}
    return out


def _category(node: str, op: str) -> str:
    if op in ("MatMulNBits", "MatMulW4A8", "Gemm") or "_proj" in node or "/lm_head" in node:
        return "weights"
    if "/attn" in node:
        return "attention"
    return "other"


def breakdown(path: Path, context: int, threads: int, runs: int) -> dict:
    """Share of one B = 1 step per category (see the module docstring), from ORT's profiler."""
    import onnxruntime as ort

    from dspark_export.engines.manifest import Manifest
    from dspark_export.engines.ort.runner import WeightStore, session_options
    from dspark_export.engines.profiler import engine_feed

    manifest = Manifest.load(path, verify=False)
    graph = path / manifest.data["graphs"]["target"]["path"]
    feed = engine_feed(manifest.data["graphs"], "target", 1, context)
    weights = WeightStore()
    so = session_options({}, threads, "target", prepack=True)
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort")
    for name in weights.names_for(graph):
        so.add_initializer(name, weights.value(name))
    cpu_ops.register_for(so, graph)
    sess = ort.InferenceSession(str(graph), so, providers=["CPUExecutionProvider"])
    outputs = [o.name for o in sess.get_outputs()]
    for _ in range(3):
        sess.run(outputs, feed)
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dict(zip(outputs, sess.run(outputs, dict(feed))))
        walls.append((time.perf_counter() - t0) * 1e3)
    events = json.loads(Path(sess.end_profiling()).read_text())
    model_runs = [e["dur"] / 1e3 for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-runs:]
    kernels = collections.Counter()
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_run = len(nodes) // (runs + 3)
    for e in nodes[-per_run * runs:]:
        kernels[_category(e["name"], e["args"].get("op_name", ""))] += e["dur"] / 1e3 / runs
    wall, run = float(np.median(walls)), float(np.median(model_runs))
    kernel_total = sum(kernels.values())
    parts = {**{k: kernels[k] for k in ("weights", "attention", "other")},
             "executor": max(run - kernel_total, 0.0), "host": max(wall - run, 0.0)}
    return {"wall_ms": round(wall, 2), "model_run_ms": round(run, 2), "nodes": per_run,
            "ms": {k: round(v, 2) for k, v in parts.items()},
            "share": {k: round(v / wall, 3) for k, v in parts.items()}}


def _prompts(datasets_dir: Path, datasets: list[str], per_dataset: int) -> list[str]:
    from dspark_export.datasets import read_dataset

    out = []
    for name in datasets:
        out += read_dataset(datasets_dir / f"{name}.jsonl")[:per_dataset]
    return out


def decode(dirs: dict[str, Path], prompts: list[str], max_new: int, repeats: int, threads: int) -> dict:
    from dspark_export.bench.peers import first_divergence
    from dspark_export.runtime.api import Runtime
    from dspark_export.runtime.request import SamplingParams

    rts = {name: Runtime.open(path, policy="ar", threads=threads) for name, path in dirs.items()}
    first = next(iter(rts.values()))
    ids = [first.encode(p, True) for p in prompts]
    params = SamplingParams(max_new_tokens=max_new)
    for rt in rts.values():
        rt.generate_ids([ids[0]], [SamplingParams(max_new_tokens=4)])
    tokens = {name: [None] * len(ids) for name in dirs}
    walls = {name: [0.0] * len(ids) for name in dirs}   # last repeat's wall time per prompt
    per_repeat = {name: [] for name in dirs}
    for _ in range(repeats):
        acc = {name: [0, 0.0] for name in dirs}
        for i, prompt in enumerate(ids):
            for name, rt in rts.items():
                t0 = time.perf_counter()
                [r] = rt.generate_ids([prompt], [params])
                walls[name][i] = time.perf_counter() - t0
                acc[name][1] += walls[name][i]
                acc[name][0] += len(r.token_ids)
                tokens[name][i] = r.token_ids
                print(f"decode {name} prompt {i}: {len(r.token_ids)} tokens in {walls[name][i]:.2f} s", flush=True)
        for name in dirs:
            per_repeat[name].append(acc[name][0] / acc[name][1])
    ref = next(iter(dirs))
    out = {}
    for name in dirs:
        per_prompt = [len(a) / ta / (len(b) / tb) for a, ta, b, tb in
                      zip(tokens[name], walls[name], tokens[ref], walls[ref])]
        div = [first_divergence(b, a) for a, b in zip(tokens[ref], tokens[name])]
        out[name] = {"tokens_per_s": round(float(np.median(per_repeat[name])), 2),
                     "per_repeat": [round(x, 2) for x in per_repeat[name]],
                     "ratio_to_first": [round(x / y, 3) for x, y in zip(per_repeat[name], per_repeat[ref])],
                     "per_prompt_ratio_p10_p50_p90": [round(float(q), 3) for q in
                                                      np.percentile(per_prompt, [10, 50, 90])],
                     "first_divergence": div,
                     "identical_prompts": sum(d is None for d in div)}
    return out


def _sps(path: Path) -> dict:
    sps = json.loads((path / "profile" / "sps.json").read_text())
    t1 = sps["target"][0]["median_ms"]
    return {"median_ms": {r["B"]: r["median_ms"] for r in sps["target"]},
            "t_over_t1": {r["B"]: round(r["median_ms"] / t1, 3) for r in sps["target"]},
            "layout_cost": {k: sps.get("attention", {}).get(k) for k in
                            ("ms_per_row_entry", "ms_per_slot_entry", "max_error_pct")}}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def markdown(result: dict) -> str:
    names = list(result["engine_dirs"])
    lines = [f"# Target weight formats ({result['machine']})", "", f"Command: `{result['command']}`", "",
             "The formats' sessions share one process, and their thread pools spin against each other: read "
             "ratios within one table, not absolute times.", ""]
    lines += ["| format | engine dir MiB | target .data MiB |", "|---|---:|---:|"]
    for n in names:
        lines.append(f"| {n} | {result['size_mib'][n]['dir']:.0f} | {result['size_mib'][n]['target_data']:.0f} |")
    if "step" in result:
        buckets = list(next(iter(result["step"].values()))["median_ms"])
        lines += ["", "## One target step (interleaved), median ms and t(B)/t(1)", "",
                  "| format | " + " | ".join(f"B={b}" for b in buckets) + " |",
                  "|---|" + "---:|" * len(buckets)]
        for n in names:
            s = result["step"][n]
            lines.append(f"| {n} | " + " | ".join(f"{s['median_ms'][b]:.1f} ({s['t_over_t1'][b]:.2f})"
                                                  for b in buckets) + " |")
    lines += ["", "## As profiled at build time (sps.json): t(B)/t(1) and the layout-cost fit", "",
              "| format | t(1) ms | " + " | ".join(f"B={b}" for b in result["sps"][names[0]]["t_over_t1"])
              + " | c_a ms/(row·entry) | c_kv ms/(slot·entry) | fit max err % |",
              "|---|---:|" + "---:|" * (len(result["sps"][names[0]]["t_over_t1"]) + 3)]
    for n in names:
        s = result["sps"][n]
        lc = s["layout_cost"]
        t1 = next(iter(s["median_ms"].values()))
        lines.append(f"| {n} | {t1:.1f} | " + " | ".join(f"{v:.2f}" for v in s["t_over_t1"].values())
                     + f" | {lc['ms_per_row_entry']:.2e} | {lc['ms_per_slot_entry']:.2e} | {lc['max_error_pct']} |")
    if "breakdown" in result:
        lines += ["", "## Where a B = 1 step goes (ORT profiler, median of the runs)", "",
                  "| format | wall ms | nodes | weights | attention | other ops | executor | host |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for n in names:
            b = result["breakdown"][n]
            sh = b["share"]
            lines.append(f"| {n} | {b['wall_ms']:.1f} | {b['nodes']} | " + " | ".join(
                f"{b['ms'][k]:.1f} ({100 * sh[k]:.0f} %)" for k in ("weights", "attention", "other", "executor", "host"))
                + " |")
    if "decode" in result:
        d = result["decode"]
        lines += ["", f"## `ar` decoding: {result['decode_setup']}", "",
                  "| format | tokens/s (median of repeats) | per repeat | ratio to " + names[0]
                  + " per repeat | per-prompt ratio p10/p50/p90 | prompts identical to " + names[0]
                  + " | first divergence (generated position) |",
                  "|---|---:|---|---|---|---:|---|"]
        for n in d:
            r = d[n]
            div = ", ".join("-" if x is None else str(x) for x in r["first_divergence"])
            lines.append(f"| {n} | {r['tokens_per_s']:.1f} | {r['per_repeat']} | {r['ratio_to_first']} | "
                         f"{r['per_prompt_ratio_p10_p50_p90']} | "
                         f"{r['identical_prompts']}/{len(r['first_divergence'])} | {div} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine-dir", action="append", required=True, metavar="NAME=DIR",
                   help="a format's engine directory; the first is the reference (fp32)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--buckets", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--breakdown-runs", type=int, default=10)
    p.add_argument("--datasets-dir", type=Path, default=Path("/work/shared/eval_datasets"))
    p.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    p.add_argument("--per-dataset", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decode-formats", default="", help="comma list of formats to decode with (default: all)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: step,breakdown,decode")
    args = p.parse_args(argv)
    dirs = dict(item.split("=", 1) for item in args.engine_dir)
    dirs = {k: Path(v) for k, v in dirs.items()}
    skip = set(filter(None, args.skip.split(",")))
    result = {"command": "python scripts/bench_quant.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} threads",
              "engine_dirs": {k: str(v) for k, v in dirs.items()},
              "size_mib": {k: {"dir": _size(v) / 2 ** 20,
                               "target_data": (v / "graphs" / "target.onnx.data").stat().st_size / 2 ** 20}
                           for k, v in dirs.items()},
              "sps": {k: _sps(v) for k, v in dirs.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = args.out / "quant.json"
    if earlier.is_file():  # parts skipped now keep their earlier results (and that run's command)
        old = json.loads(earlier.read_text())
        for part in ("step", "breakdown", "decode", "decode_setup"):
            if part.split("_")[0] in skip and part in old:
                result[part] = old[part]
                result.setdefault("earlier_commands", {})[part] = old["command"]

    def save():
        (args.out / "quant.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "quant.md").write_text(markdown(result))

    if "step" not in skip:
        result["step"] = step_table(dirs, [int(b) for b in args.buckets.split(",")], args.context, args.rounds,
                                    args.threads)
        save()
    if "breakdown" not in skip:
        result["breakdown"] = {k: breakdown(v, args.context, args.threads, args.breakdown_runs) for k, v in dirs.items()}
        save()
    if "decode" not in skip:
        prompts = _prompts(args.datasets_dir, args.datasets.split(","), args.per_dataset)
        result["decode_setup"] = (f"{len(prompts)} chat prompts ({args.per_dataset} per dataset of {args.datasets}), "
                                  f"{args.max_new_tokens} new tokens, greedy, {args.threads} threads, "
                                  f"{args.repeats} interleaved repeats")
        names = [n for n in args.decode_formats.split(",") if n] or list(dirs)
        result["decode"] = decode({n: dirs[n] for n in names}, prompts, args.max_new_tokens, args.repeats,
                                  args.threads)
        save()
    save()
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
