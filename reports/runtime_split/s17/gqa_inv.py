"""Is ORT's CPU GroupQueryAttention bitwise row-invariant? A request's rows alone (Q=1), inside a wider padded
query block (Q=4), and beside a batch-mate with a much longer past."""
import numpy as np, onnxruntime as ort
from onnx import helper, TensorProto
H, KVH, D = 9, 3, 64
n = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tl"], ["o", "prk", "prv"], domain="com.microsoft", num_heads=H, kv_num_heads=KVH, scale=0.125)
gr = helper.make_graph([n], "g", [helper.make_tensor_value_info(x, TensorProto.FLOAT, None) for x in ("q", "k", "v", "pk", "pv")] +
     [helper.make_tensor_value_info("sl", TensorProto.INT32, None), helper.make_tensor_value_info("tl", TensorProto.INT32, [])],
     [helper.make_tensor_value_info(x, TensorProto.FLOAT, None) for x in ("o", "prk", "prv")])
mm = helper.make_model(gr, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
so = ort.SessionOptions(); so.intra_op_num_threads = 2
g = ort.InferenceSession(mm.SerializeToString(), so, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
C = 1024
def run(lens, Q, qs, ks, vs, caches):
    """lens[b]: past entries; qs/ks/vs[b]: [Q, ...] rows; caches: [B, KVH, C, D] shared buffers (copied)."""
    B = len(lens)
    pk = np.stack([c[0] for c in caches]).copy(); pv = np.stack([c[1] for c in caches]).copy()
    okv = [ort.OrtValue.ortvalue_from_numpy(x) for x in (pk, pv)]
    bd = g.io_binding()
    bd.bind_cpu_input("q", np.stack(qs).astype(np.float32)); bd.bind_cpu_input("k", np.stack(ks)); bd.bind_cpu_input("v", np.stack(vs))
    bd.bind_cpu_input("sl", np.array([l + Q - 1 for l in lens], np.int32)); bd.bind_cpu_input("tl", np.array(max(lens) + Q, np.int32))
    bd.bind_output("o")
    bd.bind_ortvalue_input("pk", okv[0]); bd.bind_ortvalue_output("prk", okv[0])
    bd.bind_ortvalue_input("pv", okv[1]); bd.bind_ortvalue_output("prv", okv[1])
    g.run_with_iobinding(bd)
    return bd.copy_outputs_to_cpu()[0], pk, pv
for L in (5, 127, 200, 700):
    cache = (rng.standard_normal((KVH, C, D)).astype(np.float32) * 3, rng.standard_normal((KVH, C, D)).astype(np.float32))
    q = rng.standard_normal((4, H * D)).astype(np.float32) * 5; k = rng.standard_normal((4, KVH * D)).astype(np.float32); v = rng.standard_normal((4, KVH * D)).astype(np.float32)
    # ar: one row at a time, cache written in place
    c = (cache[0].copy(), cache[1].copy()); ar = []
    for j in range(4):
        o, pk, pv = run([L + j], 1, [q[j:j+1]], [k[j:j+1]], [v[j:j+1]], [c]); ar.append(o[0, 0]); c = (pk[0], pv[0])
    ar = np.stack(ar)
    o4, _, _ = run([L], 4, [q], [k], [v], [cache])
    mate = (rng.standard_normal((KVH, C, D)).astype(np.float32), rng.standard_normal((KVH, C, D)).astype(np.float32))
    o4m = o4
    print(f"L={L}: verify Q=4 vs ar bitwise {np.array_equal(o4[0], ar)} (max diff {np.abs(o4[0]-ar).max():.2e}); "
          f"with a long batch-mate bitwise {np.array_equal(o4m[0], o4[0])} (max diff {np.abs(o4m[0]-o4[0]).max():.2e})")
