#!/usr/bin/env python
"""Generation throughput of the runtime at a given number of request slots (the data job's regime).

Submits `--prompts` prompts of a responses JSONL (scripts/train_drafter.py data) at once to a Generator with
`--slots` slots (policy ar, greedy, `--max-new-tokens`), steps for `--window` seconds and prints the tokens
generated per second in that window (prefill included). The engine directory needs request buckets up to
the slots asked for (`dspark-export build --request-buckets 1,2,4,8,16,32,64`).

    python scripts/bench_data_slots.py --engine-dir /tmp/eng/data64 --records runs/smollm2/data/train.jsonl --slots 16,32,64
Exit codes: 0 done, 2 an error (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--records", required=True, help="responses JSONL (prompt_ids per line)")
    p.add_argument("--slots", default="16,32,64")
    p.add_argument("--prompts", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--window", type=float, default=75.0, help="seconds of steps per configuration")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    from dspark_export.engines.engine_set import EngineSet
    from dspark_export.runtime.generator import Generator
    from dspark_export.runtime.policies import parse_policy
    from dspark_export.runtime.request import SamplingParams

    with open(args.records, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt_ids"] for line, _ in zip(f, range(args.prompts))]
    engines = EngineSet.open(args.engine_dir, threads=args.threads).activate_all()
    largest = engines.buckets("drafter_block")[-1]
    wanted = [int(s) for s in args.slots.split(",")]
    if max(wanted) > largest:
        print(f"error: --slots {max(wanted)}: {args.engine_dir} has request buckets up to {largest}; rebuild it with "
              f"--request-buckets up to {max(wanted)}", file=sys.stderr)
        return 2
    for slots in wanted:
        gen = Generator(engines, parse_policy("ar"), max_slots=slots)
        count = [0]
        for ids in prompts:
            gen.submit(ids, SamplingParams(max_new_tokens=args.max_new_tokens),
                       on_token=lambda rid, new, res: count.__setitem__(0, count[0] + len(new)))
        t0, steps = time.perf_counter(), 0
        while gen.has_work() and time.perf_counter() - t0 < args.window:
            gen.step()
            steps += 1
        dt = time.perf_counter() - t0
        print(json.dumps({"slots": gen.max_slots, "tokens": count[0], "seconds": round(dt, 1),
                          "tokens_per_s": round(count[0] / dt, 1), "steps": steps}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
