"""One C closed loop of dspark-async with the backlog limit at LIMIT rows: peak RSS and the most backlog bytes held.
    python backlog_mem.py ENGINE_DIR C LIMIT [REQUESTS]"""
import sys, resource, time
import numpy as np
from dspark_export.engines.ort.runner import use_shared_thread_pool; use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench import serve as SB
eng, C, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
n = int(sys.argv[4]) if len(sys.argv) > 4 else 64
rt = Runtime.open(eng, policy="ar", threads=2)
cfg = SB.ServeBenchConfig(eng, concurrency=(C,), policies=("ar",), requests=n, max_new_tokens=64, datasets_dir="/work/shared/eval_datasets")
prompts = SB._Prompts(cfg, lambda t: rt.encode(t, True), 2048).first(n)
g = Generator(rt.engines, SB._timed(parse_policy("dspark-async")))
g.backlog_limit = limit
most = [0]
inner = g.step
def step():
    inner()
    seen, total = set(), 0
    for s in g.batch.active():
        for a, _ in s.backlog:
            base = a if a.base is None else a.base
            if id(base) not in seen:
                seen.add(id(base)); total += base.nbytes
    most[0] = max(most[0], total)
g.step = step
t = time.perf_counter()
run = SB._closed_loop(g, prompts, C, SamplingParams(max_new_tokens=64))
print(f"C={C} limit={limit}: {run.window_tokens / run.window_s:.1f} tok/s, most backlog held {most[0] / 2**20:.1f} MiB, "
      f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB, "
      f"target KV arena {g.batch.target_kv.arena_bytes / 2**20:.0f} MiB")
