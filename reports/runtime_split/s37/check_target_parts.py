"""In the loop (ar, 7 mt-bench peer prompts, 128 tokens): µs per step of check_target's parts on first touch
(logits sum, aux sum, K/V stack + sum), of check_target run again right after, and of verify.

    python reports/runtime_split/s37/check_target_parts.py
"""
import sys, time, collections, numpy as np
from dspark_export.engines.ort.runner import use_shared_thread_pool; use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import faults as F, stages as ST
from dspark_export.runtime.kv_cache import layer_names
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench.peers import PeersBenchConfig
T = collections.defaultdict(float); N = collections.Counter()
orig = F.check_target
def check(packed, out, kv_stacked, segments, engine):
    num_layers = kv_stacked.shape[0] // 2
    t0 = time.perf_counter(); l = out["logits"].sum(axis=1)
    t1 = time.perf_counter(); a = out["aux_hidden"].sum(axis=1)
    t2 = time.perf_counter(); kv = np.stack([out[n] for n in layer_names("new_key", num_layers) + layer_names("new_value", num_layers)]).sum(axis=(0, 2, 3))
    t3 = time.perf_counter(); r = orig(packed, out, kv_stacked, segments, engine)
    t4 = time.perf_counter()
    T["logits sum"] += t1 - t0; T["aux sum"] += t2 - t1; T["kv stack+sum"] += t3 - t2; T["check_target again"] += t4 - t3; N["n"] += 1
    return r
F.check_target = check
ov = ST.EngineStages.verify
def verify(self, *a):
    t = time.perf_counter(); r = ov(self, *a); T["verify (after the sums)"] += time.perf_counter() - t; return r
ST.EngineStages.verify = verify
rt = Runtime.open("/tmp/eng/b", policy="ar", threads=2)
prompts = PeersBenchConfig("/tmp/eng/b", datasets=("mt-bench",), datasets_dir="/work/shared/eval_datasets", prompts_per_dataset=7).prompts
ids = [rt.encode(q, True) for q in prompts]
g = Generator(rt.engines, parse_policy("ar"))
g.generate([ids[0]], [SamplingParams(max_new_tokens=16)])
T.clear(); N.clear()
for x in ids: g.generate([x], [SamplingParams(max_new_tokens=128)])
for k, v in T.items(): print(f"{k:28s} {v / N['n'] * 1e6:6.1f} us/step")
