"""Single user (`ab_common.py`): dspark-async with one-step probes (`_PROBE_STEPS` 1 instead of 2), with the
first probe interval at 8 skipped steps instead of 4, both, and dspark-async as on main.

    python reports/runtime_split/s36/ab_probe_len.py ENGINE_DIR [ROUNDS]

Ran at cc0cd3b and 74271b2, where probes took 2 steps from gaps of 4. Main now runs "both", so on later code
the variants no longer mean what their names say.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "s35"))
from ab_common import run  # noqa: E402  (s35's shared single-user A/B)


def one_step(gen):
    c, orig = gen.controller, gen.controller.draft_count

    def draft_count(*a):
        before = c.probe_left
        n = orig(*a)
        if before == 0 and c.probe_left == 1:   # a probe began: end it after this step
            c.probe_left = 0
        return n
    c.draft_count = draft_count


def interval_8(gen):
    c, orig = gen.controller, gen.controller.draft_count

    def draft_count(*a):
        c.probe_interval = max(c.probe_interval, 8)
        return orig(*a)
    c.draft_count = draft_count


def both(gen):
    interval_8(gen)
    one_step(gen)


run({"async 1-step": one_step, "async int8": interval_8, "async both": both, "async": None})
