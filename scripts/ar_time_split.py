"""Where one generation's wall time goes (policy `ar` by default): every engine call timed inside the runtime.

Opens the engine directory with `--policy`, warms up, then wraps each runner's ``infer`` to time it and
generates once. Prints the wall time and, per (graph, rows) key, the calls, total seconds and median ms;
what is left is Python (packing, cache writes, checks). Single process: run it on a quiet machine.

    python scripts/ar_time_split.py --engine-dir /tmp/eng/final --max-new-tokens 128
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
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--policy", default="ar", help="runtime policy (ar, fixed:k, dspark, dspark-async, ...)")
    args = p.parse_args(argv)

    from dspark_export.engines.ort.runner import OrtRunner
    from dspark_export.runtime.api import Runtime
    from dspark_export.runtime.request import SamplingParams

    rt = Runtime.open(args.engine_dir, policy=args.policy, threads=args.threads)
    ids = rt.encode(args.prompt, True)
    rt.generate_ids([ids], [SamplingParams(max_new_tokens=8)])
    calls: dict[tuple[str, int], list[float]] = {}
    infer = OrtRunner.infer

    def timed(self, feed):
        t0 = time.perf_counter()
        out = infer(self, feed)
        calls.setdefault((self.key.graph, self.key.bucket), []).append(time.perf_counter() - t0)
        return out

    OrtRunner.infer = timed
    t0 = time.perf_counter()
    [r] = rt.generate_ids([ids], [SamplingParams(max_new_tokens=args.max_new_tokens)])
    wall = time.perf_counter() - t0
    OrtRunner.infer = infer
    engines = sum(sum(v) for v in calls.values())
    print(f"prompt {len(ids)} tokens, generated {len(r.token_ids)}, wall {wall:.3f} s, "
          f"outside the engines {wall - engines:.3f} s")
    for (graph, bucket), v in sorted(calls.items(), key=lambda kv: -sum(kv[1])):
        print(f"{graph} bucket {bucket}: {len(v)} calls, {sum(v):.3f} s, median {1e3 * np.median(v):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
