"""One target pass at B rows for several target graphs, each session alone in turn (three rounds, graphs in
reverse order every other round; median ms of 30 runs; context 128 over a 256-entry cache, 2 threads).

    python target_pass.py A/target.onnx,B/target.onnx 1,2,4,6,8     # run from the repository root
"""
import gc
import sys
import time

import numpy as np
import onnxruntime as ort

sys.path.insert(0, "scripts")
from bench_target_pass import feed_for  # noqa: E402
graphs=sys.argv[1].split(','); rows=[int(x) for x in sys.argv[2].split(',')]
res={g:{r:[] for r in rows} for g in graphs}
for rnd in range(3):
  for g in (graphs if rnd%2==0 else graphs[::-1]):
    so=ort.SessionOptions(); so.intra_op_num_threads=2; so.log_severity_level=3
    s=ort.InferenceSession(g,so,providers=['CPUExecutionProvider'])
    for r in rows:
        f=feed_for(s,r,128,256)
        for _ in range(5): s.run(['logits'],f)
        t=time.perf_counter()
        for _ in range(30): s.run(['logits'],f)
        res[g][r].append((time.perf_counter()-t)/30*1e3)
    del s; gc.collect()
for g in graphs: print(g, ' '.join('B%d %.2f'%(r,np.median(v)) for r,v in res[g].items()), ' t8/t1 %.2f'%(np.median(res[g][rows[-1]])/np.median(res[g][rows[0]])))
