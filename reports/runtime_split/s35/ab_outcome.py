"""Single user (`ab_common.py`): dspark-async with the skip rule's outcome ratio, and with it held at 1.

    python reports/runtime_split/s35/ab_outcome.py ENGINE_DIR [ROUNDS]
"""
from ab_common import run


def hold(gen):
    gen.controller.outcome_ratio = lambda: 1.0


run({"async+outcome": None, "async": hold})
