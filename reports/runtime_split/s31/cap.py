"""Capture one feed per engine from a short dspark run (the middle call of each) into feeds.pkl, for blk2.py / blk4.py.

    python cap.py ENGINE_DIR
"""
import sys, time, pickle
from pathlib import Path
import numpy as np
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime import stages as ST
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.bench.peers import PeersBenchConfig
eng = sys.argv[1]
CAP = {}
orig = ST.EngineStages.infer
def inf(self, runner, feed):
    k = Path(str(runner.key.path)).name
    CAP.setdefault(k, []).append({a: np.array(b) for a, b in feed.items()})
    return orig(self, runner, feed)
ST.EngineStages.infer = inf
rt = Runtime.open(Path(eng), policy="ar", threads=2)
prompts = PeersBenchConfig(eng, datasets=('gsm8k',), datasets_dir='/work/shared/eval_datasets', prompts_per_dataset=1).prompts
gen = Generator(rt.engines, parse_policy("dspark"))
gen.generate([rt.encode(prompts[0], True)], [SamplingParams(max_new_tokens=64)])
keep = {k: v[len(v)//2] for k, v in CAP.items()}
print({k: len(v) for k, v in CAP.items()})
pickle.dump(keep, open("feeds.pkl", "wb"))
