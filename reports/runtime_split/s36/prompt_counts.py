"""Per prompt (dspark-async, single user): steps, drafted steps, verified drafts, accepted, skipped; wall vs ar."""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "s35"))
from ab_common import peer_prompt_ids  # noqa: E402  (s35's peer prompts on the shared ORT pool)
from dspark_export.runtime import generator as G  # noqa: E402
from dspark_export.runtime.generator import Generator  # noqa: E402
from dspark_export.runtime.policies import parse_policy  # noqa: E402
from dspark_export.runtime.request import SamplingParams  # noqa: E402

sel = [int(x) for x in sys.argv[2].split(",")]
rt, ids = peer_prompt_ids(sys.argv[1])
C = {}    # per Generator: the step counts of its last request
orig = G.Generator._apply
def _apply(self, rnd):
    st = C.setdefault(id(self), dict(steps=0, drafted=0, rows=0, verified=0, accepted=0))
    st["steps"] += 1
    if rnd.drafted:
        st["drafted"] += 1; st["rows"] += len(rnd.drafted)
        st["verified"] += int(rnd.verify_lens.sum()); st["accepted"] += int(rnd.num_accepted.sum())
    return orig(self, rnd)
G.Generator._apply = _apply
gens = {p: Generator(rt.engines, parse_policy(p)) for p in ("ar", "dspark-async")}
for g in gens.values(): g.generate([ids[0]], [SamplingParams(max_new_tokens=8)])
for i in sel:
    w = {}
    for rep in range(3):
        for p, g in gens.items():
            C.pop(id(g), None); t = time.perf_counter()
            g.generate([ids[i]], [SamplingParams(max_new_tokens=128)]); w.setdefault(p, []).append(time.perf_counter() - t)
    st = C[id(gens["dspark-async"])]
    print(i, f"ar/dsp {np.median(w['ar'])/np.median(w['dspark-async']):.2f}", st)
