#!/usr/bin/env python
"""Where a closed-loop serving step's time goes, `ar` against dspark-async, in one process.

Runs `bench serve`'s closed loop (`bench/serve.py: _closed_loop`) at concurrency C over the same
2·C·3 prompts (64 new tokens, greedy), ar then dspark-async, twice. Wall time is summed per runtime
stage (`EngineStages.flush_context / propose / target_pass / verify / commit_rows`) and printed in
ms per step, with the number of steps whose drafter block was skipped.

    python reports/serve/v5/stage_split.py ENGINE_DIR C
"""

from __future__ import annotations

import collections
import sys
import time

from dspark_export.bench.serve import ServeBenchConfig, _closed_loop, _Prompts, _timed
from dspark_export.runtime import stages
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams

STAGES = ("flush_context", "propose", "target_pass", "verify", "commit_rows")


def _timed_stage(fn, name: str, seconds: dict):
    def run(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(self, *args, **kwargs)
        seconds[name] += time.perf_counter() - t0
        return out
    return run


def main(engine_dir: str, concurrency: int) -> None:
    seconds: dict[str, float] = collections.defaultdict(float)
    for name in STAGES:
        setattr(stages.EngineStages, name, _timed_stage(getattr(stages.EngineStages, name), name, seconds))
    rt = Runtime.open(engine_dir, policy="ar", threads=2)
    prompts = _Prompts(ServeBenchConfig(engine_dir, max_new_tokens=64), lambda t: rt.encode(t, True),
                       4096).first(2 * concurrency * 3)
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    for _ in range(2):
        for policy in ("ar", "dspark-async"):
            seconds.clear()
            gen = Generator(rt.engines, _timed(parse_policy(policy)))
            steps, step = [0], gen.step

            def counted(step=step):
                steps[0] += 1
                step()

            gen.step = counted
            t0 = time.perf_counter()
            _closed_loop(gen, prompts, concurrency, params)
            wall = time.perf_counter() - t0
            split = {k: round(v * 1e3 / steps[0], 2) for k, v in seconds.items()}
            print(f"{policy}: wall {wall:.2f} s, {steps[0]} steps, {wall * 1e3 / steps[0]:.2f} ms/step, "
                  f"drafter skipped on {gen.drafts_skipped}; ms per step by stage {split}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
