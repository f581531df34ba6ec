"""Single user, chosen peer prompts (argv 2, indices), policies (argv 3): ar wall over each policy's wall per round
(2 rounds, policies interleaved per prompt) and accepted / verified drafts in the first round.

    python reports/runtime_split/s36/fixed_policies.py ENGINE_DIR 7,8,9 ar,fixed:1,dspark-async
"""
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "s35"))
from ab_common import peer_prompt_ids  # noqa: E402  (s35's peer prompts on the shared ORT pool)
from dspark_export.runtime.generator import Generator  # noqa: E402
from dspark_export.runtime.policies import parse_policy  # noqa: E402
from dspark_export.runtime.request import SamplingParams  # noqa: E402

sel, pols = [int(x) for x in sys.argv[2].split(",")], sys.argv[3].split(",")
rt, ids = peer_prompt_ids(sys.argv[1], sel)
gens = {p: Generator(rt.engines, parse_policy(p)) for p in pols}
for g in gens.values(): g.generate([ids[0]], [SamplingParams(max_new_tokens=8)])
W = {p: np.zeros((2, len(ids))) for p in pols}; acc = {p: [0, 0] for p in pols}
for rep in range(2):
    for i, x in enumerate(ids):
        for p in (pols if rep % 2 == 0 else pols[::-1]):
            t = time.perf_counter(); [r] = gens[p].generate([x], [SamplingParams(max_new_tokens=128)]); W[p][rep, i] = time.perf_counter() - t
            if rep == 0: acc[p][0] += r.stats.accepted_tokens; acc[p][1] += r.stats.draft_tokens
for p in pols:
    print(p, "ar/p per round", [round(float(a), 3) for a in W["ar"].sum(1) / W[p].sum(1)], "accepted/verified", acc[p])
