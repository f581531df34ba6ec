"""Single-user engine split (python su_split.py ENGINE_DIR ar,dspark,dspark-async): per engine, calls and ms; per policy wall. 21 peer prompts (7 gsm8k/humaneval/mt-bench), 128 tok."""
import sys, time, collections, json
from pathlib import Path
import numpy as np
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import stages as ST
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench import peers as P
eng = sys.argv[1]; pols = sys.argv[2].split(","); nprompt = int(sys.argv[3]) if len(sys.argv) > 3 else 21
T = collections.defaultdict(float); N = collections.Counter()
orig = ST.EngineStages.infer
def inf(self, runner, feed):
    t = time.perf_counter()
    try: return orig(self, runner, feed)
    finally:
        k = Path(str(runner.key.path)).name; T[k] += time.perf_counter() - t; N[k] += 1
ST.EngineStages.infer = inf
rt = Runtime.open(Path(eng), policy="ar", threads=2)
from dspark_export.bench.peers import PeersBenchConfig
prompts = PeersBenchConfig(eng, datasets=('gsm8k','humaneval','mt-bench'), datasets_dir='/work/shared/eval_datasets', prompts_per_dataset=7).prompts[:nprompt]
ids = [rt.encode(q, True) for q in prompts]
for pol in pols:
    gen = Generator(rt.engines, parse_policy(pol))
    gen.generate([ids[0]], [SamplingParams(max_new_tokens=8)])
    T.clear(); N.clear()
    t0 = time.perf_counter(); ntok = 0; rounds = 0
    for x in ids:
        [r] = gen.generate([x], [SamplingParams(max_new_tokens=128)]); ntok += len(r.token_ids); rounds += r.stats.rounds
    wall = time.perf_counter() - t0
    eng_s = sum(T.values())
    print(f"{pol:13s} {ntok/wall:6.1f} tok/s wall {wall:.2f}s rounds {rounds} tau {ntok/rounds:.2f} host {wall-eng_s:.2f}s ({1e3*(wall-eng_s)/rounds:.2f} ms/round)")
    groups = collections.defaultdict(lambda: [0.0, 0])
    for k in T:
        g = k.split('.')[0] + ('' if not k.startswith('target') else ('.N1' if k.startswith('target.N1.') else '.other'))
        groups[g][0] += T[k]; groups[g][1] += N[k]
    for g, (t, n) in sorted(groups.items()): print(f"   {g:22s} calls {n:5d} total {t:6.2f}s  {1e3*t/max(n,1):6.2f} ms/call  {1e3*t/rounds:5.2f} ms/round")
