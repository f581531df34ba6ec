"""What the target's attention subgraph costs at B = 1: the graph as built against the same graph with every
layer's attention output replaced by its (RoPE'd) query and the dead nodes pruned, each session timed alone.

    python reports/profiler/attention-share/no_attention.py /tmp/eng/v8

Writes graphs/target_noattn.onnx into the engine directory (beside the weights it points at; delete it after).
"""
import sys
import time

import numpy as np
import onnx

sys.path.insert(0, "scripts")
from bench_drafter_cost import _session, _target_feed  # noqa: E402

src = f"{sys.argv[1]}/graphs/target.onnx"
out = f"{sys.argv[1]}/graphs/target_noattn.onnx"
m = onnx.load(src, load_external_data=False)
nodes = list(m.graph.node)
for n in nodes:
    if "/attn/o_proj" in n.name and n.op_type == "MatMulNBits":
        layer = n.name.split("/")[2]
        q = [x for x in nodes if x.name.startswith(f"/target/{layer}/attn/q_rope") and x.op_type == "RotaryEmbedding"]
        n.input[0] = q[0].output[0]
need, keep = {o.name for o in m.graph.output}, []
for n in reversed(nodes):
    if any(o in need for o in n.output):
        keep.append(n)
        need.update(i for i in n.input if i)
keep.reverse()
print("nodes", len(nodes), "->", len(keep))
del m.graph.node[:]
m.graph.node.extend(keep)
used = {i for n in keep for i in n.input}
inits = [t for t in m.graph.initializer if t.name in used]
del m.graph.initializer[:]
m.graph.initializer.extend(inits)
onnx.save(m, out)

rng = np.random.default_rng(0)
for P in (128, 512):
    for label, path in (("full", src), ("no attention", out)):
        s = _session(path, 2)
        names = {i.name for i in s.get_inputs()}
        feed = {k: v for k, v in _target_feed(s, P, rng).items() if k in names}
        for _ in range(30):
            s.run(["logits"], feed)
        ts = []
        for _ in range(300):
            t = time.perf_counter()
            s.run(["logits"], feed)
            ts.append(time.perf_counter() - t)
        print(f"P {P} {label}: median {1e3 * np.median(ts):.2f} ms, p10 {1e3 * np.percentile(ts, 10):.2f} ms")
        del s
