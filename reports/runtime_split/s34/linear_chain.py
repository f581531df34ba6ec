"""30 layers of the SmolLM2 target's int4 linears (qkv 576x960, o 576x576, gate_up 576x3072, down 1536x576) + LM head,
distinct weights, as one ORT graph of MatMulW4A8 nodes; ms per run at M rows, libraries interleaved.

    python linear_chain.py THREADS head|nohead LIB.so[,LIB2.so...]

Each LIB is a build of the dspark.cpu library (`plugins.cpu_ops.library_path()` after checking out a version)."""
import sys, numpy as np, time, onnx, onnxruntime as ort
from onnx import helper, TensorProto
from dspark_export.plugins import cpu_ops
LIBS = sys.argv[3].split(',')
rng = np.random.default_rng(0)
nodes, inits, outs = [], [], []
shapes = [(576, 960, 'x'), (576, 576, 'x'), (576, 3072, 'x'), (1536, 576, 'z')] * 30 + [(576, 49152, 'x')]
if len(sys.argv) > 2 and sys.argv[2] == 'nohead': shapes = shapes[:-1]
for i, (K, N, src) in enumerate(shapes):
    nb = K // 32
    inits += [onnx.numpy_helper.from_array(rng.integers(0, 256, (N, nb, 16)).astype(np.uint8), f'B{i}'),
              onnx.numpy_helper.from_array((rng.random((N, nb)) * 0.02 + 0.001).astype(np.float32), f'S{i}')]
    nodes.append(helper.make_node('MatMulW4A8', [src, f'B{i}', f'S{i}'], [f'y{i}'], domain=cpu_ops.DOMAIN))
    outs.append(helper.make_tensor_value_info(f'y{i}', TensorProto.FLOAT, ['M', N]))
g = helper.make_graph(nodes, 'g', [helper.make_tensor_value_info('x', TensorProto.FLOAT, ['M', 576]),
                                   helper.make_tensor_value_info('z', TensorProto.FLOAT, ['M', 1536])], outs, inits)
m = helper.make_model(g, opset_imports=[helper.make_opsetid('', 21), helper.make_opsetid(cpu_ops.DOMAIN, 1)])
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
sess = []
for LIB in LIBS:
    so = ort.SessionOptions(); so.intra_op_num_threads = threads; so.register_custom_ops_library(LIB)
    sess.append(ort.InferenceSession(m.SerializeToString(), so, providers=['CPUExecutionProvider']))
res = {}
for rep in range(6):
  for li, s in enumerate(sess):
    for M in [1, 2, 4, 8]:
        f = {'x': rng.standard_normal((M, 576)).astype(np.float32), 'z': rng.standard_normal((M, 1536)).astype(np.float32)}
        for _ in range(3): s.run(None, f)
        ts = []
        for _ in range(20):
            t = time.perf_counter(); s.run(None, f); ts.append(time.perf_counter() - t)
        res.setdefault((li, M), []).append(np.median(ts) * 1e3)
for li, L in enumerate(LIBS):
    print(f'{L[-20:]} threads {threads}:', ' '.join(f'M={M}: {np.median(res[(li,M)]):.2f} ({min(res[(li,M)]):.2f}-{max(res[(li,M)]):.2f})' for M in [1,2,4,8]))
