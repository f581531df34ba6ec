"""16 concurrent requests, ar, old vs new engine dir, alternated: generated tokens/s per round."""
import sys, time, numpy as np
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.request import SamplingParams
dirs = sys.argv[1:3]; n_new = int(sys.argv[3]); policy = sys.argv[4] if len(sys.argv) > 4 else "ar"
prompts = [f"Question {i}: explain, step by step and in detail, how {t} works." for i, t in enumerate(
    ["a refrigerator", "a bicycle", "the internet", "a vaccine", "a compiler", "photosynthesis", "a battery", "a jet engine",
     "a bank loan", "an election", "a search engine", "a microwave", "GPS", "a heat pump", "a camera", "a database"])]
rts = {d: Runtime.open(d, policy=policy, threads=2) for d in dirs}
ids = [rts[dirs[0]].encode(p, True) for p in prompts]
params = [SamplingParams(max_new_tokens=n_new) for _ in ids]
for d in dirs: rts[d].generate_ids(ids[:2], [SamplingParams(max_new_tokens=4)] * 2)
res = {d: [] for d in dirs}; toks = {}
for k in range(2):
    for d in (dirs if k % 2 == 0 else dirs[::-1]):
        t0 = time.perf_counter(); out = rts[d].generate_ids(ids, params); dt = time.perf_counter() - t0
        n = sum(len(r.token_ids) for r in out); res[d].append(n / dt); toks[d] = [r.token_ids for r in out]
for d in dirs: print(d, "tok/s per round", [round(x, 1) for x in res[d]])
print("new/old per round", [round(b / a, 3) for a, b in zip(res[dirs[0]], res[dirs[1]])], "identical", toks[dirs[0]] == toks[dirs[1]])
