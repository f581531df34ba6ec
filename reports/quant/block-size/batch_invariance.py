"""Is MatMulNBits (int4, symmetric, accuracy_level 4) batch-invariant? Row 0 computed alone against row 0 computed
with M − 1 other rows beside it, max absolute difference, per block size.

    python reports/quant/block-size/batch_invariance.py
"""
import numpy as np, logging, onnx, onnxruntime as ort
logging.disable(logging.INFO)
from onnx import helper, TensorProto
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
def make(K, N, blk, bits=4):
    W = np.random.default_rng(0).standard_normal((K, N)).astype(np.float32) * 0.05
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])], [onnx.numpy_helper.from_array(W, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    q = MatMulNBitsQuantizer(m, block_size=blk, is_symmetric=True, accuracy_level=4, bits=bits); q.process()
    so = ort.SessionOptions(); so.intra_op_num_threads = 2
    return ort.InferenceSession(q.model.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
x = np.random.default_rng(1).standard_normal((8, 576)).astype(np.float32)
for blk in [32, 64, 128]:
    for K, N in [(576, 1536), (576, 49152)]:
        s = make(K, N, blk)
        y1 = s.run(None, {"x": x[:1]})[0]
        out = []
        for M in [2, 4, 8]:
            yM = s.run(None, {"x": x[:M]})[0]
            out.append(float(np.abs(yM[0] - y1[0]).max()))
        print(blk, K, N, "max|row0(M) - row0(1)|", out, "scale", float(np.abs(y1).max()))
