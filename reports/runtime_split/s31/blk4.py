"""Drafter block (R = 1) right after a target pass (B = 4) and the drafter context (N = 4), and run again at once,
for several engine directories sharing the int4 target, interleaved (6 rounds x 25).

    python cap.py DIR_A && python blk4.py DIR_A,DIR_B,...
"""
import pickle, time, sys
import numpy as np
from pathlib import Path
from dspark_export.runtime.api import Runtime
f = pickle.load(open('feeds.pkl','rb'))
tfeed = f['target.N4.json']; bfeed = f['drafter_block.R1.json']; cfeed = f['drafter_context.N4.json']
dirs = sys.argv[1].split(',')
rts = {d: Runtime.open(Path(d), policy='ar', threads=2) for d in dirs}
tr = rts[dirs[0]].engines.runner('target', 4)
res = {d: {'cold': [], 'warm': [], 'ctx': []} for d in dirs}
for rep in range(6):
    for d in (dirs if rep % 2 == 0 else dirs[::-1]):
        br = rts[d].engines.runner('drafter_block', 1); cr = rts[d].engines.runner('drafter_context', 4)
        for _ in range(3): br.infer(bfeed)
        c, w, x = [], [], []
        for _ in range(25):
            tr.infer(tfeed)
            t = time.perf_counter(); cr.infer(cfeed); x.append(time.perf_counter() - t)
            t = time.perf_counter(); br.infer(bfeed); c.append(time.perf_counter() - t)
            t = time.perf_counter(); br.infer(bfeed); w.append(time.perf_counter() - t)
        res[d]['cold'].append(np.median(c) * 1e3); res[d]['warm'].append(np.median(w) * 1e3); res[d]['ctx'].append(np.median(x) * 1e3)
for d in dirs:
    print(f"{d:16s} block after target+context: {np.median(res[d]['cold']):.2f} ms [{min(res[d]['cold']):.2f}-{max(res[d]['cold']):.2f}]  block again: {np.median(res[d]['warm']):.2f}  context after target: {np.median(res[d]['ctx']):.2f}")
