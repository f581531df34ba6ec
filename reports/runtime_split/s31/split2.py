"""(python split2.py ENGINE_DIR C REQUESTS REPEATS ar,dspark-async,noprobe) bench serve closed loop: per-step target_pass time keyed by (rows, width), plus a 'noprobe' dspark-async."""
import sys, time, collections
from pathlib import Path
import numpy as np
from dspark_export.bench import serve as S
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import stages as ST, draft_control as DC
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
eng, C, reqs, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
POLS = sys.argv[5].split(",")
REC = []
orig_run = ST.EngineStages.target_run
def tr(self, segments, slot):
    t = time.perf_counter(); r = orig_run(self, segments, slot); dt = time.perf_counter() - t
    REC.append((sum(len(s.token_ids) for s in segments), r[0].feed["pad_index"].shape[1] if slot is None else -1, dt)); return r
ST.EngineStages.target_run = tr
orig_dc = DC.SkipController.draft_count
NOPROBE = [False]
def dc(self, R, S_, prof):
    n = orig_dc(self, R, S_, prof)
    return 0 if NOPROBE[0] else n
DC.SkipController.draft_count = dc
cfg = S.ServeBenchConfig(engine_dir=Path(eng), concurrency=(C,), policies=("ar",), requests=reqs,
                         max_new_tokens=64, threads=2, datasets_dir=Path("/work/shared/eval_datasets"))
rt = Runtime.open(cfg.engine_dir, policy="ar", threads=2)
src = S._Prompts(cfg, lambda t: rt.encode(t, True), 4096)
prompts = src.first(reqs)
params = SamplingParams(max_new_tokens=64, temperature=0.0, seed=0)
warm = SamplingParams(max_new_tokens=8, temperature=0.0, seed=0)
res = collections.defaultdict(list); agg = collections.defaultdict(lambda: collections.defaultdict(list))
for rep in range(reps):
    for name in (POLS if rep % 2 == 0 else POLS[::-1]):
        NOPROBE[0] = name == "noprobe"
        pol = parse_policy("dspark-async" if name == "noprobe" else name)
        Generator(rt.engines, pol).generate([ids for _, _, ids in prompts[:C]], [warm] * C)
        REC.clear()
        gen = Generator(rt.engines, S._timed(pol))
        run = S._closed_loop(gen, prompts, C, params)
        thr = run.window_tokens / run.window_s
        res[name].append(thr)
        for rows, w, dt in REC: agg[name][(rows, w)].append(dt)
        dec = [dt for rows, w, dt in REC if w == 1 and rows == C]
        print(f"{name:12s} rep{rep} thr {thr:6.1f} passes {len(REC)} full-decode passes {len(dec)} median {1e3*np.median(dec):.2f} ms mean {1e3*np.mean(dec):.2f}; "
              f"other passes {len(REC)-len(dec)} sum {sum(dt for r,w,dt in REC)-sum(dec):.2f}s wall {run.wall_s:.2f} host {run.wall_s-sum(dt for r,w,dt in REC):.2f}s", flush=True)
for k, v in res.items(): print(k, "thr median", np.median(v), v)
for name, d in agg.items():
    print(name, "passes by (rows,width) with width>1:", {k: (len(v), round(1e3*np.median(v),1)) for k, v in sorted(d.items()) if k[1] > 1 and k[1] < 8})
