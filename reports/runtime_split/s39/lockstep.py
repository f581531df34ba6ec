"""Paired closed loops in lockstep at concurrency C: each variant keeps C requests in flight on its own Generator
(bench serve's closed loop: 64 new tokens, the round-robin gsm8k / humaneval / mt-bench chat prompts), and the
variants take turns one step at a time, so the machine's drift hits them alike. Per round the creation order
rotates (the first generators created ran ~1-2 % faster in a null test) and every cache arena is touched to its
largest size first (a relayout into fresh pages cost up to 0.4 s a run: first touch, runtime/kv_cache.py).

    python reports/runtime_split/s39/lockstep.py ENGINE_DIR C ROUNDS VARIANT,VARIANT,... [REQUESTS]

Variants: any policy (ar, dspark, dspark-async, fixed:K), with suffixes (session 39 added -oracle: draft for the
gsm8k requests only; -noskip: dspark-async without its skip rule; -marginM / -hystM: the skip rule at margin M,
or M only while drafting; session 41 added -winS_R: a drafter context window of S + R rows, -full: none, -stair:
staircase pricing, -pw1: probes of one request, -nopre: no
drafter block on steps with a prefill chunk, and with reports/runtime_split/s41/observed-cost.patch applied -slow (a slow-host profile) and
-noobs (no observed-latency scaling); -spread: this variant's requests get 32-96 new tokens; env SPREAD=f: every variant's
get 64·(1±f)): -split (the old `split_passes`: prefill chunks in passes of their
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
from dspark_export.runtime.scheduler import mean_survival_capacity

use_shared_thread_pool(2)
eng, C, rounds, names = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
nreq = int(sys.argv[5]) if len(sys.argv) > 5 else 32
rt = Runtime.open(eng, policy="ar", threads=2)
cfg = SB.ServeBenchConfig(eng, concurrency=(C,), policies=("ar",), requests=nreq, max_new_tokens=64,
                          datasets_dir="/work/shared/eval_datasets")
prompts = SB._Prompts(cfg, lambda t: rt.encode(t, True), 2048).first(nreq)
params = SamplingParams(max_new_tokens=64)
import os
_slens = np.random.default_rng(0).integers(32, 97, size=1000)
SPREAD = float(os.environ.get("SPREAD", "0"))
_lens = np.random.default_rng(0).integers(int(64 * (1 - SPREAD)), int(64 * (1 + SPREAD)) + 1, size=1000) if SPREAD else None


def make(name: str) -> Generator:
    g = Generator(rt.engines, parse_policy(name.split("-never")[0].split("-oracle")[0].split("-nostage")[0].split("-limit")[0].split("-split")[0].split("-eager")[0].split("-x")[0].split("-margin")[0].split("-noskip")[0].split("-hyst")[0].split("-spread")[0].split("-win")[0].split("-full")[0].split("-noobs")[0].split("-slow")[0].split("-stair")[0].split("-pw1")[0].split("-nopre")[0]))
    if "-never" in name:
        g.controller.draft_count = lambda R, S, p: 0
    if "-nostage" in name:
        g.stages.drafts = False
    if "-split" in name:
        g.stages.ragged_target = False
    if "-hyst" in name:
        M = float(name.split("-hyst")[1] or 0); ctl = g.controller; ctl._in = False
        from dspark_export.runtime import draft_control as DC
        def pays(R, S, sp, _c=ctl, _M=M):
            surv = np.minimum(_c.survival_mean * _c.outcome_ratio(), 1.0)
            margin = _M if _c._in else DC._SKIP_MARGIN
            _c._in = mean_survival_capacity(np.broadcast_to(surv, (R, _c.block_size)), R, sp, margin, draft_slots=S) > 0
            return _c._in
        ctl.pays = pays
    if "-noskip" in name:
        from dspark_export.runtime.draft_control import DraftController
        g.controller = DraftController(True, g.controller.profile, g.controller.block_size)
    if "-margin" in name:
        M = float(name.split("-margin")[1]); ctl = g.controller
        def pays(R, S, sp, _c=ctl, _M=M):
            surv = np.minimum(_c.survival_mean * _c.outcome_ratio(), 1.0)
            return mean_survival_capacity(np.broadcast_to(surv, (R, _c.block_size)), R, sp, _M, draft_slots=S) > 0
        ctl.pays = pays
    if "-limit" in name:
        g.backlog_limit = int(name.split("-limit")[1].split("-")[0])
    if "-oracle" in name:
        def dc(R, S, p, g=g):
            return sum(1 for s in g.batch.active() if s.decoding and getattr(s, "math", False))
        g.controller.draft_count = dc
    if "-win" in name:   # -winS_R: a drafter context window of S sink + R recent rows
        from dspark_export.runtime.stages import ContextWindow
        g.stages.context_window = ContextWindow(*map(int, name.split("-win")[1].split("-")[0].split("_")))
    if "-slow" in name:   # the profile as if measured on a host twice as slow for the target, 1.1x for the drafter
        g.profile = g.profile.scaled(2.0, 1.1)
    if "-stair" in name:  # price a B between buckets at its bucket's latency (the staircase), not interpolated
        from dataclasses import replace as _replace
        g.profile = _replace(g.profile, exact_rows=False)
    if "-noobs" in name:  # price with the profile as measured (no ObservedCost scaling)
        g.controller.cost.observe = lambda *a, **k: None
    if "-nopre" in name:   # no drafter block on a step that carries a prefill chunk (its decision is not counted)
        _count = g.controller.draft_count
        def count(R, S, p, _c=_count, _g=g):
            return 0 if any(not s.decoding for s in _g.batch.active()) else _c(R, S, p)
        g.controller.draft_count = count
    if "-pw1" in name:   # probes draft for one request, not two
        g.controller.probe_width = lambda R: min(R, 1)
    if "-full" in name:  # the whole drafter context, whatever the manifest says
        g.stages.context_window = None
    if "-eager" in name:
        release = g.batch.release_finished
        g.batch.release_finished = lambda resize=True: release(True)
    return g


PARTS = {}   # env PARTS=1: (variant, step kind) -> {part: [seconds, calls]}


def instrument(name, g, cur):
    """Time the step's stages (env PARTS=1) into `cur`, which the loop files under the step's kind."""
    def wrap(obj, attr):
        f = getattr(obj, attr)
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                cur[attr] = cur.get(attr, 0.0) + time.perf_counter() - t
        setattr(obj, attr, timed)
    for attr in ("flush_context", "propose", "target_pass", "verify", "commit_rows"):
        wrap(g.stages, attr)
    for attr in ("_schedule", "_apply"):
        wrap(g, attr)


class Loop:
    def __init__(self, name):
        self.name, self.g = name, make(name)
        self.cur = {}
        if os.environ.get("PARTS"):
            instrument(name, self.g, self.cur)
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
        p = params if _lens is None else SamplingParams(max_new_tokens=int(_lens[self.submitted]))
        if "-spread" in self.name:
            p = SamplingParams(max_new_tokens=int(_slens[self.submitted]))
        rid = self.g.submit(prompts[self.submitted][2], p, self.on_token)
        if "-oracle" in self.name:
            st = [s for s in list(self.g.batch.waiting) + self.g.batch.active() if s.index == rid][0]
            st.math = prompts[self.submitted][0] == "gsm8k"
            if not st.math:
                st.drafted_at = 10**9
        self.submitted += 1

    def step(self) -> bool:
        pre_tok = sum(len(s.prompt) - s.prefilled for s in self.g.batch.active() if not s.decoding) + sum(len(s.prompt) for s in self.g.batch.waiting)
        ndec = sum(1 for s in self.g.batch.active() if s.decoding)
        RL[0] = 0.0
        kind = "pre" if self.g.batch.waiting or any(not s.decoding for s in self.g.batch.active()) else "dec"
        t = time.perf_counter()
        self.g.step()
        dt = time.perf_counter() - t
        if self.steady and kind == "pre":
            left = sum(len(s.prompt) - s.prefilled for s in self.g.batch.active() if not s.decoding) + sum(len(s.prompt) for s in self.g.batch.waiting)
            nseg = sum(1 for s in self.g.batch.active() if not s.decoding) + len(self.g.batch.waiting)
            PRE.setdefault(self.name, []).append((pre_tok - left, ndec, dt, RL[0], self.cur.get("target_pass", 0.0), nseg))
        if self.steady and self.cur:
            k2 = kind + ("+draft" if "propose" in self.cur else "")
            d = PARTS.setdefault((self.name, k2), {})
            for part, sec in list(self.cur.items()) + [("step", dt)]:
                d.setdefault(part, [0.0, 0])
                d[part][0] += sec
                d[part][1] += 1
        self.cur.clear()
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
PRE = {}; RL = [0.0]
from dspark_export.runtime import kv_cache as _KV
_orl = _KV.KVCache._relayout
def _rl(self, *a):
    t = time.perf_counter(); _orl(self, *a); RL[0] += time.perf_counter() - t
_KV.KVCache._relayout = _rl
import atexit
def _dump():
    for n, L in PRE.items():
        A = np.array(L); print(n, "prefill steps", len(A), "tokens %.0f" % A[:,0].sum(), "time %.3f" % A[:,2].sum(), "relayout %.3f" % A[:,3].sum(), "decode rows %.0f" % A[:,1].sum(),
              "ms/token (minus relayout, 10 ms/step) %.3f" % ((A[:,2].sum() - A[:,3].sum() - 0.010 * len(A)) / A[:,0].sum() * 1e3))
atexit.register(_dump)


def _fit():
    """target-pass ms of prefill steps ~ a + b·prompt tokens + c·decode rows, per variant (env PARTS=1)."""
    for n, L in PRE.items():
        A = np.array(L)
        if A.shape[1] < 6 or not A[:, 4].any():
            continue
        X = np.column_stack([np.ones(len(A)), A[:, 0], A[:, 1]])
        coef, *_ = np.linalg.lstsq(X, A[:, 4] * 1e3, rcond=None)
        print(f"{n}: target pass of prefill steps = {coef[0]:.2f} ms + {coef[1]:.4f} ms/prompt token + "
              f"{coef[2]:.3f} ms/decode row; tokens/step {A[:, 0].mean():.1f}, decode rows/step {A[:, 1].mean():.2f}")
atexit.register(_fit)


def _dump_parts():
    for (n, kind), d in sorted(PARTS.items()):
        steps = d["step"][1]
        print(f"{n:28s} {kind:9s} {steps:5d} steps: " + " ".join(f"{p} {v[0] * 1e3 / steps:.2f}" for p, v in d.items()))
atexit.register(_dump_parts)
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
