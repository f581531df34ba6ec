"""Single user (`ab_common.py`): dspark-async (its controller restarts when a request arrives in an empty batch),
and dspark-async whose controller never restarts.

    python reports/runtime_split/s35/ab_restart.py ENGINE_DIR [ROUNDS]
"""
from ab_common import run


def no_restart(gen):
    gen.controller.restart = lambda: None


run({"async": None, "async no restart": no_restart})
