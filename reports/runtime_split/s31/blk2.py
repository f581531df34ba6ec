"""The drafter block (R = 1) after a target pass, a 64 MB memset, a 5 ms sleep, or back to back (median of 60).

    python cap.py ENGINE_DIR && python blk2.py ENGINE_DIR
"""
import sys
import pickle, time
import numpy as np
from pathlib import Path
from dspark_export.runtime.api import Runtime
f = pickle.load(open('feeds.pkl','rb'))
rt = Runtime.open(Path(sys.argv[1]), policy='ar', threads=2)
tr = rt.engines.runner('target', 4); tfeed = f['target.N4.json']
br = rt.engines.runner('drafter_block', 1); bfeed = f['drafter_block.R1.json']
big = np.ones(64 << 20, np.uint8)
for name, pre in [('after target', lambda: tr.infer(tfeed)), ('after target + sleep 5ms', lambda: (tr.infer(tfeed), time.sleep(0.005))),
                  ('after 64MB memset', lambda: big.fill(1)), ('after sleep 5ms', lambda: time.sleep(0.005)), ('back-to-back', lambda: None)]:
    ts = []
    for _ in range(60):
        pre(); t = time.perf_counter(); br.infer(bfeed); ts.append(time.perf_counter() - t)
    print(f"{name:28s} {np.median(ts)*1e3:.2f} ms  p25 {np.percentile(ts,25)*1e3:.2f} p75 {np.percentile(ts,75)*1e3:.2f}")
