"""Single user (`ab_common.py`): dspark-async whose lagged capacity also reads the outcome ratio (the first
lagged confidence scaled by it, so every lagged survival; tried and dropped), and dspark-async as on main.

    python reports/runtime_split/s35/ab_lagged.py ENGINE_DIR [ROUNDS]
"""
import numpy as np

from ab_common import run
from dspark_export.runtime.draft_control import DraftController


def scale_lagged(gen):
    c = gen.controller

    def lagged():
        lag, ratio = DraftController.lagged(c), c.outcome_ratio()
        if lag is None or ratio == 1.0:
            return lag
        scaled = np.array(lag, np.float32)
        scaled[:, 0] = np.minimum(scaled[:, 0] * ratio, 1.0)
        return scaled
    c.lagged = lagged


run({"async+lagged": scale_lagged, "async": None})
