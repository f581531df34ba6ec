"""Single user, one process: per policy, tokens/s, rounds, τ, host time and each engine's calls / mean ms
(target passes by row count), two rounds alternating the policies.

    python stage_split.py ENGINE_DIR POLICY[,POLICY...] [PROMPTS_PER_DATASET] [DATASET,...]

The prompts are `bench peers`' (gsm8k, humaneval, mt-bench unless named, chat template), 128 new tokens, 2 threads."""
import sys, time, collections
from pathlib import Path
import numpy as np
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import stages as ST
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench.peers import PeersBenchConfig
eng=sys.argv[1]; pols=sys.argv[2].split(','); npp=int(sys.argv[3]) if len(sys.argv)>3 else 7
T = collections.defaultdict(float); N = collections.Counter()
orig = ST.EngineStages.infer
def inf(self, runner, feed):
    t = time.perf_counter()
    try: return orig(self, runner, feed)
    finally:
        k = runner.key.graph
        if k == 'target': k += '%d' % feed['input_ids'].shape[0]
        T[k] += time.perf_counter() - t; N[k] += 1
ST.EngineStages.infer = inf
rt = Runtime.open(Path(eng), policy="ar", threads=2)
prompts = PeersBenchConfig(eng, datasets=tuple(sys.argv[4].split(',')) if len(sys.argv)>4 else ('gsm8k','humaneval','mt-bench'), datasets_dir='/work/shared/eval_datasets', prompts_per_dataset=npp).prompts
ids = [rt.encode(q, True) for q in prompts]
gens = {p: Generator(rt.engines, parse_policy(p)) for p in pols}
for g in gens.values(): g.generate([ids[0]], [SamplingParams(max_new_tokens=16)])
for rep in range(2):
    for pol in (pols if rep % 2 == 0 else pols[::-1]):
        g = gens[pol]; T.clear(); N.clear(); t0 = time.perf_counter(); toks = rounds = acc = dr = 0
        for x in ids:
            r = g.generate([x], [SamplingParams(max_new_tokens=128)])[0]
            toks += len(r.token_ids); rounds += r.stats.rounds; acc += r.stats.accepted_tokens; dr += r.stats.draft_tokens
        wall = time.perf_counter() - t0; e = sum(T.values())
        print(f"{pol:13s} {toks/wall:6.1f} tok/s wall {wall:.2f} rounds {rounds} tau {toks/rounds:.2f} acc/draft {acc}/{dr} host {wall-e:.2f}s |", " ".join(f"{k}:{N[k]}/{T[k]*1e3/N[k]:.2f}ms" for k in sorted(T) if not k.startswith("target") or int(k[6:]) <= 16), flush=True)
