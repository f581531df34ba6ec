"""The drafter block right after a target pass whose pool spins or does not, with 1 or 2 block threads (40 pairs).

    python cap.py ENGINE_DIR && python blk3.py ENGINE_DIR
"""
import sys
import pickle, time
import numpy as np, onnxruntime as ort
ENG = sys.argv[1]
f = pickle.load(open('feeds.pkl','rb'))
tfeed = f['target.N4.json']; bfeed = f['drafter_block.R1.json']
def mk(path, threads, spin):
    so = ort.SessionOptions(); so.log_severity_level = 3; so.intra_op_num_threads = threads
    so.add_session_config_entry('session.intra_op.allow_spinning', '1' if spin else '0')
    return ort.InferenceSession(path, so, providers=['CPUExecutionProvider'])
T = {'spin': mk(ENG + '/graphs/target.onnx', 2, True), 'nospin': mk(ENG + '/graphs/target.onnx', 2, False)}
B = mk(ENG + '/graphs/drafter_block.onnx', 2, False)
B1 = mk(ENG + '/graphs/drafter_block.onnx', 1, False)
for rep in range(2):
  for tn, ts_ in T.items():
    for bn, bs in [('blk2', B), ('blk1', B1)]:
        tt, bt = [], []
        for _ in range(40):
            t = time.perf_counter(); ts_.run(None, tfeed); tt.append(time.perf_counter() - t)
            t = time.perf_counter(); bs.run(None, bfeed); bt.append(time.perf_counter() - t)
        print(f"target {tn:6s} {bn}: target {np.median(tt)*1e3:.2f} ms, block after it {np.median(bt)*1e3:.2f} ms, sum {1e3*(np.median(tt)+np.median(bt)):.2f}")
