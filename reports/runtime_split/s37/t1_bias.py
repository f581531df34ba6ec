"""    python reports/runtime_split/s37/t1_bias.py ENGINE_DIR

t(1) right after the 256-row pass (as the build profile times it) against t(1) right after another t(1) (a
skipped step in the loop): profiler feeds at context 128, median ms over 30 rounds."""
import sys, time, numpy as np
from dspark_export.engines.ort.runner import use_shared_thread_pool; use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.engines.profiler import engine_feed
e = Runtime.open(sys.argv[1], policy="ar", threads=2).engines
g = e.manifest.data["graphs"]
t256 = (e.runner_exact("target", 256).activate(), engine_feed(g, "target", 256, 128))
t1 = (e.runner_exact("target", 1).activate(), engine_feed(g, "target", 1, 128))
def run(x):
    t = time.perf_counter(); x[0].infer(x[1]); return (time.perf_counter() - t) * 1e3
for _ in range(3): run(t256); run(t1)
a, b = [], []
for _ in range(30):
    run(t256); a.append(run(t1)); b.append(run(t1))
print(f"t(1) after t(256): {np.median(a):.3f} ms   t(1) after t(1): {np.median(b):.3f} ms   ratio {np.median(b) / np.median(a):.3f}")
