"""The profiler's timing loops (engines/profiler.py `time_runner`, `time_interleaved`): how many runs a time
budget allows, the round-robin order, and the KV buffers the interleaved feeds share."""

from __future__ import annotations

import time

import numpy as np

from dspark_export.engines.profiler import _kv_feed, time_interleaved, time_runner


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


class _Logged(_Runner):
    """A `_Runner` that also appends its name to a shared call log."""

    def __init__(self, name: str, ms: float, log: list):
        super().__init__(ms)
        self.name, self.log = name, log

    def infer(self, feed):
        self.log.append(self.name)
        super().infer(feed)


def test_interleaved_timing_runs_the_engines_round_robin():
    log: list[str] = []
    items = {k: (_Logged(k, 0.0, log), {}) for k in ("target", "drafter")}
    stats = time_interleaved(items, warmup=2, repeats=3)
    assert log == ["target", "drafter"] * 5
    assert {k: v["repeats"] for k, v in stats.items()} == {"target": 3, "drafter": 3}


def test_interleaved_timing_keeps_each_engines_budget():
    log: list[str] = []
    items = {"slow": (_Logged("slow", 40.0, log), {}), "fast": (_Logged("fast", 0.0, log), {})}
    stats = time_interleaved(items, warmup=3, repeats=6, budget_ms=100.0)
    # the slow pass: one warm-up (40 ms is over a quarter of the budget), then the minimum of three timed runs
    assert stats["slow"]["repeats"] == 3 and items["slow"][0].calls == 1 + 3
    assert stats["fast"]["repeats"] == 6 and items["fast"][0].calls == 3 + 6
    timed = log[log.index("slow", 1):]  # after the warm-ups: alternating while both want runs
    assert timed[:6] == ["slow", "fast"] * 3 and stats["slow"]["median_ms"] >= 40.0


def test_one_engine_interleaved_is_time_runner():
    a, b = _Runner(0.0), _Runner(0.0)
    assert time_interleaved({0: (a, {})}, warmup=2, repeats=5)[0]["repeats"] == \
        time_runner(b, {}, warmup=2, repeats=5)["repeats"] == 5 and a.calls == b.calls == 7


def test_kv_feeds_share_the_largest_buffer():
    spec = {"num_layers": 2, "num_kv_heads": 3, "head_dim": 4}
    pool: dict = {}
    big = _kv_feed(spec, 5, 16, "past_key", "past_value", pool)
    small = _kv_feed(spec, 2, 16, "past_key", "past_value", pool)
    other = _kv_feed(spec, 2, 32, "past_key", "past_value", pool)
    assert small["past_key.1"].shape == (2, 3, 16, 4) and small["past_key.1"].flags["C_CONTIGUOUS"]
    assert np.shares_memory(small["past_value.0"], big["past_value.0"])
    assert not np.shares_memory(small["past_key.0"], small["past_key.1"])      # one buffer per layer and K/V
    assert not np.shares_memory(other["past_key.0"], big["past_key.0"])        # per capacity
    assert len(pool) == 8 and small["past_key.0"][0, 0, 0, 0] == np.float32(0.01)
