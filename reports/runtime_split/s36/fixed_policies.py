import sys, time, numpy as np
from dspark_export.engines.ort.runner import use_shared_thread_pool; use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench.peers import PeersBenchConfig
eng = sys.argv[1]; sel = [int(x) for x in sys.argv[2].split(",")]; pols = sys.argv[3].split(",")
prompts = PeersBenchConfig(eng, datasets=("gsm8k", "humaneval", "mt-bench"), datasets_dir="/work/shared/eval_datasets", prompts_per_dataset=7).prompts
rt = Runtime.open(eng, policy="ar", threads=2)
ids = [rt.encode(prompts[i], True) for i in sel]
gens = {p: Generator(rt.engines, parse_policy(p)) for p in pols}
for g in gens.values(): g.generate([ids[0]], [SamplingParams(max_new_tokens=8)])
W = {p: np.zeros((2, len(ids))) for p in pols}; acc = {p: [0, 0] for p in pols}
for rep in range(2):
    for i, x in enumerate(ids):
        for p in (pols if rep % 2 == 0 else pols[::-1]):
            t = time.perf_counter(); [r] = gens[p].generate([x], [SamplingParams(max_new_tokens=128)]); W[p][rep, i] = time.perf_counter() - t
            if rep == 0: acc[p][0] += r.stats.accepted_tokens; acc[p][1] += r.stats.draft_tokens
for p in pols:
    print(p, "ar/p per round", [round(float(a), 3) for a in W["ar"].sum(1) / W[p].sum(1)], "accepted/verified", acc[p])
