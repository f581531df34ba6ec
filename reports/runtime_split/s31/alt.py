"""Target pass at B = 1 / 2 / 4 repeated, alternating B, after drafter context + block, after a 2 ms sleep.

    python cap.py ENGINE_DIR && python alt.py ENGINE_DIR
"""
import sys
import time, pickle
import numpy as np
from pathlib import Path
from dspark_export.runtime.api import Runtime
from dspark_export.engines.profiler import engine_feed
rt = Runtime.open(Path(sys.argv[1]), policy='ar', threads=2)
g = rt.engines.manifest.data['graphs']
F = {b: engine_feed(g, 'target', b, 128) for b in (1, 2, 4)}
R = {b: rt.engines.runner('target', b) for b in (1, 2, 4)}
bf = engine_feed(g, 'drafter_block', 1, 128); br = rt.engines.runner('drafter_block', 1)
cf = pickle.load(open('feeds.pkl','rb'))['drafter_context.N4.json']; cr = rt.engines.runner('drafter_context', 4)
def t(b):
    s = time.perf_counter(); R[b].infer(F[b]); return time.perf_counter() - s
for rep in range(2):
    out = {}
    for b in (1, 2, 4):
        for _ in range(3): t(b)
        out[('repeat', b)] = np.median([t(b) for _ in range(30)])
    seq = []
    for _ in range(30):
        for b in (1, 2, 4): seq.append((b, t(b)))
    for b in (1, 2, 4): out[('alternating B', b)] = np.median([x for bb, x in seq if bb == b])
    for b in (1, 2, 4):
        xs = []
        for _ in range(30):
            cr.infer(cf); br.infer(bf); xs.append(t(b))
        out[('after context+block', b)] = np.median(xs)
    for b in (1, 2, 4):
        xs = []
        for _ in range(30):
            time.sleep(0.002); xs.append(t(b))
        out[('after 2ms sleep', b)] = np.median(xs)
    for k in ['repeat', 'alternating B', 'after context+block', 'after 2ms sleep']:
        print(f"{k:22s}", '  '.join(f"B{b} {1e3*out[(k,b)]:.2f}" for b in (1, 2, 4)))
