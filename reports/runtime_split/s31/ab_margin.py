"""(python ab_margin.py ENGINE_DIR 0.2,0.1,0.05,0.3 ROUNDS) dspark-async at several skip margins vs ar, interleaved per prompt (21 peer prompts, 128 tok, greedy)."""
import sys, time
import numpy as np
from dspark_export.bench.peers import PeersBenchConfig
from dspark_export.runtime.api import Runtime
from dspark_export.runtime import draft_control as DC
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
eng = sys.argv[1]; margins = [float(m) for m in sys.argv[2].split(',')]; rounds = int(sys.argv[3]); pol = sys.argv[4] if len(sys.argv) > 4 else 'dspark-async'
prompts = PeersBenchConfig(eng, datasets=('gsm8k','humaneval','mt-bench'), datasets_dir='/work/shared/eval_datasets', prompts_per_dataset=7).prompts
rt = Runtime.open(eng, policy='ar', threads=2)
ids = [rt.encode(q, True) for q in prompts]
systems = [('ar', None)] + [(pol, m) for m in margins]
gens = {s: Generator(rt.engines, parse_policy(s[0])) for s in systems}
def run(s, x, n):
    if s[1] is not None: DC._SKIP_MARGIN = s[1]
    for c in [gens[s].controller] if hasattr(gens[s], 'controller') else []:
        if s[1] is not None: c.margin = s[1]
    [r] = gens[s].generate([x], [SamplingParams(max_new_tokens=n)]); return r
for s in systems: run(s, ids[0], 4)
wall = {s: np.zeros((rounds, len(ids))) for s in systems}; toks = {s: {} for s in systems}; rnds = {s: 0 for s in systems}
for k in range(rounds):
    for i, x in enumerate(ids):
        for s in (systems if k % 2 == 0 else systems[::-1]):
            t = time.perf_counter(); r = run(s, x, 128); wall[s][k, i] = time.perf_counter() - t
            toks[s][i] = list(r.token_ids); rnds[s] += r.stats.rounds
base = systems[0]
for s in systems:
    n = sum(len(t) for t in toks[s].values())
    r = [round(float(a / b), 3) for a, b in zip(wall[base].sum(1), wall[s].sum(1))]
    print(f"{s[0]:13s} margin {s[1]}  {n/np.median(wall[s],0).sum():7.2f} tok/s  x ar per round {r}  tau {rounds*n/rnds[s]:.2f} identical {all(toks[s][i]==toks[base][i] for i in toks[s])}", flush=True)
