"""ORT profiler over 100 B = 1 target runs (2 threads, past P): kernel time by part and op type, and layer 5's
attention node by node. Profiling adds ~2-3 µs per node; read the shares, not the levels.

    python reports/profiler/attention-share/node_profile.py /tmp/eng/v8 128
"""
import sys, json, collections, numpy as np, onnxruntime as ort, glob, os
sys.path.insert(0, "scripts")
from bench_drafter_cost import _target_feed
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.enable_profiling = True; so.profile_file_prefix = "/tmp/s26/attnprof"
so.log_severity_level = 3
s = ort.InferenceSession(f"{sys.argv[1]}/graphs/target.onnx", so, providers=["CPUExecutionProvider"])
P = int(sys.argv[2])
feed = _target_feed(s, P, np.random.default_rng(0))
for _ in range(20): s.run(["logits"], feed)
RUNS = 100
for _ in range(RUNS): s.run(["logits"], feed)
path = s.end_profiling()
ev = json.load(open(path))
by = collections.defaultdict(float); cnt = collections.Counter(); per = collections.defaultdict(float)
for e in ev:
    if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
        name = e["name"][:-len("_kernel_time")]
        op = e["args"].get("op_name", "?")
        if "layers.5/attn" in name: per[name.split("/attn/")[1]] += e["dur"]
        part = "attn" if "/attn/" in name and "_proj" not in name else ("attn_shared" if "attn_shared" in name else "other")
        by[(part, op)] += e["dur"]; cnt[(part, op)] += 1
tot = sum(by.values()) / (RUNS + 20)
print(f"node time per run {tot/1e3:.2f} ms")
for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:25]:
    print(f"{k[0]:12s} {k[1]:22s} {v / (RUNS + 20) / 1e3:.3f} ms/run  nodes/run {cnt[k] / (RUNS + 20):.0f}")
os.remove(path)
print("--- layer 5 attention nodes, us/run")
for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
    print(f"  {k:40s} {v / (RUNS + 20):.1f}")
