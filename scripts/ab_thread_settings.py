#!/usr/bin/env python
"""Interleaved A/B of ONNX Runtime thread settings in the speculative loop (single user, one prompt).

Variants (each run in a fresh process, round after round, so a change in machine load falls on all alike):
  base  the Python API's settings (per-session pools, `engines/ort/runner.py: thread_settings`: only the target
        pool spins)
  stop  also `session.force_spinning_stop` = 1: every pool stops spinning as soon as its Run returns
  b1    the drafter block on the calling thread (one intra-op thread), like drafter_context and verify
  global  one process-wide intra-op pool of `--threads` (spinning) for every session, as the `dspark-export`
        command runs (`runner.use_shared_thread_pool`): no idle pool spins against the busy one, and the drafter
        block wakes no sleeping worker

Each process opens the engine directory with the policy, warms up, generates `--max-new-tokens` three times
and reports the median wall time, plus the median ms per call of each graph (from the third generation back,
all calls). Prints one JSON line per process, then a table of the median tokens/s and the per-round ratio
to `base`. Run it with nothing else of ours on the machine.

    python scripts/ab_thread_settings.py --engine-dir /tmp/eng/default --policies ar,fixed:1 --rounds 5
Exit codes: 0 done, 2 an error (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

PROMPT = ("Write a short story about a robot learning to paint. Make it about two paragraphs long, with a "
          "title, and describe the colors the robot mixes.")
VARIANTS = ("base", "stop", "b1", "global")


def child(variant: str, policy: str, engine_dir: str, max_new_tokens: int, threads: int) -> dict:
    from dspark_export.engines.ort import runner as ort_runner

    settings = ort_runner.session_options

    def patched(overrides, threads=0, graph="target", prepack=False):
        so = settings(overrides, threads, graph, prepack)
        if variant == "stop":
            so.add_session_config_entry("session.force_spinning_stop", "1")
        return so

    if variant == "global":
        ort_runner.use_shared_thread_pool(threads)

    ort_runner.session_options = patched
    if variant == "b1":
        ort_runner.SINGLE_THREAD_GRAPHS = tuple(ort_runner.SINGLE_THREAD_GRAPHS) + ("drafter_block",)
    from dspark_export.runtime.api import Runtime
    from dspark_export.runtime.request import SamplingParams

    rt = Runtime.open(engine_dir, policy=policy, threads=threads)
    ids = rt.encode(PROMPT, True)
    rt.generate_ids([ids], [SamplingParams(max_new_tokens=8)])
    calls: dict[str, list[float]] = {}
    infer = ort_runner.OrtRunner.infer

    def timed(self, feed):
        t0 = time.perf_counter()
        out = infer(self, feed)
        calls.setdefault(self.key.graph, []).append(time.perf_counter() - t0)
        return out

    ort_runner.OrtRunner.infer = timed
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        [r] = rt.generate_ids([ids], [SamplingParams(max_new_tokens=max_new_tokens)])
        walls.append(time.perf_counter() - t0)
    if not r.token_ids:
        raise SystemExit(f"{engine_dir}: the generation made no tokens ({r.finish_reason}); nothing to time")
    return {"variant": variant, "policy": policy, "tokens": len(r.token_ids), "wall_s": float(np.median(walls)),
            "tok_s": len(r.token_ids) / float(np.median(walls)),
            "median_ms": {g: float(np.median(v)) * 1e3 for g, v in calls.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--policies", default="ar,fixed:1")
    p.add_argument("--variants", default="base,stop,b1")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="JSON lines of every process")
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "POLICY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.engine_dir, args.max_new_tokens, args.threads)))
        return 0
    variants = args.variants.split(",")
    if "base" not in variants or not set(variants) <= set(VARIANTS):
        print(f"--variants: expected 'base' and any of {VARIANTS}, found {args.variants!r}", file=sys.stderr)
        return 2
    rows = []
    for _ in range(args.rounds):
        for policy in args.policies.split(","):
            for v in variants:
                cmd = [sys.executable, __file__, "--engine-dir", args.engine_dir, "--max-new-tokens",
                       str(args.max_new_tokens), "--threads", str(args.threads), "--child", v, policy]
                run = subprocess.run(cmd, capture_output=True, text=True)
                if run.returncode:
                    last = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
                    print(f"error: {v} {policy}: the child exited {run.returncode}: {last}", file=sys.stderr)
                    return 2
                out = run.stdout.strip().splitlines()[-1]
                rows.append(json.loads(out))
                print(out, flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    for policy in args.policies.split(","):
        base = np.array([r["tok_s"] for r in rows if r["policy"] == policy and r["variant"] == "base"])
        for v in variants:
            got = np.array([r["tok_s"] for r in rows if r["policy"] == policy and r["variant"] == v])
            block = [r["median_ms"].get("drafter_block") for r in rows if r["policy"] == policy and r["variant"] == v]
            ratio = got / base
            print(f"{policy:12s} {v:5s} tok/s median {np.median(got):6.1f}  ×base per round "
                  f"{np.round(ratio, 3).tolist()}  drafter block ms {[round(b, 2) for b in block if b]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
