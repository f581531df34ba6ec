import sys, numpy as np, onnx, onnxruntime as ort
sys.path.insert(0, "/work/main/scripts")
from bench_target_pass import feed_for
from onnx import helper, TensorProto
L, P = 200, 256
lvl = {"off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
for opt in ("off",):
    res = {}
    for path in ("/tmp/eng/main/graphs/target.onnx", "/tmp/s17/target_gqa.onnx"):
        m = onnx.load(path)
        names = [f"/target/layers.{l}/attn/unpad/Gather/output_0" for l in range(30)]
        for n in names: m.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
        so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.log_severity_level = 3; so.graph_optimization_level = lvl[opt]
        s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        fa = feed_for(s, 1, L, P) if "gqa" not in path else None
        if fa is None:
            f0 = feed_for(ort.InferenceSession("/tmp/eng/main/graphs/target.onnx", providers=["CPUExecutionProvider"]), 1, L, P)
            fa = {k: v for k, v in f0.items() if k in {i.name for i in s.get_inputs()}}
            for k in list(fa):
                if k.startswith("past_"): fa[k] = np.concatenate([f0[k][:, :, :L], np.zeros_like(f0[k][:, :, L:])], 2)
            fa["gqa_seqlens_k"] = np.array([L], np.int32); fa["gqa_total_len"] = np.array(L + 1, np.int32)
        res[path] = s.run(names + ["logits"], fa)
    a, b = res.values()
    print(opt, [float(np.linalg.norm(x - y) / np.linalg.norm(x)) for x, y in zip(a, b)])
