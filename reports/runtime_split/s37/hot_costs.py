"""Hot loops on captured feeds (drafter_context R = 1, drafter_block R = 1, target B = 2) and ORT's per-node cost on
chains of 1 / 10 / 40 Add nodes: median µs per session.run.

    python reports/runtime_split/s37/hot_costs.py [ENGINE_DIR]   (default /tmp/eng/b)
"""
import sys, time, numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto
from capture import capture
from dspark_export.engines.ort.runner import session_options
cap = capture(sys.argv[1] if len(sys.argv) > 1 else "/tmp/eng/b")
def hot(sess, feed, n=400):
    for _ in range(30): sess.run(None, feed)
    ts = []
    for _ in range(n):
        t = time.perf_counter(); sess.run(None, feed); ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e6
for k in [("drafter_context", 1), ("drafter_block", 1), ("target", 2)]:
    r, f = cap[k]; print(k, f"{hot(r.session, f):.0f} us")
# trivial graphs: 1 node and 40 nodes chain of Add
for nodes in (1, 10, 40):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 576])
    ns = [helper.make_node("Add", ["x" if i == 0 else f"h{i}", "x"], [f"h{i+1}" if i < nodes - 1 else "y"]) for i in range(nodes)]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 576])
    m = helper.make_model(helper.make_graph(ns, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    s = ort.InferenceSession(m.SerializeToString(), session_options({}, 2, "drafter_context"), providers=["CPUExecutionProvider"])
    print(nodes, "Add nodes", f"{hot(s, {'x': np.ones((1, 576), np.float32)}):.1f} us")
