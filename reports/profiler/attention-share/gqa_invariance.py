"""Is ORT's GroupQueryAttention (CPU) bitwise the same for a decode row and that row inside a verification
block, and across KV buffer capacities? One GQA node, SmolLM2-135M's shapes (9 heads, 3 KV heads, D 64)."""
import numpy as np, onnx, onnxruntime as ort
from onnx import helper, TensorProto as T
H, KVH, D = 9, 3, 64
def session():
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total_len"],
                            ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=H, kv_num_heads=KVH,
                            scale=D ** -0.5)
    f = lambda n, s, t=T.FLOAT: helper.make_tensor_value_info(n, t, s)
    g = helper.make_graph([node], "g",
        [f("q", ["B", "S", H * D]), f("k", ["B", "S", KVH * D]), f("v", ["B", "S", KVH * D]),
         f("pk", ["B", KVH, "P", D]), f("pv", ["B", KVH, "P", D]), f("seqlens_k", ["B"], T.INT32), f("total_len", [], T.INT32)],
        [f("out", ["B", "S", H * D]), f("present_k", ["B", KVH, "T", D]), f("present_v", ["B", KVH, "T", D])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
s = session()
rng = np.random.default_rng(0)
L = 700
Q = rng.standard_normal((L, H * D)).astype(np.float32)
K = rng.standard_normal((L, KVH * D)).astype(np.float32)
V = rng.standard_normal((L, KVH * D)).astype(np.float32)
def run(past, new, cap):
    """rows past..past+new-1 with `past` cached entries in a buffer of `cap` entries"""
    pk = np.zeros((1, KVH, cap, D), np.float32); pv = np.zeros_like(pk)
    pk[0, :, :past] = K[:past].reshape(past, KVH, D).transpose(1, 0, 2)
    pv[0, :, :past] = V[:past].reshape(past, KVH, D).transpose(1, 0, 2)
    sl = slice(past, past + new)
    out = s.run(["out"], {"q": Q[None, sl], "k": K[None, sl], "v": V[None, sl], "pk": pk[:, :, :past] if cap == past else pk,
                          "pv": pv[:, :, :past] if cap == past else pv,
                          "seqlens_k": np.array([past + new - 1], np.int32), "total_len": np.array(past + new, np.int32)})[0]
    return out[0]
worst = 0.0
for p in [5, 63, 127, 128, 129, 200, 255, 256, 300, 511, 600]:
    ref = run(p, 1, p)[0]                      # decode row at position p, buffer exactly p
    diffs = []
    for j in range(0, 6):                      # same row as row j of a block of 6 starting at p - j
        if p - j < 1: continue
        blk = run(p - j, 6, p - j)[j]
        diffs.append(float(np.abs(blk - ref).max()))
    cap = run(p, 1, p + 128)[0] if False else None
    print(p, "block vs decode max|diff| per j:", diffs)
    worst = max(worst, max(diffs))
print("worst", worst)
print("--- blocks only (S >= 2): row at position p, in blocks of size n starting at p - j")
worst = 0.0
for p in [5, 63, 127, 128, 129, 200, 255, 256, 300, 511, 600]:
    ref = run(p, 2, p)[0]                  # a 2-row block whose first row is p
    diffs = []
    for n in (2, 3, 4, 6, 8):
        for j in range(n):
            if p - j < 1 or p - j + n > L: continue
            diffs.append(float(np.abs(run(p - j, n, p - j)[j] - ref).max()))
    print(p, "max", max(diffs), "n_nonzero", sum(d > 0 for d in diffs), "of", len(diffs))
    worst = max(worst, max(diffs))
print("worst", worst)
print("--- buffer capacity > past (seqlens_k gives the valid length), S >= 2")
def run_cap(past, new, cap):
    pk = np.zeros((1, KVH, cap, D), np.float32); pv = np.zeros_like(pk)
    pk[0, :, :past] = K[:past].reshape(past, KVH, D).transpose(1, 0, 2)
    pv[0, :, :past] = V[:past].reshape(past, KVH, D).transpose(1, 0, 2)
    pk[0, :, past:] = 7.0; pv[0, :, past:] = -3.0      # junk past the valid length
    sl = slice(past, past + new)
    try:
        return s.run(["out"], {"q": Q[None, sl], "k": K[None, sl], "v": V[None, sl], "pk": pk, "pv": pv,
                               "seqlens_k": np.array([past + new - 1], np.int32),
                               "total_len": np.array(max(cap, past + new), np.int32)})[0][0]
    except Exception as e:
        return str(e)[:200]
for p in [63, 128, 300]:
    ref = run(p, 2, p)[0]
    for cap in (p + 8, p + 128, 1024):
        r = run_cap(p, 2, cap)
        print(p, cap, r if isinstance(r, str) else float(np.abs(r[0] - ref).max()))
print("--- batch of 2 requests, different pasts, padded to the same S")
def run_batch(pasts, new, cap):
    B = len(pasts)
    pk = np.zeros((B, KVH, cap, D), np.float32); pv = np.zeros_like(pk)
    q = np.zeros((B, new, H * D), np.float32); k = np.zeros((B, new, KVH * D), np.float32); v = np.zeros_like(k)
    for b, past in enumerate(pasts):
        pk[b, :, :past] = K[:past].reshape(past, KVH, D).transpose(1, 0, 2)
        pv[b, :, :past] = V[:past].reshape(past, KVH, D).transpose(1, 0, 2)
        q[b], k[b], v[b] = Q[past:past + new], K[past:past + new], V[past:past + new]
    try:
        return s.run(["out"], {"q": q, "k": k, "v": v, "pk": pk, "pv": pv,
                               "seqlens_k": np.array([p + new - 1 for p in pasts], np.int32),
                               "total_len": np.array(max(cap, max(pasts) + new), np.int32)})[0]
    except Exception as e:
        return str(e)[:200]
for pasts in ([63, 300], [128, 5], [200, 200]):
    r = run_batch(pasts, 3, max(pasts))
    if isinstance(r, str):
        print(pasts, r); continue
    for b, p in enumerate(pasts):
        print(pasts, b, float(np.abs(r[b, 0] - run(p, 2, p)[0]).max()))
