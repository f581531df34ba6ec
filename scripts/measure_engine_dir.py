#!/usr/bin/env python
"""Measure an engine directory the way the walking-skeleton issue asks, and check greedy identity.

Reports (JSON on stdout, a table on stderr):
- resident memory (RSS) before and after loading every engine;
- per prompt (math, code, chat from the eval datasets, chat template on): `ar` and `fixed:K` tokens/s,
  τ, and whether the greedy token ids are identical;
- decode step time at several context lengths: median wall time of one runtime step (draft, verify,
  commit) for a single request whose context is that long, for `ar` and `fixed:K`.

Usage:
    python scripts/measure_engine_dir.py --engine-dir engines/smollm2 --datasets-dir ../shared/eval_datasets \
        --max-new-tokens 128 --policy fixed:7 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import psutil

from dspark_export.runtime.api import Runtime
from dspark_export.runtime import faults
from dspark_export.runtime.request import SamplingParams

DATASETS = [("gsm8k", "math"), ("math500", "math"), ("humaneval", "code"), ("mbpp", "code"), ("mt-bench", "chat")]


def first_turns(datasets_dir: Path) -> list[tuple[str, str, str]]:
    """(dataset, domain, first user turn) of the first row of each dataset."""
    out = []
    for name, domain in DATASETS:
        with open(datasets_dir / f"{name}.jsonl", encoding="utf-8") as f:
            out.append((name, domain, json.loads(f.readline())["turns"][0]))
    return out


def step_time_ms(rt: Runtime, policy: str, context: int, steps: int) -> float:
    """Median wall time of one runtime step (draft → verify → commit), in ms, for one request whose
    context is `context` tokens long. Times the step inside its fault-isolation wrapper
    (`runtime.faults.run_isolated`: `Generator.speculative_step` and its commit) per step; the median
    leaves the prefill step out."""
    rt.set_policy(policy)
    filler = rt.tokenizer("The quick brown fox jumps over the lazy dog. ", add_special_tokens=False)["input_ids"]
    prompt = (filler * (context // len(filler) + 1))[:context]
    times = []
    original = faults.run_isolated

    def timed(*args):
        t0 = time.perf_counter()
        original(*args)
        times.append(time.perf_counter() - t0)

    faults.run_isolated = timed
    try:
        rt.generate_ids([prompt], [SamplingParams(max_new_tokens=steps + 1)])
    finally:
        faults.run_isolated = original
    return 1000.0 * float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-dir", required=True, type=Path)
    ap.add_argument("--datasets-dir", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "eval_datasets")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--policy", default="fixed:7")
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per context")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    rt = Runtime.open(args.engine_dir, policy="ar")
    rss_loaded = proc.memory_info().rss
    report = {"engine_dir": str(args.engine_dir), "rss_before_mb": rss0 / 2**20, "rss_loaded_mb": rss_loaded / 2**20,
              "prompts": [], "step_ms": {}}
    for name, domain, text in first_turns(args.datasets_dir):
        row = {"dataset": name, "domain": domain}
        ids = {}
        for policy in ("ar", args.policy):
            rt.set_policy(policy)
            [r] = rt.generate_text([text], SamplingParams(max_new_tokens=args.max_new_tokens), chat=True)
            ids[policy] = r.token_ids
            row[policy] = {"tokens": len(r.token_ids), "tokens_per_s": round(r.stats.tokens_per_s, 2),
                           "acceptance_length": round(r.stats.acceptance_length, 3), "finish": r.finish_reason}
        row["identical"] = ids["ar"] == ids[args.policy]
        report["prompts"].append(row)
        print(f"{name:10s} ar {row['ar']['tokens_per_s']:6.2f} tok/s | {args.policy} "
              f"{row[args.policy]['tokens_per_s']:6.2f} tok/s τ={row[args.policy]['acceptance_length']:.2f} | "
              f"identical={row['identical']}", file=sys.stderr)
    report["rss_after_generate_mb"] = proc.memory_info().rss / 2**20
    for c in (int(x) for x in args.contexts.split(",")):
        report["step_ms"][c] = {p: round(step_time_ms(rt, p, c, args.steps), 2) for p in ("ar", args.policy)}
        print(f"context {c:5d}: step ms {report['step_ms'][c]}", file=sys.stderr)
    report["all_identical"] = all(p["identical"] for p in report["prompts"])
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)
    return 0 if report["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
