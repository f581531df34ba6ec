"""Two closed loops at C in lockstep (never-drafting dspark-async vs dspark-async), recording per decode-only
step the target KV capacity, slot count and target pass wall."""
import sys, time, numpy as np
from dspark_export.bench import serve as SB
from dspark_export.engines.ort.runner import use_shared_thread_pool
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
use_shared_thread_pool(2)
eng, C, N = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rt = Runtime.open(eng, policy="ar", threads=2)
cfg = SB.ServeBenchConfig(eng, concurrency=(C,), policies=("ar",), requests=N, max_new_tokens=64, datasets_dir="/work/shared/eval_datasets")
prompts = SB._Prompts(cfg, lambda t: rt.encode(t, True), 2048).first(N)
lens = np.random.default_rng(0).integers(32, 97, size=N)
class L:
    def __init__(s, name):
        s.g = Generator(rt.engines, parse_policy("dspark-async"))
        if name == "never": s.g.controller.draft_count = lambda R, S, p: 0
        s.name, s.sub, s.rec = name, 0, []
        tp = s.g.stages.target_pass
        def timed(*a, _tp=tp, _s=s):
            t = time.perf_counter(); r = _tp(*a); _s.last = time.perf_counter() - t; return r
        s.g.stages.target_pass = timed
        for _ in range(C): s.submit()
    def submit(s):
        if s.sub < N:
            s.g.submit(prompts[s.sub][2], SamplingParams(max_new_tokens=int(lens[s.sub])), s.on); s.sub += 1
    def on(s, rid, new, res):
        if res.finish_reason is not None: s.submit()
    def step(s):
        act = s.g.batch.active(); dec = bool(act) and all(x.decoding for x in act) and not s.g.batch.waiting
        s.last = None; s.g.step()
        if dec and s.last is not None:
            kv = s.g.batch.target_kv
            s.rec.append((kv.capacity, s.g.num_slots, int(kv.lens.max()), s.last * 1e3))
loops = [L("never"), L("async")]
while any(l.g.has_work() for l in loops):
    for l in loops:
        if l.g.has_work(): l.step()
for l in loops:
    r = np.array(l.rec)
    print(l.name, "dec steps", len(r), "capacity mean %.0f" % r[:, 0].mean(), "slots mean %.2f" % r[:, 1].mean(),
          "maxlen mean %.0f" % r[:, 2].mean(), "target ms mean %.3f median %.3f" % (r[:, 3].mean(), np.median(r[:, 3])))
    for cap in sorted(set(r[:, 0].astype(int))):
        m = r[:, 0] == cap
        print("   cap", cap, "steps", m.sum(), "target ms %.3f" % np.median(r[m, 3]))
