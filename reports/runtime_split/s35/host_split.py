"""Host time per step (µs, averaged over every step) of the loop's parts, ar against dspark-async, on the 7 mt-bench
prompts of the peer set (128 new tokens), one Generator per policy, two rounds.

    python reports/runtime_split/s35/host_split.py ENGINE_DIR
"""
import sys
from dspark_export.engines.ort.runner import use_shared_thread_pool; use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import stages as ST, generator as G, draft_control as DC
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench.peers import PeersBenchConfig
from split_timing import T, N, wrap
for cls, name in [(DC.SkipController, "draft_count"), (DC.DraftController, "draft_count"), (G.Generator, "_step_profile"),
                  (ST.EngineStages, "flush_context"), (G.Generator, "_schedule"), (ST.EngineStages, "target_pass"),
                  (ST.EngineStages, "infer"), (ST.EngineStages, "verify"), (ST.EngineStages, "commit_rows"), (G.Generator, "_apply"),
                  (G.Generator, "speculative_step"), (G.Generator, "step")]:
    wrap(cls, name)
eng = sys.argv[1]
rt = Runtime.open(eng, policy="ar", threads=2)
prompts = PeersBenchConfig(eng, datasets=("mt-bench",), datasets_dir="/work/shared/eval_datasets", prompts_per_dataset=7).prompts
ids = [rt.encode(q, True) for q in prompts]
gens = {p: Generator(rt.engines, parse_policy(p)) for p in ("ar", "dspark-async")}
for rep in range(2):
    for p, g in gens.items():
        T.clear(); N.clear()
        for x in ids: g.generate([x], [SamplingParams(max_new_tokens=128)])
        steps = N["Generator.step"]
        print(p, "steps", steps, " ".join(f"{k}:{T[k]*1e6/steps:.0f}us" for k in sorted(T)))
