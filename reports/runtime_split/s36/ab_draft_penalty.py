"""Single user (s35's `ab_common.py`): dspark-async with the profile's drafter block latencies d(R) raised by 0.5
and by 1.0 ms (the slowdown a drafter block causes the target pass after it, `interference.py`), and as on
main.

    python reports/runtime_split/s36/ab_draft_penalty.py ENGINE_DIR [ROUNDS] [MS,MS,...]   (default 0.5,1.0)
"""
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "s35"))
from ab_common import run  # noqa: E402  (s35's shared single-user A/B)


def penalty(ms):
    def setup(gen):
        profile = dataclasses.replace(gen.profile, draft_ms=tuple(d + ms for d in gen.profile.draft_ms))
        gen.profile, gen._bound_profile, gen.controller.profile = profile, None, profile
    return setup


MS = [float(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "0.5,1.0").split(",")]
run({f"async +{ms}ms": penalty(ms) for ms in MS} | {"async": None})
