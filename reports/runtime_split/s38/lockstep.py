"""Paired closed loops in lockstep at concurrency C: each variant keeps C requests in flight on its own Generator
(bench serve's closed loop: 64 new tokens, the round-robin gsm8k / humaneval / mt-bench chat prompts), and the
variants take turns one step at a time, so the machine's drift hits them alike. Per round the creation order
rotates (the first generators created ran ~1-2 % faster in a null test) and every cache arena is touched to its
largest size first (a relayout into fresh pages cost up to 0.4 s a run: first touch, runtime/kv_cache.py).

    python reports/runtime_split/s38/lockstep.py ENGINE_DIR C ROUNDS VARIANT,VARIANT,... [REQUESTS]

Variants: ar | dspark-async, with suffixes: -split (the old `split_passes`: prefill chunks in passes of their
own, query-width cache room), -never (dspark-async that never drafts), -nostage (no drafter-context backlog
either), -limitN (the drafter-context backlog flushed at N rows instead of the largest context bucket), -eager (the slot count shrinks at the end of the step that freed the slots, not at the next step). Prints per round each variant's steady-window tokens / Σ step wall and its ratio to the first variant,
the mean step of decode-only and prefill steps, and the summary over rounds.
"""
import gc
import sys
import time

import numpy as np

from dspark_export.bench import serve as SB
from dspark_export.engines.ort.runner import use_shared_thread_pool
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams

use_shared_thread_pool(2)
eng, C, rounds, names = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
nreq = int(sys.argv[5]) if len(sys.argv) > 5 else 32
rt = Runtime.open(eng, policy="ar", threads=2)
cfg = SB.ServeBenchConfig(eng, concurrency=(C,), policies=("ar",), requests=nreq, max_new_tokens=64,
                          datasets_dir="/work/shared/eval_datasets")
prompts = SB._Prompts(cfg, lambda t: rt.encode(t, True), 2048).first(nreq)
params = SamplingParams(max_new_tokens=64)


def make(name: str) -> Generator:
    g = Generator(rt.engines, parse_policy("ar" if name.startswith("ar") else "dspark-async"))
    if "-never" in name:
        g.controller.draft_count = lambda R, S, p: 0
    if "-nostage" in name:
        g.stages.drafts = False
    if "-split" in name:
        g.stages.ragged_target = False
    if "-limit" in name:
        g.backlog_limit = int(name.split("-limit")[1].split("-")[0])
    if "-eager" in name:
        release = g.batch.release_finished
        g.batch.release_finished = lambda resize=True: release(True)
    return g


class Loop:
    def __init__(self, name):
        self.name, self.g = name, make(name)
        for kv in (self.g.batch.target_kv, self.g.batch.draft_kv):
            need = 2 * kv.num_layers * C * kv.num_kv_heads * 1024 * kv.head_dim
            if kv._holder[0].size < need:
                kv._holder[0] = np.zeros(need, np.float32)
            kv._holder[0][:] = 0.0
        self.submitted, self.tokens, self.wall, self.steps, self.steady = 0, 0, 0.0, 0, True
        self.finished, self.kind, self.kn = [], {}, {}
        for _ in range(C):
            self.submit()

    def on_token(self, rid, new, result):
        self.tokens += len(new) if self.steady else 0
        if result.finish_reason is not None:
            self.finished.append(rid)

    def submit(self):
        self.g.submit(prompts[self.submitted][2], params, self.on_token)
        self.submitted += 1

    def step(self) -> bool:
        kind = "pre" if self.g.batch.waiting or any(not s.decoding for s in self.g.batch.active()) else "dec"
        t = time.perf_counter()
        self.g.step()
        dt = time.perf_counter() - t
        if self.steady:
            self.wall, self.steps = self.wall + dt, self.steps + 1
            self.kind[kind], self.kn[kind] = self.kind.get(kind, 0) + dt, self.kn.get(kind, 0) + 1
        for rid in self.finished:
            self.g.release(rid)
            if self.submitted < len(prompts):
                self.submit()
            else:
                self.steady = False
        self.finished = []
        return self.g.has_work()


ratios = {n: [] for n in names}
for r in range(rounds):
    gc.collect()
    for n in names:
        make(n).generate([p[2] for p in prompts[:C]], [SamplingParams(max_new_tokens=8)] * C)
    gc.collect()
    rot = names[r % len(names):] + names[:r % len(names)]
    loops = sorted([Loop(n) for n in rot], key=lambda lp: names.index(lp.name))
    live, k = list(loops), 0
    while live:
        order = live[k % len(live):] + live[:k % len(live)]
        k += 1
        live = [lp for lp in order if lp.step()]
    tps = {lp.name: lp.tokens / lp.wall for lp in loops}
    for lp in loops:
        ratios[lp.name].append(tps[lp.name] / tps[names[0]])
        print(f"   {lp.name:20s} " + " ".join(f"{k}: {lp.kn[k]} steps {lp.kind[k] * 1e3 / lp.kn[k]:.2f} ms"
                                          for k in sorted(lp.kind)))
    print(f"round {r}: " + "  ".join(f"{lp.name} {tps[lp.name]:.1f} ({tps[lp.name] / tps[names[0]]:.3f}, "
                                     f"{lp.steps} steps)" for lp in loops), flush=True)
for n in names:
    x = np.array(ratios[n])
    print(f"{n:20s} x{names[0]}: mean {x.mean():.3f} median {np.median(x):.3f} min {x.min():.3f} max {x.max():.3f}")
