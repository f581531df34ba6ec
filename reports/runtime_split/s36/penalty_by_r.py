"""The slowdown a drafter block at R rows causes the target pass after it: hot loops on feeds captured from a
real run (fixed:1 at 1..16 requests), median ms of target B = 1 after target B = 1, and after drafter block R.

    python reports/runtime_split/s36/penalty_by_r.py ENGINE_DIR
"""
import sys
import time

import numpy as np

from dspark_export.engines.ort.runner import use_shared_thread_pool

use_shared_thread_pool(2)
from dspark_export.runtime import stages as ST  # noqa: E402
from dspark_export.runtime.api import Runtime  # noqa: E402
from dspark_export.runtime.generator import Generator  # noqa: E402
from dspark_export.runtime.policies import parse_policy  # noqa: E402
from dspark_export.runtime.request import SamplingParams  # noqa: E402

rt = Runtime.open(sys.argv[1], policy="ar", threads=2)
cap = {}
orig = ST.EngineStages.infer


def infer(self, runner, feed):
    key = (runner.key.graph, runner.key.bucket)
    if key not in cap:
        cap[key] = (runner.session, {n: np.array(v) for n, v in feed.items()})
    return orig(self, runner, feed)


ST.EngineStages.infer = infer
prompt = rt.encode("Write a python function that reverses a list.", True)
Generator(rt.engines, parse_policy("ar")).generate([prompt], [SamplingParams(max_new_tokens=8)])
for n in (1, 2, 4, 8, 16):
    Generator(rt.engines, parse_policy("fixed:1"), max_slots=16).generate([prompt] * n,
                                                                         [SamplingParams(max_new_tokens=8)] * n)
T1 = ("target", 1)


def after(first, rounds=120):
    """Median ms of T1 run right after `first` (and of `first`)."""
    t_first, t_next = [], []
    for i in range(rounds + 10):
        t = time.perf_counter()
        cap[first][0].run(None, cap[first][1])
        t1 = time.perf_counter()
        cap[T1][0].run(None, cap[T1][1])
        t2 = time.perf_counter()
        if i >= 10:
            t_first.append(t1 - t)
            t_next.append(t2 - t1)
    return float(np.median(t_first)) * 1e3, float(np.median(t_next)) * 1e3


blocks = sorted(k for k in cap if k[0] == "drafter_block")
for rep in range(2):
    _, base = after(T1)
    line = [f"t1 after t1 {base:.3f}"]
    for key in blocks:
        d, t = after(key)
        line.append(f"R={key[1]}: d {d:.3f}, t1 after it {t:.3f} (+{t - base:.3f})")
    print(" | ".join(line), flush=True)
