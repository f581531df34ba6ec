"""Target B = 1 on a captured feed, µs per run: InferenceSession.run, its _sess.run, IO binding with ORT-allocated
outputs and with preallocated ones (outputs checked equal).

    python reports/runtime_split/s37/io_binding.py [ENGINE_DIR]   (default /tmp/eng/b)
"""
import sys, time, numpy as np, onnxruntime as ort
from capture import capture
cap = capture(sys.argv[1] if len(sys.argv) > 1 else "/tmp/eng/b", policy="ar")
runner, feed = cap[("target", 1)]
sess = runner.session
outs = [o.name for o in sess.get_outputs()]
def t(f, n=300):
    for _ in range(20): f()
    ts = []
    for _ in range(n):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    return np.median(ts) * 1e6
io = sess.io_binding()
for k, v in feed.items(): io.bind_cpu_input(k, v)
for o in outs: io.bind_output(o, "cpu")
def run_io():
    sess.run_with_iobinding(io); return io.copy_outputs_to_cpu()
pre = {o.name: np.empty([d if isinstance(d, int) else 1 for d in o.shape], np.float32) for o in sess.get_outputs()}
r0 = sess.run(outs, feed)
pre = {o: np.empty_like(v) for o, v in zip(outs, r0)}
io2 = sess.io_binding()
for k, v in feed.items(): io2.bind_cpu_input(k, v)
for o in outs: io2.bind_output(o, "cpu", 0, np.float32, list(pre[o].shape), pre[o].ctypes.data)
def run_io2():
    sess.run_with_iobinding(io2); return pre
for rep in range(3):
    print(f"run {t(lambda: sess.run(outs, feed)):.0f}  _sess.run {t(lambda: sess._sess.run(outs, feed, None)):.0f}  iobind(ort outs) {t(run_io):.0f}  iobind(prealloc) {t(run_io2):.0f} us")
a = sess.run(outs, feed); run_io2()
print("equal", all(np.array_equal(x, pre[o]) for o, x in zip(outs, a)))
