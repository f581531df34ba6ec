"""Every KV layout change in three `bench serve` closed loops (ar, C from argv, 32 requests × 64 tokens):
(layers, slots, capacity, in place or a new arena, ms), and their total per run.
Usage: python relayouts.py ENGINE_DIR C"""
import sys
import time

from dspark_export.bench import serve as S
from dspark_export.runtime import kv_cache as K

log = []
orig = K.KVCache._relayout


def timed(self, num_slots, capacity, moves):
    arena, t = self._holder[0], time.perf_counter()
    orig(self, num_slots, capacity, moves)
    log.append((self.num_layers, num_slots, capacity, "in" if self._holder[0] is arena else "new",
                round((time.perf_counter() - t) * 1e3, 1)))


K.KVCache._relayout = timed
loop = S._closed_loop


def logged(*a):
    log.clear()
    t = time.perf_counter()
    run = loop(*a)
    print(f"run {time.perf_counter() - t:.2f} s; target relayouts {[x for x in log if x[0] > 2]}; "
          f"total {sum(x[4] for x in log):.0f} ms")
    return run


S._closed_loop = logged
cfg = S.ServeBenchConfig(sys.argv[1], concurrency=(int(sys.argv[2]),), policies=("ar",), repeats=3, requests=32,
                         max_new_tokens=64, threads=2, datasets_dir="/work/shared/eval_datasets", identity_checks=0)
S.run_serve_bench(cfg, progress=lambda s: None)
