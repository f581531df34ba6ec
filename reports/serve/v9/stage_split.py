"""Stage split of bench serve's closed loop, ar vs dspark-async, same prompts, alternating."""
import sys, time, collections, json
from pathlib import Path
import numpy as np
from dspark_export.bench import serve as S
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import stages as ST, generator as G
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams

eng, C, reqs, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]); POLS = sys.argv[5].split(",") if len(sys.argv) > 5 else ["ar", "dspark-async"]
T = collections.defaultdict(float); N = collections.Counter()
def wrap(cls, name):
    f = getattr(cls, name)
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: T[name] += time.perf_counter() - t; N[name] += 1
    setattr(cls, name, w)
for n in ["flush_context", "propose", "target_pass", "verify", "commit_rows"]: wrap(ST.EngineStages, n)
for n in ["_apply", "_step_profile", "_schedule", "speculative_step", "step"]: wrap(G.Generator, n)
cfg = S.ServeBenchConfig(engine_dir=Path(eng), concurrency=(C,), policies=("ar", "dspark-async"), requests=reqs,
                         max_new_tokens=64, threads=2, datasets_dir=Path("/work/shared/eval_datasets"))
rt = Runtime.open(cfg.engine_dir, policy="ar", threads=2)
src = S._Prompts(cfg, lambda t: rt.encode(t, True), 4096)
prompts = src.first(reqs)
print("prompt lens", sorted(len(p[2]) for p in prompts))
params = SamplingParams(max_new_tokens=64, temperature=0.0, seed=0)
warm = SamplingParams(max_new_tokens=8, temperature=0.0, seed=0)
res = collections.defaultdict(list)
for rep in range(reps):
    for name in (POLS if rep % 2 == 0 else POLS[::-1]):
        pol = parse_policy(name)
        Generator(rt.engines, pol).generate([ids for _, _, ids in prompts[:C]], [warm] * C)
        T.clear(); N.clear()
        gen = Generator(rt.engines, S._timed(pol))
        run = S._closed_loop(gen, prompts, C, params)
        thr = run.window_tokens / run.window_s
        steps = N["step"]
        res[name].append(thr)
        print(f"{name:13s} rep{rep} thr {thr:6.1f} wall {run.wall_s:6.2f} steps {steps} tau {np.mean([gen.result(r).stats.committed_in_rounds/max(1,gen.result(r).stats.rounds) for r in run.completed]):.2f} vlen {np.mean([gen.result(r).stats.draft_tokens/max(1,gen.result(r).stats.rounds) for r in run.completed]):.2f} step_ms {1e3*T['step']/steps:6.1f} skipped {gen.drafts_skipped} "
              + " ".join(f"{k}={1e3*T[k]/steps:.2f}" for k in ["target_pass","verify","commit_rows","flush_context","propose","_apply","_schedule","_step_profile"])
              + f" flushN={N['flush_context']}", flush=True)
for k, v in res.items(): print(k, np.median(v), v)
