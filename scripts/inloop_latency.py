#!/usr/bin/env python
"""In-loop engine latencies: the median wall time (ms, the runner's `last_latency_ms`) of every (graph, bucket)
the speculative loop ran under one policy, over the first `--prompts-per-dataset` prompts of gsm8k, humaneval
and mt-bench (128 new tokens each), beside the engine directory's profile/sps.json, to check that the profile
prices the engines as the loop runs them.

    python scripts/inloop_latency.py ENGINE_DIR --policy dspark --datasets-dir /work/shared/eval_datasets
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine_dir")
    p.add_argument("--policy", default="dspark")
    p.add_argument("--prompts-per-dataset", type=int, default=3)
    p.add_argument("--datasets-dir", default=None)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    from dspark_export.bench.peers import PeersBenchConfig, _ours
    from dspark_export.engines.sps import SPS_PATH, read_sps
    from dspark_export.runtime.api import Runtime
    from dspark_export.runtime.stages import EngineStages

    log: dict = collections.defaultdict(list)
    infer = EngineStages.infer

    def timed(self, runner, feed):
        out = infer(self, runner, feed)
        log[(runner.key.graph, runner.key.bucket)].append(runner.last_latency_ms)
        return out

    EngineStages.infer = timed
    prompts = PeersBenchConfig(args.engine_dir, datasets=("gsm8k", "humaneval", "mt-bench"),
                               datasets_dir=args.datasets_dir, prompts_per_dataset=args.prompts_per_dataset).prompts
    rt = Runtime.open(args.engine_dir, policy="ar", threads=args.threads)
    gen = _ours(rt, args.policy)
    ids = [rt.encode(q, True) for q in prompts]
    list(gen(ids[0], 4))   # warm-up
    log.clear()
    for x in ids:
        list(gen(x, 128))
    profiled = {(graph, b): ms for graph, rows in read_sps(Path(args.engine_dir) / SPS_PATH).latencies_ms().items()
                for b, ms in rows.items()}
    print("| graph | bucket | runs | in loop, median ms | profiled ms |\n|---|---:|---:|---:|---:|")
    for (graph, bucket), ms in sorted(log.items()):
        print(f"| {graph} | {bucket} | {len(ms)} | {np.median(ms):.3f} | {profiled.get((graph, bucket), '')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
