#!/usr/bin/env python
"""Paired A/B of drafters: one policy on several engine directories that share a target, against `ar`, in one
process, interleaved per prompt.

The engine directories must compute the same target logits (a drafter change, or a target graph rewritten to
the same bits with `--ar-on-each`, which runs `ar` on every directory too), so every system must reproduce the
tokens of `ar` on the first; ratios are to that one. For each round, prompt by prompt, every system generates
(systems in reverse order on every other round); prints per system the tokens/s over the per-prompt medians
and its ratio to `ar` in each round, and whether its tokens equal ar's. The prompts are the first
`--prompts-per-dataset` first turns of each dataset (chat template), as `bench peers` takes them.

    python scripts/ab_drafters.py --engine-dirs /tmp/eng/v2,/tmp/eng/v3 --policy dspark-async --rounds 3
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dirs", required=True, help="comma-separated engine directories (same target)")
    p.add_argument("--policy", default="dspark-async")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--datasets", default="gsm8k,humaneval,mt-bench")
    p.add_argument("--prompts-per-dataset", type=int, default=7)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--datasets-dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ar-on-each", action="store_true", help="also run ar on every directory (target graph A/B)")
    args = p.parse_args(argv)

    from dspark_export.bench.peers import PeersBenchConfig, _ours
    from dspark_export.runtime.api import Runtime

    dirs = args.engine_dirs.split(",")
    prompts = PeersBenchConfig(dirs[0], datasets=tuple(args.datasets.split(",")), datasets_dir=args.datasets_dir,
                               prompts_per_dataset=args.prompts_per_dataset).prompts   # as bench peers takes them
    runtimes = {d: Runtime.open(d, policy="ar", threads=args.threads) for d in dirs}
    ids = [runtimes[dirs[0]].encode(q, True) for q in prompts]
    systems = [("ar", d) for d in (dirs if args.ar_on_each else dirs[:1])] + [(args.policy, d) for d in dirs]
    gens = {(policy, d): _ours(runtimes[d], policy) for policy, d in systems}   # one Generator per system
    for gen in gens.values():
        gen(ids[0], 4)   # warm-up
    wall = {s: np.zeros((args.rounds, len(ids))) for s in systems}
    tokens: dict = {s: {} for s in systems}
    for k in range(args.rounds):
        for i, x in enumerate(ids):
            for s in (systems if k % 2 == 0 else systems[::-1]):
                t0 = time.perf_counter()
                tokens[s][i] = list(gens[s](x, args.max_new_tokens))
                wall[s][k, i] = time.perf_counter() - t0
    ref = tokens[systems[0]]
    n = sum(len(t) for t in ref.values())
    ar_rounds = wall[systems[0]].sum(axis=1)
    for s in systems:
        ratios = [round(float(a / w), 3) for a, w in zip(ar_rounds, wall[s].sum(axis=1))]
        print(f"{s[0]:14s} {s[1]}: {n / np.median(wall[s], axis=0).sum():6.2f} tok/s, ×ar per round {ratios}, "
              f"identical to ar {all(tokens[s][i] == ref[i] for i in ref)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
