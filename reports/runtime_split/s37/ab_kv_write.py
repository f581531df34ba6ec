"""In one process, per prompt: ar and dspark-async, each with the old (066d1cd) and new KVCache.write +
faults.check_target, interleaved; tok/s per variant per round. Runs at bb9c5a3 (check_target's signature changed
after it).

    python reports/runtime_split/s37/ab_kv_write.py ENGINE_DIR ROUNDS
"""
import sys, time, json, numpy as np
from dspark_export.engines.ort.runner import use_shared_thread_pool; use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.runtime import kv_cache as KV, faults as F, stages as ST
from dspark_export.bench.peers import PeersBenchConfig

def old_write(self, slots, new_keys, new_values, rows=None):
    slots = np.asarray(slots, np.int64)
    if slots.size == 0:
        return np.zeros(self.num_slots, np.int64)
    counts = np.bincount(slots, minlength=self.num_slots)
    if counts[slots[0]] == slots.size:
        first = int(self.lens[slots[0]]); end = first + slots.size
        where, axes = (int(slots[0]), slice(None), slice(first, end)), (1, 0, 2)
    else:
        order = np.argsort(slots, kind="stable"); rank = np.empty_like(slots)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        rank[order] = np.arange(slots.size) - np.repeat(starts, counts)
        positions = self.lens[slots] + rank; end = int(positions.max()) + 1
        where, axes = (slots, slice(None), positions), (0, 1, 2)
    self.reserve(end)
    for layer in range(self.num_layers):
        k, v = new_keys[layer], new_values[layer]
        if rows is not None:
            k, v = k[rows], v[rows]
        self.keys[layer][where] = k.transpose(axes)
        self.values[layer][where] = v.transpose(axes)
    return counts

def old_check_target(packed, out, segments, num_layers, engine):
    n = out["aux_hidden"].shape[0]
    rows = [out["aux_hidden"]] + [out[f"new_{kind}.{layer}"].reshape(n, -1) for layer in range(num_layers) for kind in ("key", "value")]
    row_ok = np.isfinite(np.concatenate(rows, axis=1).sum(axis=1))
    logit_ok = np.isfinite(out["logits"].sum(axis=1))
    failed = {}
    for seg in segments:
        a, q = packed.row_start[seg.slot], len(seg.token_ids)
        m = q if seg.logits == "all" else int(seg.logits == "last")
        la = packed.logit_start.get(seg.slot, 0)
        if not (row_ok[a:a + q].all() and logit_ok[la:la + m].all()):
            failed[seg.slot] = "non-finite"
    return failed

NEW = (KV.KVCache.write, F.check_target)
def use(new):
    KV.KVCache.write, F.check_target = NEW if new else (old_write, old_check_target)

eng, rounds = sys.argv[1], int(sys.argv[2])
rt = Runtime.open(eng, policy="ar", threads=2)
prompts = PeersBenchConfig(eng, datasets=("gsm8k", "humaneval", "mt-bench"), datasets_dir="/work/shared/eval_datasets", prompts_per_dataset=7).prompts
ids = [rt.encode(q, True) for q in prompts]
variants = [(p, new) for p in ("ar", "dspark-async") for new in (False, True)]
gens = {v: Generator(rt.engines, parse_policy(v[0])) for v in variants}
for v, g in gens.items(): use(v[1]); g.generate([ids[0]], [SamplingParams(max_new_tokens=32)])
ref = None
for rnd in range(rounds):
    wall = {v: 0.0 for v in variants}; toks = {v: 0 for v in variants}; outs = {v: [] for v in variants}
    for i, x in enumerate(ids):
        order = variants if (i + rnd) % 2 == 0 else variants[::-1]
        for v in order:
            use(v[1]); t = time.perf_counter()
            r = gens[v].generate([x], [SamplingParams(max_new_tokens=128)])[0]
            wall[v] += time.perf_counter() - t; toks[v] += len(r.token_ids); outs[v].append(r.token_ids)
    same = all(outs[v] == outs[variants[0]] for v in variants)
    tps = {v: toks[v] / wall[v] for v in variants}
    print(f"round {rnd}: " + "  ".join(f"{p}{'-new' if n else '-old'} {tps[(p, n)]:.1f}" for p, n in variants),
          f"| new/old ar {tps[('ar', True)] / tps[('ar', False)]:.3f} async {tps[('dspark-async', True)] / tps[('dspark-async', False)]:.3f}",
          f"| async/ar old {tps[('dspark-async', False)] / tps[('ar', False)]:.3f} new {tps[('dspark-async', True)] / tps[('ar', True)]:.3f} identical {same}", flush=True)
