"""ORT's node profiler on captured feeds of the named graphs: per op type, µs per run (profiling inflates
small nodes; read shares, not times).

    python reports/runtime_split/s37/node_profile.py ENGINE_DIR target,drafter_block
"""
import sys, time, json, collections, numpy as np, onnxruntime as ort
from capture import capture
from dspark_export.plugins import cpu_ops
eng = sys.argv[1]
cap = capture(eng)
print(sorted(cap))
for key in [k for k in cap if k[0] in sys.argv[2].split(",")]:
    runner, feed = cap[key]
    from dspark_export.engines.ort.runner import session_options
    so = session_options({}, 2, key[0]); so.enable_profiling = True
    cpu_ops.register(so)
    s = ort.InferenceSession(str(runner.graph_path), so, providers=["CPUExecutionProvider"])
    for _ in range(30): s.run(None, feed)
    n = 200; t = time.perf_counter()
    for _ in range(n): s.run(None, feed)
    wall = (time.perf_counter() - t) / n * 1e6
    prof = json.load(open(s.end_profiling()))
    by = collections.defaultdict(float); cnt = collections.Counter(); nodes = collections.Counter()
    for e in prof:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            op = e["args"]["op_name"]; by[op] += e["dur"]; cnt[op] += 1
    runs = 230
    tot = sum(by.values()) / runs
    print(key, f"wall {wall:.0f} us/run, kernels {tot:.0f} us/run, nodes/run {sum(cnt.values())/runs:.0f}")
    for op, d in sorted(by.items(), key=lambda x: -x[1])[:14]: print(f"   {op:28s} {d/runs:7.1f} us  x{cnt[op]/runs:.0f}")
