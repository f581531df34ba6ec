#!/usr/bin/env python
"""dspark-async on one dataset prompt, step by step: how many steps drafted, what they verified, and the
tokens a drafted step committed against what its calibrated confidences predicted.

Generates the prompt with `ar` and with dspark-async (one Generator each, 128 new tokens, twice), hooks the
generator's commit (`_apply`) to record per step whether the drafter ran, the verify length ℓ, the accepted
drafts and the predicted tokens 1 + Σ_{j ≤ ℓ} a_j (a the survival of the step's confidences), and prints a
summary per repetition.

    python scripts/diag_dspark_async.py ENGINE_DIR mt-bench 3 [--datasets-dir DIR]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine_dir")
    p.add_argument("dataset")
    p.add_argument("index", type=int, help="row of the dataset (its first user turn is the prompt)")
    p.add_argument("--datasets-dir", default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args(argv)

    from pathlib import Path

    from dspark_export.datasets import default_datasets_dir, read_dataset
    from dspark_export.runtime.api import Runtime
    from dspark_export.runtime.generator import Generator
    from dspark_export.runtime.policies import parse_policy
    from dspark_export.runtime.request import SamplingParams
    from dspark_export.runtime.scheduler import survival_probs

    folder = Path(args.datasets_dir) if args.datasets_dir else default_datasets_dir()
    prompt = read_dataset(folder / f"{args.dataset}.jsonl")[args.index]
    rt = Runtime.open(args.engine_dir, policy="ar", threads=2)
    ids = rt.encode(prompt, True)

    def run(policy: str, rows: list | None = None) -> float:
        gen = Generator(rt.engines, parse_policy(policy))
        gen.generate([ids], [SamplingParams(max_new_tokens=8)])
        if rows is not None:
            apply, clock = gen._apply, [time.perf_counter()]

            def recording(rnd):
                apply(rnd)
                if rnd.decoding:
                    slot = rnd.decoding[0].slot
                    n, a = int(rnd.verify_lens[slot]), int(rnd.num_accepted[slot])
                    pred = 1.0 + float(survival_probs(rnd.conf)[0, :n].sum()) if rnd.conf is not None else 1.0
                    rows.append((rnd.drafts is not None, n, a, pred, time.perf_counter() - clock[0]))
                clock[0] = time.perf_counter()

            gen._apply = recording
        t0 = time.perf_counter()
        [r] = gen.generate([ids], [SamplingParams(max_new_tokens=args.max_new_tokens)])
        return len(r.token_ids) / (time.perf_counter() - t0)

    for _ in range(2):
        rows: list = []
        ar, da = run("ar"), run("dspark-async", rows)
        drafted = np.array([r[1:] for r in rows if r[0]], float).reshape(-1, 4)
        print(f"{args.dataset}[{args.index}] ar {ar:.1f} tok/s, dspark-async {da:.1f} ({da / ar:.2f}x); steps "
              f"{len(rows)}: drafted {len(drafted)}, skipped {len(rows) - len(drafted)}")
        if len(drafted):
            n, a, pred, t = drafted.T
            print(f"  drafted: mean verify len {n.mean():.2f}, realized tokens/step {1 + a.mean():.2f}, predicted "
                  f"{pred.mean():.2f}, step ms median {1e3 * np.median(t):.1f}, steps verifying nothing {int((n == 0).sum())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
