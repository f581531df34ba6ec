"""C = 4 closed batch (32 peer-style prompts, 64 tokens, max_slots 4): per policy, wall and the time in
flush_context, propose, the drafter-context and drafter-block engine calls, and SkipController.draft_count.

    python reports/runtime_split/s37/c4_split.py ENGINE_DIR
"""
import sys, time, collections
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "s35"))
from dspark_export.engines.ort.runner import use_shared_thread_pool; use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import stages as ST, draft_control as DC
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench.peers import PeersBenchConfig
from split_timing import T, N, wrap, wrap_infer
wrap_infer()
for cls, name in [(ST.EngineStages, "flush_context"), (ST.EngineStages, "propose"), (ST.EngineStages, "target_pass"), (ST.EngineStages, "verify"), (DC.SkipController, "draft_count")]:
    wrap(cls, name)
eng = sys.argv[1]
rt = Runtime.open(eng, policy="ar", threads=2)
prompts = PeersBenchConfig(eng, datasets=("gsm8k", "humaneval", "mt-bench"), datasets_dir="/work/shared/eval_datasets", prompts_per_dataset=11).prompts[:32]
ids = [rt.encode(q, True) for q in prompts]
gens = {p: Generator(rt.engines, parse_policy(p), max_slots=4) for p in ("ar", "dspark-async")}
for g in gens.values(): g.generate(ids[:4], [SamplingParams(max_new_tokens=16)] * 4)
for rep in range(2):
    for p, g in gens.items():
        T.clear(); N.clear(); t = time.perf_counter()
        out = g.generate(ids, [SamplingParams(max_new_tokens=64)] * len(ids))
        w = time.perf_counter() - t; n = sum(len(r.token_ids) for r in out)
        print(f"{p:13s} {n / w:6.1f} tok/s wall {w:.2f}s |", " ".join(f"{k} {T[k]*1e3:.0f}ms/{N[k]}" for k in sorted(T)), flush=True)
