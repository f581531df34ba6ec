#!/usr/bin/env python
"""C = 4 closed loop in one process: ar, dspark-async with the drafter never run (its backlog kept), and
dspark-async, alternated 3 times over the same 32 prompts (64 tokens, greedy); wall time and ms per step by
runtime stage. `--warmup`: before each run, C short requests on a fresh generator of the same policy, as
`bench serve` does.

    python reports/serve/v7-host/c4_variants.py ENGINE_DIR 4 [--warmup]
"""
import sys, time, collections
import numpy as np
from dspark_export.bench.serve import ServeBenchConfig, _closed_loop, _Prompts, _timed
from dspark_export.runtime import stages, draft_control
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
seconds = collections.defaultdict(float)
def wrap(cls, name):
    f = getattr(cls, name)
    def g(self, *a, **k):
        t0 = time.perf_counter(); r = f(self, *a, **k); seconds[name] += time.perf_counter() - t0; return r
    setattr(cls, name, g)
for n in ("flush_context", "propose", "target_pass", "verify", "commit_rows"): wrap(stages.EngineStages, n)
engine_dir, C = sys.argv[1], int(sys.argv[2])
rt = Runtime.open(engine_dir, policy="ar", threads=2)
prompts = _Prompts(ServeBenchConfig(engine_dir, max_new_tokens=64), lambda t: rt.encode(t, True), 4096).first(32)
params = SamplingParams(max_new_tokens=64, temperature=0.0)
orig = draft_control.SkipController.should_draft
res = collections.defaultdict(list)
for rep in range(3):
    for variant in ("ar", "never", "dspark-async"):
        seconds.clear()
        draft_control.SkipController.should_draft = (lambda self, *a: False) if variant == "never" else orig
        pol = parse_policy("ar" if variant == "ar" else "dspark-async")
        if "--warmup" in sys.argv:
            Generator(rt.engines, pol).generate([ids for _, _, ids in prompts[:C]], [SamplingParams(max_new_tokens=8)] * C)
        gen = Generator(rt.engines, _timed(pol))
        steps, step = [0], gen.step
        def counted(step=step):
            steps[0] += 1; step()
        gen.step = counted
        t0 = time.perf_counter(); _closed_loop(gen, prompts, C, params); wall = time.perf_counter() - t0
        res[variant].append(wall)
        print(f"{variant:13s} wall {wall:.2f}s steps {steps[0]} " + " ".join(f"{k} {v*1e3/steps[0]:.2f}" for k, v in seconds.items()), flush=True)
for k, v in res.items(): print(k, "median wall", round(float(np.median(v)), 2))
