"""The B = 1 target pass and its attention share at 1 thread, 2 spinning threads and 2 threads without spinning
(P = 128, each session alone). Builds and then deletes graphs/target_noattn.onnx, as no_attention.py does.

    python reports/profiler/attention-share/threads.py /tmp/eng/v8
"""
import sys, time, numpy as np, subprocess
sys.path.insert(0, "scripts")
import onnxruntime as ort
from bench_drafter_cost import _target_feed
eng = sys.argv[1]
# build the no-attention graph with the report's script logic (import it as a module, skipping its timing)
src = open("reports/profiler/attention-share/no_attention.py").read().split("rng = np.random")[0]
sys.argv = ["x", eng]; exec(src)
def sess(path, th, spin):
    so = ort.SessionOptions(); so.intra_op_num_threads = th; so.log_severity_level = 3
    if not spin: so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
for th, spin in ((1, False), (2, True), (2, False)):
    r = {}
    for label, path in (("full", f"{eng}/graphs/target.onnx"), ("noattn", f"{eng}/graphs/target_noattn.onnx")):
        s = sess(path, th, spin)
        names = {i.name for i in s.get_inputs()}
        f = {k: v for k, v in _target_feed(s, 128, rng).items() if k in names}
        for _ in range(30): s.run(["logits"], f)
        ts = []
        for _ in range(300):
            t = time.perf_counter(); s.run(["logits"], f); ts.append(time.perf_counter() - t)
        r[label] = 1e3 * np.median(ts)
    print(f"threads {th} spin {spin}: full {r['full']:.2f} ms, no attention {r['noattn']:.2f} ms, attention {r['full'] - r['noattn']:.2f} ms")
import os; os.remove(f"{eng}/graphs/target_noattn.onnx")
