"""What the hot-loop scripts of this folder share: `capture(engine_dir, policy)` runs one short generation and
returns {(graph, bucket): (runner, feed)} with the first feed each engine call got (copied), for timing an
engine call on its own."""
import numpy as np

from dspark_export.engines.ort.runner import use_shared_thread_pool

use_shared_thread_pool(2)
from dspark_export.runtime import stages as ST  # noqa: E402
from dspark_export.runtime.api import Runtime  # noqa: E402
from dspark_export.runtime.request import SamplingParams  # noqa: E402

PROMPT = "Write a python function that reverses a list."


def capture(engine_dir: str, policy: str = "fixed:1", max_new_tokens: int = 24) -> dict:
    rt = Runtime.open(engine_dir, policy=policy, threads=2)
    cap = {}
    orig = ST.EngineStages.infer

    def infer(self, runner, feed):
        cap.setdefault((runner.key.graph, runner.key.bucket), (runner, {n: np.array(v) for n, v in feed.items()}))
        return orig(self, runner, feed)
    ST.EngineStages.infer = infer
    try:
        rt.generator.generate([rt.encode(PROMPT, True)], [SamplingParams(max_new_tokens=max_new_tokens)])
    finally:
        ST.EngineStages.infer = orig
    return cap
