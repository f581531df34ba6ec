#!/usr/bin/env python
"""Does the drafter block cost more right after a target pass than back to back? A paired measurement.

Opens the engine directory with `fixed:1`, generates once to capture a real drafter-block feed (R = 1) and
a real target feed (the B = 2 verification pass before it), then repeats `--iterations` times: block (untimed),
block (timed: "back to back"), target pass (untimed), block (timed: "after target"), all on the runtime's own
sessions. Prints both medians and the per-iteration ratio (median, p10, p90). Pairing within an iteration
cancels this machine's drifting speed, which an isolated profile and a later in-loop timing do not share.

    python scripts/bench_block_in_loop.py --engine-dir /tmp/eng/default --iterations 100
"""

from __future__ import annotations

import argparse
import time

import numpy as np

PROMPT = ("Write a short story about a robot learning to paint. Make it about two paragraphs long, with a "
          "title, and describe the colors the robot mixes.")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dir", required=True)
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    from dspark_export.engines.ort.runner import OrtRunner
    from dspark_export.runtime.api import Runtime
    from dspark_export.runtime.request import SamplingParams

    rt = Runtime.open(args.engine_dir, policy="fixed:1", threads=args.threads)
    captured: dict[str, tuple[OrtRunner, dict]] = {}
    infer = OrtRunner.infer

    def capture(self, feed):
        if (self.key.graph, self.key.bucket) in (("drafter_block", 1), ("target", 2)):
            captured[self.key.graph] = (self, {k: np.array(v) for k, v in feed.items()})
        return infer(self, feed)

    OrtRunner.infer = capture
    rt.generate_ids([rt.encode(PROMPT, True)], [SamplingParams(max_new_tokens=64)])
    OrtRunner.infer = infer
    (block, block_feed), (target, target_feed) = captured["drafter_block"], captured["target"]
    tight, after = [], []
    for _ in range(args.iterations):
        block.session.run(None, block_feed)
        t0 = time.perf_counter()
        block.session.run(None, block_feed)
        tight.append(time.perf_counter() - t0)
        target.session.run(None, target_feed)
        t0 = time.perf_counter()
        block.session.run(None, block_feed)
        after.append(time.perf_counter() - t0)
    tight_ms, after_ms = 1e3 * np.array(tight), 1e3 * np.array(after)
    ratio = after_ms / tight_ms
    print(f"drafter block R=1: back to back {np.median(tight_ms):.2f} ms, after a target pass "
          f"{np.median(after_ms):.2f} ms; per-iteration ratio median {np.median(ratio):.2f} "
          f"(p10 {np.percentile(ratio, 10):.2f}, p90 {np.percentile(ratio, 90):.2f}), {args.iterations} iterations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
