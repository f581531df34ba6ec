"""Hot-loop target pass times t(1) and t(4) on feeds captured early (~60 tokens of context) and late (~180)
in generating for one mt-bench prompt, shared pool, 2 threads.

    python context_wall.py ENGINE_DIR"""
import sys, time
from pathlib import Path
import numpy as np
from dspark_export.engines.ort.runner import use_shared_thread_pool
use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.runtime import stages as ST
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench.peers import PeersBenchConfig
eng = sys.argv[1]
caps = {}; calls = {'n': 0}
orig = ST.EngineStages.infer
def inf(self, runner, feed):
    if runner.key.graph == 'target' and feed['input_ids'].shape[0] in (1, 4):
        calls['n'] += 1
        b = feed['input_ids'].shape[0]
        ctx = int(feed['past_lens'][0]) if 'past_lens' in feed else None
        caps.setdefault(b, {})
        key = 'late'
        if calls['n'] > 5 and 'early' not in caps[b]: caps[b]['early'] = ({k: np.array(v) for k, v in feed.items()}, runner)
        caps[b]['late'] = ({k: np.array(v) for k, v in feed.items()}, runner)
    return orig(self, runner, feed)
ST.EngineStages.infer = inf
prompts = PeersBenchConfig(eng, datasets=('mt-bench',), datasets_dir='/work/shared/eval_datasets', prompts_per_dataset=1).prompts
for pol in ('ar', 'fixed:3'):
    rt = Runtime.open(Path(eng), policy=pol, threads=2)
    ids = rt.encode(prompts[0], True); print(pol, 'prompt tokens', len(ids))
    rt.generate_ids([ids], [SamplingParams(max_new_tokens=128)])
print({b: list(v) for b, v in caps.items()}, list(caps[1]['late'][0].keys())[:8])
for rep in range(3):
    line = []
    for b in (1, 4):
        for when in ('early', 'late'):
            if when not in caps.get(b, {}): continue
            f, r = caps[b][when]
            for _ in range(5): r.infer(f)
            ts = []
            for _ in range(30):
                t = time.perf_counter(); r.infer(f); ts.append(time.perf_counter() - t)
            line.append(f't({b}) {when}: {np.median(ts)*1e3:.2f}')
    print(' | '.join(line), flush=True)
