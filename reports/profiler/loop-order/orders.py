import sys, itertools, numpy as np
from pathlib import Path
from dspark_export.engines.ort.runner import use_shared_thread_pool
use_shared_thread_pool(2)
from dspark_export.engines.engine_set import EngineSet
from dspark_export.engines import profiler as P
E = EngineSet.open(Path(sys.argv[1]), threads=2)
g = E.manifest.data["graphs"]; blk = g["drafter_block"]["spec"]["block_size"]; spec = g["target"]["spec"]
pool = {}; items = {}
for b in sorted(E.buckets("target"), reverse=True):
    items[("t", b)] = (E.runner_exact("target", b), P._target_feed(spec, b, 128, blk, pool))
for r in sorted(E.buckets("drafter_block"), reverse=True):
    items[("d", r)] = (E.runner_exact("drafter_block", r), P._block_feed(g["drafter_block"]["spec"], r, 128, blk, pool))
tb = E.buckets("target"); db = E.buckets("drafter_block")
old = [k for pair in itertools.zip_longest([("t", b) for b in tb], [("d", r) for r in db]) for k in pair if k]
new = [("t", b) for b in sorted(tb, reverse=True) if b > max(db)] + \
      [k for r in sorted(db, reverse=True) for k in (("d", r), ("t", r)) if ("t", r) in items]
new += [k for k in items if k not in new]
print(old); print(new)
for rep in range(2):
    for name, order in (("old", old), ("new", new)):
        s = P.time_interleaved({k: items[k] for k in order}, 3, 10, 1000.0)
        print(name, " ".join(f"{k[0]}{k[1]}={s[k]['median_ms']:.2f}" for k in sorted(s, key=lambda k: (k[0], k[1]))))
