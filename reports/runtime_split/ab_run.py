"""One timed run: greedy generation of the same prompts with each policy; prints JSON (tokens, seconds)."""
import json, sys, time
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams

engine_dir, n_tokens = sys.argv[1], int(sys.argv[2])
prompts = ["What is the capital of France? Answer in one sentence.", "Write a haiku about GPUs.",
           "Explain speculative decoding to a child.", "List three prime numbers and add them."]
rt = Runtime.open(engine_dir, policy="ar")
ids = [rt.encode(p, chat=True) for p in prompts]
out = {}
for policy in ["ar", "fixed:7", "dspark", "dspark-async"]:
    gen = Generator(rt.engines, parse_policy(policy))
    gen.generate([ids[0]], [SamplingParams(max_new_tokens=4)])        # warm-up
    # single user: one request at a time
    t0 = time.perf_counter()
    single = [gen.generate([p], [SamplingParams(max_new_tokens=n_tokens)])[0].token_ids for p in ids]
    t_single = time.perf_counter() - t0
    # batch: all four at once
    t0 = time.perf_counter()
    batch = [r.token_ids for r in gen.generate(ids, [SamplingParams(max_new_tokens=n_tokens)] * len(ids))]
    t_batch = time.perf_counter() - t0
    out[policy] = {"single_tokens": single, "single_s": t_single, "batch_tokens": batch, "batch_s": t_batch}
print(json.dumps(out))
