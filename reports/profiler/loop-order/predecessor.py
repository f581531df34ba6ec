"""Time target B after different predecessors: target-256 (profile's order), target-1 (ar loop), drafter R=1."""
import sys, time, numpy as np
from pathlib import Path
from dspark_export.engines.ort.runner import use_shared_thread_pool
use_shared_thread_pool(2)
from dspark_export.engines.engine_set import EngineSet
from dspark_export.engines import profiler as P
E = EngineSet.open(Path(sys.argv[1]), threads=2)
g = E.manifest.data["graphs"]; blk = g["drafter_block"]["spec"]["block_size"]; spec = g["target"]["spec"]
pool = {}
feeds = {b: (E.runner_exact("target", b), P._target_feed(spec, b, 128, blk, pool)) for b in (256, 8, 6, 4, 2, 1) if b in E.buckets("target")}
print(E.buckets("target"))
d1 = (E.runner_exact("drafter_block", 1), P._block_feed(g["drafter_block"]["spec"], 1, 128, blk, pool))
def t(item):
    r, f = item; t0 = time.perf_counter(); r.infer(f); return (time.perf_counter() - t0) * 1e3
res = {}
for rep in range(40):
    for pred in ("t256", "t1", "d1"):
        for b in (1, 2, 4, 8):
            if b not in feeds: continue
            if pred == "t256" and rep % 4: continue
            p = {"t256": feeds[256], "t1": feeds[1], "d1": d1}[pred]
            t(p); x = t(feeds[b])
            if rep >= 2: res.setdefault((pred, b), []).append(x)
for k, v in sorted(res.items()):
    print(k, "median %.2f p10 %.2f p90 %.2f n=%d" % (np.median(v), np.percentile(v, 10), np.percentile(v, 90), len(v)))
# drafter after target 1
v=[]
for rep in range(30):
    t(feeds[1]); v.append(t(d1))
print("d1 after t1 median %.2f" % np.median(v))
