"""ORT profile of one target pass: per op type share of kernel time, node count, and the wall per run."""
import sys, json, collections, time, glob, os
import numpy as np, onnxruntime as ort
sys.path.insert(0, "/work/main/scripts")
from bench_target_pass import feed_for
path, rows, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.log_severity_level = 3
s0 = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
feed = feed_for(s0, rows, context, context + 64)
for _ in range(3): s0.run(None, feed)
t = []
for _ in range(40):
    t0 = time.perf_counter(); s0.run(None, feed); t.append(time.perf_counter() - t0)
print("plain wall median ms", round(np.median(t) * 1e3, 2), "p10", round(np.percentile(t, 10) * 1e3, 2))
so.enable_profiling = True; so.profile_file_prefix = "/tmp/prof"
s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
for _ in range(3): s.run(None, feed)
n = 20
for _ in range(n): s.run(None, feed)
f = s.end_profiling()
ev = json.load(open(f))
by = collections.Counter(); cnt = collections.Counter(); runs = []
for e in ev:
    if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
        by[e["args"]["op_name"]] += e["dur"]; cnt[e["args"]["op_name"]] += 1
    if e.get("cat") == "Session" and e["name"] == "model_run":
        runs.append(e["dur"])
tot = sum(by.values())
runs = runs[-n:]
print("model_run median ms", np.median(runs) / 1e3, "kernel sum per run ms", tot / (n + 3) / 1e3)
for op, d in by.most_common(20):
    print(f"{op:34s} {d / tot * 100:5.1f}%  {d / (n + 3) / 1e3:6.3f} ms/run  nodes/run {cnt[op] / (n + 3):.0f}  µs/node {d / cnt[op]:.1f}")
os.remove(f)
