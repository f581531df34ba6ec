"""dspark-async skip margins against ar in the serve bench's closed loop (32 serving prompts x 64 tokens, 3
rotated repeats, one process, shared pool): throughput per run and the per-repeat ratio to ar.

    python serve_margin.py ENGINE_DIR C MARGIN[,MARGIN...]"""
import sys, time
from pathlib import Path
import numpy as np
from dspark_export.engines.ort.runner import use_shared_thread_pool
use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import draft_control as DC
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench import serve as SB
eng = sys.argv[1]; C = int(sys.argv[2]); margins = [float(x) for x in sys.argv[3].split(',')]
rt = Runtime.open(Path(eng), policy="ar", threads=2)
cfg = SB.ServeBenchConfig(engine_dir=eng, datasets_dir='/work/shared/eval_datasets', concurrency=(C,), requests=32, max_new_tokens=64)
prompts = SB._Prompts(cfg, lambda t: rt.encode(t, True), 4096).first(32)
params = SamplingParams(max_new_tokens=64)
variants = [('ar', None)] + [('dspark-async', m) for m in margins]
res = {v: [] for v in variants}
for rep in range(3):
    order = variants[rep % len(variants):] + variants[:rep % len(variants)]
    for pol, m in order:
        if m is not None: DC._SKIP_MARGIN = m
        Generator(rt.engines, parse_policy(pol)).generate([p[2] for p in prompts[:C]], [SamplingParams(max_new_tokens=8)] * C)
        gen = Generator(rt.engines, SB._timed(parse_policy(pol)))
        run = SB._closed_loop(gen, prompts, C, params)
        res[(pol, m)].append(run.window_tokens / run.window_s)
    print('rep', rep, {f'{p}:{m}': round(v[-1], 1) for (p, m), v in res.items()}, flush=True)
ar = np.array(res[('ar', None)])
for (p, m), v in res.items():
    print(p, m, 'tok/s', [round(x, 1) for x in v], 'x ar per rep', [round(x, 3) for x in np.array(v) / ar])
