"""One linear layer, MatMulNBits (int4, block 32, accuracy_level 4) against dspark.cpu::MatMulW4A8 on the same
weights, 2 threads, M rows: median of 3 x 5 batches of session.run (Python call included, ~20 us), and the
largest difference between the two outputs. Usage: python one_node.py"""
import numpy as np, time, ctypes, onnx, onnxruntime as ort
from onnx import helper, TensorProto
from dspark_export.plugins import cpu_ops, matmul_w4a8
LIB = str(cpu_ops.library_path())
def sess(q, s, K, N, threads, op):
    nb = K // 32
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).reshape(N, nb, 16)
    if op == 'mnb':
        node = helper.make_node('MatMulNBits', ['x', 'B', 'S'], ['y'], domain='com.microsoft', K=K, N=N, bits=4, block_size=32, accuracy_level=4)
    else:
        node = helper.make_node('MatMulW4A8', ['x', 'B', 'S'], ['y'], domain=matmul_w4a8.DOMAIN)
    g = helper.make_graph([node], 'g', [helper.make_tensor_value_info('x', TensorProto.FLOAT, ['M', K])],
        [helper.make_tensor_value_info('y', TensorProto.FLOAT, ['M', N])],
        [onnx.numpy_helper.from_array(packed, 'B'), onnx.numpy_helper.from_array(s.astype(np.float32), 'S')])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 21), helper.make_opsetid('com.microsoft', 1), helper.make_opsetid(matmul_w4a8.DOMAIN, 1)])
    so = ort.SessionOptions(); so.intra_op_num_threads = threads
    so.register_custom_ops_library(LIB)
    return ort.InferenceSession(m.SerializeToString(), so, providers=['CPUExecutionProvider'])
rng = np.random.default_rng(0)
for K, N in [(576, 1536), (1536, 576), (576, 192), (576, 49152)]:
    nb = K // 32
    q = rng.integers(0, 16, (N, K)).astype(np.uint8); s = (rng.random((N, nb)) * 0.02 + 0.001).astype(np.float32)
    a = sess(q, s, K, N, 2, 'mnb'); b = sess(q, s, K, N, 2, 'ours')
    for M in [1, 2, 4, 8, 64]:
        x = rng.standard_normal((M, K)).astype(np.float32)
        ya = a.run(None, {'x': x})[0]; yb = b.run(None, {'x': x})[0]
        assert np.array_equal(b.run(None, {'x': x[:1]})[0], yb[:1])
        def tm(s_, n):
            s_.run(None, {'x': x}); ts = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(n): s_.run(None, {'x': x})
                ts.append((time.perf_counter() - t) / n * 1e6)
            return np.median(ts)
        n = 30 if N > 10000 else 300
        ta, tb = [], []
        for _ in range(3): ta.append(tm(a, n)); tb.append(tm(b, n))
        print(f'{K}x{N} M={M}: MNB {np.median(ta):7.1f} ours {np.median(tb):7.1f} us  maxdiff {np.abs(ya-yb).max():.2e} rel {np.abs(ya-yb).max()/np.abs(ya).max():.1e}')
