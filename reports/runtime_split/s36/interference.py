"""Hot loops on captured feeds: target N1 alone, drafter R1 alone, and alternating (target, drafter): ms per call."""
import sys, time, numpy as np
from dspark_export.engines.ort.runner import use_shared_thread_pool; use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.runtime import stages as ST
from dspark_export.runtime.request import SamplingParams
eng = sys.argv[1]
rt = Runtime.open(eng, policy="fixed:1", threads=2)
cap = {}
orig = ST.EngineStages.infer
def infer(self, runner, feed):
    k = (runner.key.graph, runner.key.bucket)
    if k in (("target", 1), ("drafter_block", 1), ("target", 2), ("drafter_context", 1), ("drafter_context", 2)) and k not in cap:
        cap[k] = (runner.session, {n: np.array(v) for n, v in feed.items()})
    return orig(self, runner, feed)
ST.EngineStages.infer = infer
rt.generator.generate([rt.encode("Write a python function that reverses a list.", True)], [SamplingParams(max_new_tokens=24)])
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
Generator(rt.engines, parse_policy("ar")).generate([rt.encode("Write a python function that reverses a list.", True)], [SamplingParams(max_new_tokens=24)])
print(sorted(cap))
def loop(keys, n=150):
    ts = {k: [] for k in keys}
    for i in range(20):
        for k in keys: cap[k][0].run(None, cap[k][1])
    for i in range(n):
        for k in keys:
            t = time.perf_counter(); cap[k][0].run(None, cap[k][1]); ts[k].append(time.perf_counter() - t)
    return {k: round(float(np.median(v)) * 1e3, 3) for k, v in ts.items()}
T1, T2, D1 = ("target", 1), ("target", 2), ("drafter_block", 1)
CX = ("drafter_context", 2) if ("drafter_context", 2) in cap else ("drafter_context", 1)
for r in range(2):
    print("t1 alone", loop([T1]), "| d1 alone", loop([D1]), "| t1,d1", loop([T1, D1]), "| t2,d1", loop([T2, D1]), "| t1,t1,d1,cx,t2", loop([T1, T1, D1, CX, T2]))
