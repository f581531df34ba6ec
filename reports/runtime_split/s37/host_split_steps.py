"""Per step of one policy on 7 peer prompts of one dataset (128 new tokens, two rounds): wall time of the loop's
parts, of each engine call (`ortinfer.<graph>`) and of session.run, µs per step.

    python reports/runtime_split/s37/host_split_steps.py ENGINE_DIR POLICY DATASET
"""
import sys, time, collections
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "s35"))
from dspark_export.engines.ort.runner import use_shared_thread_pool, OrtRunner; use_shared_thread_pool(2)
import onnxruntime as ort
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import stages as ST, generator as G, faults as F, kv_cache as KV, batch as B
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench.peers import PeersBenchConfig
from split_timing import T, N, wrap, wrap_infer
wrap_infer()
def wrapf(mod, name):
    orig = getattr(mod, name)
    def timed(*a, **k):
        t = time.perf_counter()
        try: return orig(*a, **k)
        finally: T[name] += time.perf_counter() - t; N[name] += 1
    setattr(mod, name, timed)
wrapf(F, "check_target"); wrapf(ST, "pack_segments")
orig = ort.InferenceSession.run
def run(self, *a, **k):
    t = time.perf_counter(); r = orig(self, *a, **k); T["session.run"] += time.perf_counter() - t; N["session.run"] += 1; return r
import dspark_export.engines.ort.runner as RR
def sess_runner_infer(self, feed, _o=OrtRunner.infer):
    t = time.perf_counter(); r = _o(self, feed); k = "ortinfer." + self.key.graph; T[k] += time.perf_counter() - t; N[k] += 1; return r
OrtRunner.infer = sess_runner_infer
ort.InferenceSession.run = run
for cls, name in [(OrtRunner, "check_feed"), (KV.KVCache, "feed"), (KV.KVCache, "append"), (KV.KVCache, "reserve"), (KV.KVCache, "_relayout"), (KV.KVCache, "shrink"),
                  (ST.EngineStages, "target_pass"), (ST.EngineStages, "verify"), (ST.EngineStages, "commit_rows"), (ST.EngineStages, "flush_context"), (ST.EngineStages, "propose"), (ST.EngineStages, "draft"),
                  (G.Generator, "_apply"), (G.Generator, "_emit"), (G.Generator, "_schedule"), (G.Generator, "speculative_step"), (G.Generator, "step")]:
    try: wrap(cls, name)
    except AttributeError as e: print("skip", cls, name)
eng = sys.argv[1]; pol = sys.argv[2] if len(sys.argv) > 2 else "ar"
rt = Runtime.open(eng, policy="ar", threads=2)
prompts = PeersBenchConfig(eng, datasets=(sys.argv[3] if len(sys.argv) > 3 else "mt-bench",), datasets_dir="/work/shared/eval_datasets", prompts_per_dataset=7).prompts
ids = [rt.encode(q, True) for q in prompts]
g = Generator(rt.engines, parse_policy(pol))
g.generate([ids[0]], [SamplingParams(max_new_tokens=32)])
for rep in range(2):
    T.clear(); N.clear(); t = time.perf_counter()
    for x in ids: g.generate([x], [SamplingParams(max_new_tokens=128)])
    w = time.perf_counter() - t; steps = N["Generator.step"]
    print(pol, "steps", steps, f"wall/step {w/steps*1e6:.0f}us")
    for k in sorted(T, key=lambda k: -T[k]): print(f"   {k:28s} {T[k]*1e6/steps:7.0f} us/step  n={N[k]}")
