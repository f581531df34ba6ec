"""The profiler's timing loop (engines/profiler.py `time_runner`): how many runs a time budget allows."""

from __future__ import annotations

import time

from dspark_export.engines.profiler import time_runner


class _Runner:
    """A runner whose pass takes `ms` milliseconds (a sleep, never shorter); counts its calls."""

    def __init__(self, ms: float):
        self.ms, self.calls = ms, 0

    def infer(self, feed):
        self.calls += 1
        time.sleep(self.ms / 1e3)


def test_without_a_budget_every_repeat_is_timed():
    r = _Runner(0.0)
    assert time_runner(r, {}, warmup=3, repeats=10)["repeats"] == 10 and r.calls == 13


def test_a_slow_pass_gets_one_warmup_and_three_timed_runs():
    r = _Runner(40.0)
    stats = time_runner(r, {}, warmup=3, repeats=10, budget_ms=100.0)
    assert stats["repeats"] == 3 and r.calls == 4 and stats["median_ms"] >= 40.0


def test_a_fast_pass_under_the_budget_gets_every_repeat():
    r = _Runner(0.0)
    assert time_runner(r, {}, warmup=3, repeats=10, budget_ms=60_000.0)["repeats"] == 10 and r.calls == 13


def test_fewer_repeats_than_the_minimum_are_kept():
    r = _Runner(40.0)
    assert time_runner(r, {}, warmup=0, repeats=2, budget_ms=1.0)["repeats"] == 2 and r.calls == 2
