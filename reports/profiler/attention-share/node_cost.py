"""ORT CPU per-node cost of small data-movement nodes: a chain of K nodes of one type on a [1, 1, 576] tensor."""
import time, numpy as np, onnxruntime as ort
from onnx import helper, TensorProto as T, numpy_helper
def chain(op, K):
    nodes, inits, x = [], [], "x"
    if op == "Reshape":
        inits.append(numpy_helper.from_array(np.array([1, 1, 576], np.int64), "shape"))
    if op == "Gather":
        inits.append(numpy_helper.from_array(np.array([0], np.int64), "idx"))
    for i in range(K):
        y = f"t{i}"
        if op == "Reshape": nodes.append(helper.make_node("Reshape", [x, "shape"], [y]))
        elif op == "Transpose": nodes.append(helper.make_node("Transpose", [x], [y], perm=[1, 0, 2]))
        elif op == "Gather": nodes.append(helper.make_node("Gather", [x, "idx"], [y], axis=1))
        elif op == "Add": nodes.append(helper.make_node("Add", [x, x], [y]))
        x = y
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [1, 1, 576])],
                          [helper.make_tensor_value_info(x, T.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep the chain
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
x = np.ones((1, 1, 576), np.float32)
base = None
for op in ("Reshape", "Transpose", "Gather", "Add"):
    res = []
    for K in (1, 601):
        s = chain(op, K)
        for _ in range(50): s.run(None, {"x": x})
        ts = []
        for _ in range(400):
            t = time.perf_counter(); s.run(None, {"x": x}); ts.append(time.perf_counter() - t)
        res.append(np.median(ts))
    print(f"{op}: {(res[1] - res[0]) / 600 * 1e6:.2f} us per node")
