"""Single user (s35's `ab_common.py`): dspark-async whose skip rule prices the drafter at what this generator's
drafted steps measured (the context flush plus the drafter block, running mean), against main (the profiled
block alone) and main with 1.0 ms added to every profiled d(R) (session 36's lead).

    python reports/runtime_split/s37/ab_observed_draft.py ENGINE_DIR [ROUNDS]
"""
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "s35"))
from ab_common import run  # noqa: E402  (s35's shared single-user A/B)


def observed(gen):
    stages, ctl = gen.stages, gen.controller
    flush, propose = stages.flush_context, stages.propose
    last = {"s": 0.0}

    def timed_flush(rnd, states):
        t0 = time.perf_counter()
        try:
            return flush(rnd, states)
        finally:
            last["s"] = time.perf_counter() - t0

    def timed_propose(rnd, decoding, every=True):
        drafts, seconds = propose(rnd, decoding, every)
        return drafts, seconds + last["s"]          # the flush this draft needed, plus the block
    stages.flush_context, stages.propose = timed_flush, timed_propose
    cache = {}

    def pricing(step_profile):
        if step_profile is None or not ctl.draft_wall:
            return step_profile
        key = (id(step_profile), tuple(sorted(ctl.draft_wall.items())))
        if key not in cache:
            cache.clear()
            ms = tuple(max(d, 1e3 * ctl.draft_wall.get(r, 0.0))
                       for r, d in zip(step_profile.draft_requests, step_profile.draft_ms))
            cache[key] = dataclasses.replace(step_profile, draft_ms=ms)
        return cache[key]
    pays = ctl.pays
    ctl.pricing = pricing
    ctl.pays = lambda R, S, step_profile: pays(R, S, pricing(step_profile))


def penalty(ms):
    def setup(gen):
        profile = dataclasses.replace(gen.profile, draft_ms=tuple(d + ms for d in gen.profile.draft_ms))
        gen.profile, gen._bound_profile, gen.controller.profile = profile, None, profile
    return setup


run({"async observed": observed, "async +1.0ms": penalty(1.0), "async": None})
