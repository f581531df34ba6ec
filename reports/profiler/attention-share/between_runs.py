"""Does what runs between target passes slow the next one? B = 1, P = 128, 2 threads (spinning), alone: nothing,
a 1 ms sleep, or ~8 MB of numpy work between runs; then logits only against every output fetched.

    python reports/profiler/attention-share/between_runs.py   (reads /tmp/eng/v8)
"""
import sys, time, numpy as np
sys.path.insert(0, "scripts")
import onnxruntime as ort
from bench_drafter_cost import _target_feed
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.log_severity_level = 3
s = ort.InferenceSession("/tmp/eng/v8/graphs/target.onnx", so, providers=["CPUExecutionProvider"])
f = _target_feed(s, 128, np.random.default_rng(0))
buf = np.random.default_rng(1).standard_normal(2_000_000).astype(np.float32)  # 8 MB of host work
def between(kind):
    if kind == "sleep": time.sleep(0.001)
    elif kind == "busy": buf.sum(); buf.sum()
for _ in range(30): s.run(["logits"], f)
res = {k: [] for k in ("none", "sleep", "busy")}
for r in range(300):
    for k in res:
        between(k)
        t = time.perf_counter(); s.run(["logits"], f); res[k].append(time.perf_counter() - t)
for k, v in res.items(): print(f"between runs: {k:5s} -> run {1e3*np.median(v):.2f} ms")
res = {"logits only": [], "all outputs": []}
for r in range(300):
    for k in res:
        t = time.perf_counter(); s.run(["logits"] if k == "logits only" else None, f); res[k].append(time.perf_counter() - t)
for k, v in res.items(): print(f"{k:12s} -> run {1e3*np.median(v):.2f} ms")
