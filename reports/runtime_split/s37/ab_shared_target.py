"""Single-user A/B of drafter builds that share one target session: every engine directory after the first
runs its drafter and verify graphs but the FIRST directory's target runners (the same ORT session and weight
memory), so the systems differ in their drafter only. Why: two engine directories in one process run the same
target at different speeds (`ab-instance.txt`: ar on an identical copy of the default build 3.3–3.9 % slower
in every round), which biased every multi-directory A/B toward the first directory.

The directories must hold the same target graph (checked by file hash). Prompts, rounds and output as
s35's `ab_common.py`: ar on the first directory, then dspark-async on each; ×ar per round, identical tokens.

    python reports/runtime_split/s37/ab_shared_target.py DIR_A,DIR_B[,...] [ROUNDS]
"""
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "s35"))
from ab_common import peer_prompt_ids  # noqa: E402

from dspark_export.runtime.api import Runtime  # noqa: E402
from dspark_export.runtime.generator import Generator  # noqa: E402
from dspark_export.runtime.policies import parse_policy  # noqa: E402
from dspark_export.runtime.request import SamplingParams  # noqa: E402


def digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.parent.glob(path.name + "*")):
        h.update(f.read_bytes())
    return h.hexdigest()


dirs, rounds = sys.argv[1].split(","), int(sys.argv[2]) if len(sys.argv) > 2 else 3
rt, ids = peer_prompt_ids(dirs[0])
first = rt.engines
target = digest(Path(dirs[0]) / "graphs" / "target.onnx")
engines = {dirs[0]: first}
for d in dirs[1:]:
    if digest(Path(d) / "graphs" / "target.onnx") != target:
        sys.exit(f"{d}: its target graph differs from {dirs[0]}'s")
    e = Runtime.open(d, policy="ar", threads=2).engines
    for key in [k for k in e._runners if k[0] == "target"]:
        e._runners[key] = first._runners[key]       # the first directory's target sessions
    engines[d] = e
gens = {"ar": Generator(first, parse_policy("ar"))} | {d: Generator(e, parse_policy("dspark-async")) for d, e in engines.items()}
names = list(gens)
for g in gens.values():
    g.generate([ids[0]], [SamplingParams(max_new_tokens=8)])
wall = {n: np.zeros((rounds, len(ids))) for n in names}
toks = {n: {} for n in names}
for k in range(rounds):
    for i, x in enumerate(ids):
        for n in (names if k % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            [r] = gens[n].generate([x], [SamplingParams(max_new_tokens=128)])
            wall[n][k, i] = time.perf_counter() - t0
            toks[n][i] = r.token_ids
ar = wall["ar"].sum(axis=1)
total = sum(len(t) for t in toks["ar"].values())
for n in names:
    per = [round(float(a / w), 3) for a, w in zip(ar, wall[n].sum(axis=1))]
    same = all(toks[n][i] == toks["ar"][i] for i in toks["ar"])
    print(f"{n:24s} {total / np.median(wall[n], axis=0).sum():7.2f} tok/s ×ar per round {per} identical {same}")
