#!/usr/bin/env python
"""Decode speed after a long request, with and without the KV caches shrinking back (`KVCache.shrink`).

    python scripts/bench_kv_shrink.py --engine-dir /tmp/eng/dspark --concurrency 1,16 --long-tokens 2000

A long-running service sees a long request now and then. The engines attend over the whole KV buffer,
so without the shrink every later step reads the capacity that request grew it to. Per concurrency C
and repeat, one `Generator` (policy `ar`) runs a request of --long-tokens prompt tokens, then C short
chat prompts (64 new tokens each, timed after a 4-token warm-up of the same prompts). The baseline is
the same run with shrinking turned off on that generator's caches; the two alternate within each repeat.
Prints, and with --json writes, tokens/s of the short requests (median over repeats) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams

FILLER = "The quick brown fox jumps over the lazy dog while the engines profile every bucket. "


def short_burst(rt: Runtime, long_ids: list[int], short: list[list[int]], shrink: bool, new_tokens: int = 64) -> dict:
    """One long request (`long_ids`), then the `short` ones at once on the same generator; the short ones'
    tokens/s."""
    gen = Generator(rt.engines, parse_policy("ar"))
    if not shrink:
        gen.target_kv.shrink = gen.draft_kv.shrink = lambda: False
    gen.generate([long_ids], [SamplingParams(max_new_tokens=2)])
    capacity = gen.target_kv.capacity
    concurrency = len(short)
    gen.generate(short, [SamplingParams(max_new_tokens=4)] * concurrency)    # warm the prefill shapes
    t0 = time.perf_counter()
    out = gen.generate(short, [SamplingParams(max_new_tokens=new_tokens)] * concurrency)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in out)
    return {"tokens_per_s": tokens / wall, "capacity_after_long": capacity}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine-dir", required=True)
    parser.add_argument("--concurrency", default="1,16", help="comma-separated C values (1,16)")
    parser.add_argument("--long-tokens", type=int, default=2000, help="prompt tokens of the long request (2000)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    rt = Runtime.open(args.engine_dir, policy="ar")
    max_context = rt.engines.manifest.data["runtime"]["max_context"]
    if args.long_tokens + 3 > max_context:
        print(f"--long-tokens {args.long_tokens}: exceeds the engines' max_context {max_context} (minus 3)",
              file=sys.stderr)
        return 2
    concurrency = [int(x) for x in args.concurrency.split(",")]
    long_ids = rt.encode(FILLER * (args.long_tokens // 8 + 1), False)[:args.long_tokens]
    short = [rt.encode(f"Write a short poem about the number {i}.", True) for i in range(max(concurrency))]
    results = []
    for c in concurrency:
        runs = {True: [], False: []}
        for rep in range(args.repeats):
            for shrink in ((True, False) if rep % 2 == 0 else (False, True)):
                r = short_burst(rt, long_ids, short[:c], shrink)
                runs[shrink].append(r)
                print(f"C={c} repeat {rep} {'shrink' if shrink else 'no shrink'}: {r['tokens_per_s']:.1f} tok/s "
                      f"(cache capacity as the short requests start: {r['capacity_after_long']})", flush=True)
        on = float(np.median([r["tokens_per_s"] for r in runs[True]]))
        off = float(np.median([r["tokens_per_s"] for r in runs[False]]))
        results.append({"concurrency": c, "tokens_per_s_shrink": round(on, 2), "tokens_per_s_no_shrink": round(off, 2),
                        "ratio": round(on / off, 3) if off > 0 else None,
                        "capacity_without_shrink": runs[False][0]["capacity_after_long"]})
        print(f"C={c}: {on:.1f} tok/s with the shrink, {off:.1f} without: x{on / off:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"engine_dir": str(args.engine_dir), "long_tokens": args.long_tokens,
                                               "repeats": args.repeats, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
