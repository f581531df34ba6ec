"""Single user (`ab_common.py`): dspark-async with the probe floor at 2 % of the skipped steps' time
(`_PROBE_OVERHEAD` 0.02 instead of 0.05), and dspark-async as on main.

    python reports/runtime_split/s35/ab_probe.py ENGINE_DIR [ROUNDS]
"""
import numpy as np

from ab_common import run
from dspark_export.runtime import draft_control as dc


def floor_2pct(gen):
    c = gen.controller

    def probe_floor(R, S):   # `SkipController.probe_floor` at 0.02
        width = c.probe_width(R)
        rows = S if width == R else width
        d, sps = max(c.profile.draft_seconds(rows), c.draft_wall.get(rows, 0.0)), c.profile.sps(R)
        return int(np.ceil(min(dc._PROBE_STEPS * d * sps / 0.02, dc._FLOOR_CAP)))
    c.probe_floor = probe_floor


run({"async probe 2%": floor_2pct, "async": None})
