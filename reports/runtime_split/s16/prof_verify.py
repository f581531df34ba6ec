import json, sys, time, collections, numpy as np, onnxruntime as ort
from dspark_export.engines.ort.runner import OrtRunner
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.request import SamplingParams
eng = sys.argv[1]
rt = Runtime.open(eng, policy="ar", threads=2)
cap = {}
infer = OrtRunner.infer
def capture(self, feed):
    if self.key.graph == "verify":
        cap[self.key.bucket] = {k: np.array(v) for k, v in feed.items()}
    return infer(self, feed)
OrtRunner.infer = capture
ids = [rt.encode(f"Tell me about topic number {i}.", True) for i in range(16)]
rt.generate_ids(ids, [SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=i) for i in range(16)])
OrtRunner.infer = infer
b = max(cap); feed = cap[b]
print({k: v.shape for k, v in feed.items()})
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.enable_profiling = True; so.profile_file_prefix = "/tmp/s16/prof_v"
sess = ort.InferenceSession(f"{eng}/graphs/verify.onnx", so, providers=["CPUExecutionProvider"])
for _ in range(3): sess.run(None, feed)
ts = []
for _ in range(10):
    t = time.perf_counter(); sess.run(None, feed); ts.append(time.perf_counter() - t)
ev = json.load(open(sess.end_profiling()))
agg = collections.defaultdict(float)
for e in ev:
    if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
        agg[e["name"].replace("_kernel_time", "")] += e["dur"]
print(f"median {1e3*np.median(ts):.1f} ms")
for k, v in sorted(agg.items(), key=lambda x: -x[1])[:15]: print(f"{v/13/1e3:8.2f} ms {k[:110]}")
