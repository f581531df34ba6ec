import sys, json, collections, time
import numpy as np, onnxruntime as ort
from pathlib import Path
from dspark_export.engines.target_features import EngineFeatures, _feature_graph
from dspark_export.engines.manifest import Manifest
T = int(sys.argv[1])
ef = EngineFeatures("/tmp/eng/main", threads=2)
toks = np.random.default_rng(0).integers(100, 40000, T)
ef.features(toks)
t = []
for _ in range(3):
    t0 = time.perf_counter(); ef.features(toks); t.append(time.perf_counter() - t0)
print(f"T={T}: {np.median(t)*1e3:.0f} ms per sequence, {T/np.median(t):.0f} tok/s")
model, last = _feature_graph(Manifest.load(Path("/tmp/eng/main"), verify=False).graph_path("target"))
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.log_severity_level = 3; so.enable_profiling = True; so.profile_file_prefix = "/tmp/fprof"
s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
ef.session = s
for _ in range(3): ef.features(toks)
ev = json.load(open(s.end_profiling()))
by = collections.Counter(); cnt = collections.Counter()
for e in ev:
    if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
        by[e["args"]["op_name"]] += e["dur"]; cnt[e["args"]["op_name"]] += 1
tot = sum(by.values())
for op, d in by.most_common(12):
    print(f"{op:34s} {d / tot * 100:5.1f}%  {d / 3 / 1e3:7.2f} ms/seq  µs/node {d / cnt[op]:.1f}")
