"""Hot drafter_block at R = 1, 2, 4, 16 on several engine dirs (profiler feeds at context 128), alternating,
median µs per run over 4 rounds.

    python reports/drafter/draft-vocab-4096/block_cost.py DIR[,DIR...]
"""
import sys, time, numpy as np
from dspark_export.engines.ort.runner import use_shared_thread_pool; use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.engines.profiler import engine_feed
dirs = sys.argv[1].split(",")
items = {}
for d in dirs:
    e = Runtime.open(d, policy="ar", threads=2).engines
    graphs = e.manifest.data["graphs"]
    for r in (1, 2, 4, 16):
        items[(d, r)] = (e.runner_exact("drafter_block", r).activate(), engine_feed(graphs, "drafter_block", r, 128))
res = {}
for rep in range(4):
    for k, (runner, feed) in items.items():
        for _ in range(10): runner.infer(feed)
        ts = []
        for _ in range(60):
            t = time.perf_counter(); runner.infer(feed); ts.append(time.perf_counter() - t)
        res.setdefault(k, []).append(np.median(ts) * 1e6)
for d in dirs:
    print(d.split("/")[-1].ljust(8), "  ".join(f"R={r}: {np.median(res[(d, r)]):6.0f} us" for r in (1, 2, 4, 16)))
