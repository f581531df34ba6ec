"""Single user: mean target N1 session time per call under ar and dspark-async (interleaved prompts, 3 rounds)."""
import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "s35"))
from ab_common import peer_prompt_ids  # noqa: E402  (s35's peer prompts on the shared ORT pool)
from dspark_export.runtime import stages as ST  # noqa: E402
from dspark_export.runtime.generator import Generator  # noqa: E402
from dspark_export.runtime.policies import parse_policy  # noqa: E402
from dspark_export.runtime.request import SamplingParams  # noqa: E402

rt, ids = peer_prompt_ids(sys.argv[1], [int(x) for x in sys.argv[2].split(",")])
cur = ["ar"]; T = collections.defaultdict(list); prev = [None]
orig = ST.EngineStages.infer
def infer(self, runner, feed):
    t = time.perf_counter()
    try: return orig(self, runner, feed)
    finally:
        dt = time.perf_counter() - t
        if runner.key.graph == "target" and feed["input_ids"].shape[-1] == 1:
            T[(cur[0], prev[0])].append(dt)
        prev[0] = runner.key.graph
ST.EngineStages.infer = infer
gens = {p: Generator(rt.engines, parse_policy(p)) for p in ("ar", "dspark-async")}
for g in gens.values(): g.generate([ids[0]], [SamplingParams(max_new_tokens=8)])
T.clear()
for rep in range(3):
    for p in (("ar", "dspark-async") if rep % 2 == 0 else ("dspark-async", "ar")):
        cur[0] = p
        for x in ids:
            prev[0] = None
            gens[p].generate([x], [SamplingParams(max_new_tokens=128)])
for k, v in sorted(T.items(), key=str):
    v = np.array(v) * 1e3
    print(k, f"n {len(v)} mean {v.mean():.3f} median {np.median(v):.3f} p10 {np.percentile(v,10):.3f} p90 {np.percentile(v,90):.3f}")
