"""Graph surgery: target.onnx with one new_kv output (Concat of every new_key/new_value, [2L*N, kvH, D]) instead of
2L outputs; hot session.run of both on the same feed, alternating (the copy is written next to the engine's graph
and removed after).

    python reports/runtime_split/s37/concat_kv_output.py
"""
import sys, time, numpy as np, onnx, onnxruntime as ort, os, shutil
from onnx import helper, TensorProto
from dspark_export.engines.ort.runner import use_shared_thread_pool, session_options; use_shared_thread_pool(2)
from dspark_export.plugins import cpu_ops
from dspark_export.runtime.api import Runtime
from dspark_export.runtime import stages as ST
from dspark_export.runtime.request import SamplingParams
src = "/tmp/eng/b/graphs/target.onnx"
m = onnx.load(src, load_external_data=False)
L = sum(1 for o in m.graph.output if o.name.startswith("new_key."))
names = [f"new_key.{l}" for l in range(L)] + [f"new_value.{l}" for l in range(L)]
keep = [o for o in m.graph.output if o.name not in names]
del m.graph.output[:]
m.graph.output.extend(keep)
m.graph.node.append(helper.make_node("Concat", names, ["new_kv"], axis=0))
m.graph.output.append(helper.make_tensor_value_info("new_kv", TensorProto.FLOAT, None))
dst = "/tmp/eng/b/graphs/target_concat.onnx"
onnx.save(m, dst)
rt = Runtime.open("/tmp/eng/b", policy="ar", threads=2)
cap = {}
orig = ST.EngineStages.infer
def infer(self, runner, feed):
    cap[(runner.key.graph, runner.key.bucket)] = (runner, dict(feed)); return orig(self, runner, feed)
ST.EngineStages.infer = infer
rt.generator.generate([rt.encode("Write a python function that reverses a list.", True)], [SamplingParams(max_new_tokens=24)])
runner, feed = cap[("target", 1)]
so = session_options({}, 2, "target"); cpu_ops.register(so)
s_new = ort.InferenceSession(dst, so, providers=["CPUExecutionProvider"])
s_old = runner.session
def t(s, n=200):
    for _ in range(10): s.run(None, feed)
    ts = []
    for _ in range(n):
        a = time.perf_counter(); s.run(None, feed); ts.append(time.perf_counter() - a)
    return np.median(ts) * 1e6
for rep in range(4):
    print(f"old (62 outputs) {t(s_old):.0f} us   new (3 outputs) {t(s_new):.0f} us")
a = dict(zip([o.name for o in s_old.get_outputs()], s_old.run(None, feed)))
b = dict(zip([o.name for o in s_new.get_outputs()], s_new.run(None, feed)))
print("equal:", np.array_equal(a["logits"], b["logits"]), np.array_equal(np.concatenate([a[n] for n in names]), b["new_kv"]), b["new_kv"].shape)
os.remove(dst)
