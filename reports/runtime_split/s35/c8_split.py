"""C = 8: 32 requests (gsm8k, humaneval, mt-bench first turns), 8 admitted at a time, 64 new tokens; per policy the
wall time and the time per step in each part (ms, summed / steps)."""
import sys, time
from dspark_export.engines.ort.runner import use_shared_thread_pool; use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import stages as ST, generator as G
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench.peers import PeersBenchConfig
from split_timing import T, N, wrap, wrap_infer
for cls, name in [(ST.EngineStages, "flush_context"), (ST.EngineStages, "propose"), (G.Generator, "_schedule"),
                  (ST.EngineStages, "target_pass"), (ST.EngineStages, "verify"), (ST.EngineStages, "commit_rows"),
                  (G.Generator, "_apply"), (G.Generator, "speculative_step"), (G.Generator, "step")]:
    wrap(cls, name)
wrap_infer()
eng = sys.argv[1]; C = int(sys.argv[2]) if len(sys.argv) > 2 else 8
rt = Runtime.open(eng, policy="ar", threads=2)
prompts = PeersBenchConfig(eng, datasets=("gsm8k", "humaneval", "mt-bench"), datasets_dir="/work/shared/eval_datasets",
                           prompts_per_dataset=11).prompts[:32]
ids = [rt.encode(q, True) for q in prompts]
gens = {p: Generator(rt.engines, parse_policy(p), max_slots=C) for p in ("ar", "dspark-async")}
for g in gens.values(): g.generate(ids[:C], [SamplingParams(max_new_tokens=8)] * C)
for rep in range(2):
    for p in (("ar", "dspark-async") if rep % 2 == 0 else ("dspark-async", "ar")):
        g = gens[p]; T.clear(); N.clear(); t0 = time.perf_counter()
        g.generate(ids, [SamplingParams(max_new_tokens=64)] * len(ids))
        wall = time.perf_counter() - t0; steps = N["Generator.step"]
        print(f"{p:13s} wall {wall:.2f}s steps {steps} skipped {g.drafts_skipped}", " ".join(
            f"{k.split('.')[-1] if not k.startswith('infer') else k}:{N[k]}/{T[k]*1e3/steps:.2f}" for k in sorted(T)), flush=True)
