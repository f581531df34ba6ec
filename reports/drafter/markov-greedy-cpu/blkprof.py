"""Drafter block node times under ONNX Runtime's profiler, one thread, on a feed captured from the loop:
python blkprof.py d c d c   (engine directories /tmp/eng/<name>; the feed comes from /tmp/eng/c)."""
import sys, json, time, collections
from pathlib import Path
import numpy as np, onnxruntime as ort
from dspark_export.runtime.api import Runtime
from dspark_export.runtime import stages as ST
from dspark_export.runtime.request import SamplingParams
from dspark_export.plugins import cpu_ops
cap = {}
orig = ST.EngineStages.infer
def inf(self, runner, feed):
    if 'drafter_block' in str(runner.key.path) and 'f' not in cap: cap['f'] = {k: np.array(v) for k, v in feed.items()}
    return orig(self, runner, feed)
ST.EngineStages.infer = inf
rt = Runtime.open(Path('/tmp/eng/c'), policy="dspark", threads=1)
rt.generate_text(["Write a python function that reverses a list."], SamplingParams(max_new_tokens=16))
feed = cap['f']
for e in sys.argv[1:]:
    so = ort.SessionOptions(); so.intra_op_num_threads = 1; so.enable_profiling = True
    g = f'/tmp/eng/{e}/graphs/drafter_block.onnx'
    cpu_ops.register_for(so, g)
    s = ort.InferenceSession(g, so, providers=['CPUExecutionProvider'])
    names = {i.name for i in s.get_inputs()}
    f = {k: v for k, v in feed.items() if k in names}
    for _ in range(20): s.run(None, f)
    t = time.perf_counter()
    for _ in range(100): s.run(None, f)
    wall = (time.perf_counter() - t) * 10
    prof = s.end_profiling()
    ev = json.load(open(prof))
    tot = collections.Counter(); cnt = collections.Counter()
    for x in ev:
        if x.get('cat') == 'Node' and x['name'].endswith('_kernel_time'):
            tot[x['name'][:-12]] += x['dur']; cnt[x['name'][:-12]] += 1
    runs = 120
    print(e, 'wall ms/run', round(wall, 3), 'node ms/run', round(sum(tot.values())/runs/1000, 3), 'nodes', len(tot))
    for k, v in tot.most_common(12): print('   ', round(v/runs, 1), 'us', k)
