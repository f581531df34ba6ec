"""bench serve closed loop: every target pass of 16 rows or fewer by (rows, padded query width Q, KV capacity P), median ms.

    python split3.py ENGINE_DIR C REQUESTS ar,dspark
"""
import sys, time, collections
from pathlib import Path
import numpy as np
from dspark_export.bench import serve as S
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import stages as ST
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
eng, C, reqs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]); POLS = sys.argv[4].split(",")
REC = []
orig_infer = ST.EngineStages.infer
def inf(self, runner, feed):
    t = time.perf_counter(); r = orig_infer(self, runner, feed); dt = time.perf_counter() - t
    if runner.key.graph == 'target':
        REC.append((runner.key.bucket, feed['input_ids'].shape[0], feed['pad_index'].shape, feed['past_key.0'].shape, dt))
    return r
ST.EngineStages.infer = inf
cfg = S.ServeBenchConfig(engine_dir=Path(eng), concurrency=(C,), policies=("ar",), requests=reqs, max_new_tokens=64, threads=2, datasets_dir=Path("/work/shared/eval_datasets"))
rt = Runtime.open(cfg.engine_dir, policy="ar", threads=2)
prompts = S._Prompts(cfg, lambda t: rt.encode(t, True), 4096).first(reqs)
params = SamplingParams(max_new_tokens=64, temperature=0.0, seed=0)
for name in POLS:
    REC.clear()
    gen = Generator(rt.engines, S._timed(parse_policy(name)))
    run = S._closed_loop(gen, prompts, C, params)
    g = collections.defaultdict(list)
    for bucket, n, pad, pk, dt in REC:
        if n <= 16: g[(n, pad[1], pk[2])].append(dt)
    print(name, 'thr', round(run.window_tokens / run.window_s, 1))
    for k in sorted(g): print('   rows %d Q %d P %d: n=%d median %.2f ms' % (k[0], k[1], k[2], len(g[k]), 1e3*np.median(g[k])))
