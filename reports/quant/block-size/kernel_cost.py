"""One MatMulNBits node (accuracy_level 4, 2 threads): median µs at M = 1, 4, 8 rows per block size, bits and
symmetry, for the shapes of SmolLM2's MLP up projection (576 × 1536) and LM head (576 × 49152).

    python reports/quant/block-size/kernel_cost.py
"""
import numpy as np, onnx, onnxruntime as ort, time, logging
logging.disable(logging.INFO)
from onnx import helper, TensorProto
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
def make(K, N, acc, blk, sym, bits=4):
    W = np.random.randn(K, N).astype(np.float32) * 0.05
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])],
        [onnx.numpy_helper.from_array(W, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    q = MatMulNBitsQuantizer(m, block_size=blk, is_symmetric=sym, accuracy_level=acc, bits=bits)
    q.process()
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    return ort.InferenceSession(q.model.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
for K, N in [(576, 1536), (576, 49152)]:
  for bits in [4, 8]:
    for blk, sym in [(32, False), (32, True), (64, False), (128, False), (128, True)]:
        s = make(K, N, 4, blk, sym, bits)
        row = []
        for M in [1, 4, 8]:
            x = np.random.randn(M, K).astype(np.float32)
            for _ in range(20): s.run(None, {"x": x})
            ts = []
            for _ in range(100 if N > 10000 else 300):
                t = time.perf_counter(); s.run(None, {"x": x}); ts.append(time.perf_counter() - t)
            row.append(np.median(ts) * 1e6)
        print(K, N, "bits", bits, "blk", blk, "sym", sym, " ".join(f"M{M}={t:.0f}us" for M, t in zip([1,4,8], row)), flush=True)
