"""Single user: ar, dspark-async (the controller restarts when a request arrives in an empty batch), dspark-async
whose controller never restarts (one Generator per system across the 21 peer prompts, interleaved per prompt)."""
import sys, time, numpy as np
from dspark_export.engines.ort.runner import use_shared_thread_pool
use_shared_thread_pool(2)
from dspark_export.bench.peers import PeersBenchConfig
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
E = sys.argv[1]; rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
prompts = PeersBenchConfig(E, datasets=("gsm8k", "humaneval", "mt-bench"), datasets_dir="/work/shared/eval_datasets",
                           prompts_per_dataset=7).prompts
rt = Runtime.open(E, policy="ar", threads=2)
ids = [rt.encode(q, True) for q in prompts]
gens = {"ar": Generator(rt.engines, parse_policy("ar")), "async": Generator(rt.engines, parse_policy("dspark-async")),
        "async no restart": Generator(rt.engines, parse_policy("dspark-async"))}
gens["async no restart"].controller.restart = lambda: None
names = list(gens)
def run(name, x):
    [r] = gens[name].generate([x], [SamplingParams(max_new_tokens=128)])
    return r.token_ids
for n in names: run(n, ids[0])
wall = {n: np.zeros((rounds, len(ids))) for n in names}; toks = {n: {} for n in names}
for k in range(rounds):
    for i, x in enumerate(ids):
        for n in (names if k % 2 == 0 else names[::-1]):
            t0 = time.perf_counter(); toks[n][i] = run(n, x); wall[n][k, i] = time.perf_counter() - t0
ar = wall["ar"].sum(axis=1); N = sum(len(t) for t in toks["ar"].values())
for n in names:
    per = [round(float(a / w), 3) for a, w in zip(ar, wall[n].sum(axis=1))]
    print(f"{n:16s} {N / np.median(wall[n], axis=0).sum():6.2f} tok/s ×ar per round {per} identical {all(toks[n][i] == toks['ar'][i] for i in toks['ar'])}")
    med = np.median(wall["ar"], axis=0) / np.median(wall[n], axis=0)
    print("   per dataset ×ar (median wall per prompt):", [round(float(med[7 * j:7 * j + 7].mean()), 3) for j in range(3)])
