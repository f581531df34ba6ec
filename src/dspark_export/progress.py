"""Progress text with an ETA for long loops whose steps cost about the same (profiling buckets, benchmark
runs, training steps). The ETA is the mean time per finished step times the steps left."""

from __future__ import annotations

import time

__all__ = ["Eta", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


class Eta:
    """Counts finished steps of `total` since construction (or `start` already done, e.g. on resume).

    `text(done)` gives "done/total, ETA 1m20s" ("ETA ?" before the first finished step)."""

    def __init__(self, total: int, start: int = 0, clock=time.perf_counter):
        self.total, self.start, self.clock, self.t0 = int(total), int(start), clock, clock()

    def remaining_s(self, done: int) -> float | None:
        finished = done - self.start
        if finished <= 0:
            return None
        return (self.clock() - self.t0) / finished * max(0, self.total - done)

    def text(self, done: int) -> str:
        left = self.remaining_s(done)
        return f"{done}/{self.total}, ETA {'?' if left is None else format_seconds(left)}"
