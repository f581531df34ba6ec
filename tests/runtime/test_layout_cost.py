"""The layout cost of a step: padded attention priced by the profile and searched by the policies
(engines/sps.py ThroughputProfile.at / step_seconds, runtime/scheduler.py _best_plan, engines/profiler.py
measure_layout_cost, Generator._step_profile)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from dspark_export.engines.packing import Segment, pack_segments, padded_width
from dspark_export.errors import ProfileError
from dspark_export.exporter.quantize import aligned
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.engines.sps import ThroughputProfile
from dspark_export.runtime.scheduler import (dspark_async_lengths, dspark_lengths,
                                             expected_throughput, mean_survival_capacity, survival_probs)

from ..test_pipeline import BUCKETS, PROMPTS  # noqa: F401  (same tiny engine directory)
from ..test_pipeline import engine_dir, runtime  # noqa: F401  (module fixtures)
from .test_policies import GAMMA, _count_anticipations, _random_confidence

POW2 = (1, 2, 4, 8, 16, 32, 64, 128)


def _layout_profile(c_a=1.2e-3, c_kv=0.8e-3, slots=16, capacity=256, draft=False) -> ThroughputProfile:
    """SmolLM2-like: the profiler's layout (⌈B/8⌉ slots of up to 8 rows, P = 136), latency 20 + 1.4·B ms."""
    layout = tuple((-(-b // 8), min(b, 8), 136) for b in POW2)
    extra = dict(draft_requests=(1, 4, 16), draft_ms=(5.0, 8.0, 30.0)) if draft else {}
    return ThroughputProfile(POW2, tuple(1000.0 / (20.0 + 1.4 * b) for b in POW2), attention_ms=c_a, kv_read_ms=c_kv,
                             profiled_layout=layout, **extra).at(slots, capacity)


def test_step_seconds_formula():
    p = _layout_profile()
    # B = 23 runs bucket 32 (profiled at S=4, Q=8, P=136); the longest request verifies 7 drafts: w = 8.
    base = (20.0 + 1.4 * 32) / 1000
    corr = (1.2e-3 * (16 * 8 * 256 - 4 * 8 * 136) + 0.8e-3 * (16 * 256 - 4 * 136)) / 1000
    assert p.step_seconds([23], [8])[0] == pytest.approx(base + corr, rel=1e-12)
    # 16 rows of 2 in bucket 32: Q = max(2, ⌈32/16⌉) = 2, so the same B costs far less.
    spread = (1.2e-3 * (16 * 2 * 256 - 4 * 8 * 136) + 0.8e-3 * (16 * 256 - 4 * 136)) / 1000
    assert p.step_seconds([32], [2])[0] == pytest.approx(base + spread, rel=1e-12)
    assert p.step_seconds([129], [1])[0] == np.inf                      # beyond the largest bucket
    # unbound, or without widths: 1/SPS(B) exactly
    unbound = ThroughputProfile(p.buckets, p.steps_per_s, attention_ms=1.2e-3, kv_read_ms=0.8e-3,
                                profiled_layout=p.profiled_layout)
    assert not unbound.has_layout_cost and p.has_layout_cost
    np.testing.assert_array_equal(unbound.step_seconds([5, 23], [8, 8]), 1.0 / unbound.sps(np.array([5, 23])))
    np.testing.assert_array_equal(p.step_seconds([5, 23]), 1.0 / p.sps(np.array([5, 23])))
    # a layout cheaper than the profiled one never takes a step below half its profiled latency
    cheap = _layout_profile(c_a=1.0, c_kv=0.0, slots=1, capacity=1)
    assert cheap.step_seconds([32], [1])[0] == pytest.approx(0.5 * base)


def test_padded_width_matches_the_packer():
    rng = np.random.default_rng(3)
    for _ in range(50):
        slots = int(rng.integers(1, 9))
        lengths = rng.integers(0, 5, slots)
        lengths[rng.integers(slots)] += 1
        bucket = int(lengths.sum() + rng.integers(0, 9))
        packed = pack_segments([Segment(s, np.ones(n, np.int64), 10) for s, n in enumerate(lengths) if n], slots,
                               np.full(slots, 10, np.int64), bucket)
        assert packed.feed["pad_index"].shape == (slots, padded_width(int(lengths.max()), bucket, slots))


def test_profile_reads_the_attention_fit():
    data = {"target": [{"B": b, "sps": 1000 / (20 + b), "S": -(-b // 8), "Q": min(b, 8), "P": 136} for b in POW2],
            "attention": {"ms_per_row_entry": 1e-3, "ms_per_slot_entry": 2e-3, "max_error_pct": 3.0, "layouts": []}}
    p = ThroughputProfile.from_json(data)
    assert (p.attention_ms, p.kv_read_ms) == (1e-3, 2e-3) and p.profiled_layout[4] == (2, 8, 136)
    assert not p.has_layout_cost and p.at(4, 512).has_layout_cost
    # older profiles: no fit, no layout cost, whatever the binding
    del data["attention"]
    assert not ThroughputProfile.from_json(data).at(4, 512).has_layout_cost


@pytest.mark.parametrize("change, match", [
    (lambda d: d["attention"].pop("ms_per_slot_entry"), "attention.ms_per_slot_entry: expected a finite number"),
    (lambda d: d["target"][2].pop("Q"), "target row B=4: 'Q' must be an integer ≥ 1"),
    (lambda d: d["attention"].update(ms_per_row_entry=-1.0), "attention.ms_per_row_entry: .* found -1.0"),
    (lambda d: d["attention"].update(ms_per_row_entry=True), "attention.ms_per_row_entry: .* found True"),
    (lambda d: d["attention"].update(ms_per_slot_entry="0.001"), "attention.ms_per_slot_entry: .* found '0.001'"),
    (lambda d: d["target"][0].update(S=0), "target row B=1: 'S' must be an integer ≥ 1"),
    (lambda d: d["target"][1].update(P=1.7), "target row B=2: 'P' must be an integer ≥ 1 .* found 1.7"),
    (lambda d: d.update(attention=[1, 2]), "'attention' must be an object"),
])
def test_profile_rejects_a_bad_attention_fit(change, match):
    data = {"target": [{"B": b, "sps": 1000 / (20 + b), "S": 1, "Q": 1, "P": 136} for b in POW2],
            "attention": {"ms_per_row_entry": 1e-3, "ms_per_slot_entry": 2e-3}}
    change(data)
    with pytest.raises(ProfileError, match=match):
        ThroughputProfile.from_json(data)


def test_async_spreads_instead_of_stacking_one_request():
    # 16 requests: one is confident at every position, the others at position 1 only (0.5).
    conf = np.full((16, GAMMA), 0.05, np.float32)
    conf[:, 0] = 0.5
    conf[0] = 0.97
    flat = ThroughputProfile(_layout_profile().buckets, _layout_profile().steps_per_s)
    stacked = dspark_async_lengths(conf, conf, flat)
    assert stacked[0] == GAMMA                                  # SPS(B) alone: the confident request goes deep
    p = _layout_profile()
    spread = dspark_async_lengths(conf, conf, p)
    assert spread.max() < GAMMA and spread.sum() > 0
    assert expected_throughput(conf, spread, p) > expected_throughput(conf, stacked, p)


@pytest.mark.parametrize("seed", range(6))
def test_async_search_is_the_best_prefix_allocation(seed):
    """With a cost that depends on B and the longest ℓ, the best (cap L, count K) of the search is the best
    of all (γ+1)^R prefix-respecting allocations (brute force)."""
    rng = np.random.default_rng(seed)
    gamma, num = 3, 3
    conf = _random_confidence(rng, num, gamma, low=0.3)
    p = _layout_profile(c_a=rng.uniform(0, 0.05), c_kv=rng.uniform(0, 0.02), slots=num, capacity=int(rng.integers(64, 2048)))
    best = max(expected_throughput(conf, np.array(lens), p) for lens in itertools.product(range(gamma + 1), repeat=num))
    got = expected_throughput(conf, dspark_async_lengths(conf, conf, p), p)
    assert got == pytest.approx(best, rel=1e-12)


def test_algorithm1_keeps_sps_alone():
    """`dspark` ignores the layout cost: priced per prefix, Θ saw-tooths along the greedy path (the first draft
    at a new depth pays every slot's padding) and the early stop fires at the first tooth."""
    buckets = tuple(range(1, 129))
    smooth = ThroughputProfile(buckets, tuple(1000.0 / (20.0 + 0.3 * b) for b in buckets))
    p = ThroughputProfile(smooth.buckets, smooth.steps_per_s, attention_ms=1.1e-3, kv_read_ms=2.26e-3,
                          profiled_layout=tuple((-(-b // 8), min(b, 8), 136) for b in buckets)).at(8, 1024)
    conf = np.full((8, GAMMA), 0.9, np.float32)
    conf[:, 0] = 0.95
    lens = dspark_lengths(conf, p)
    np.testing.assert_array_equal(lens, dspark_lengths(conf, smooth))
    assert lens.tolist() == [GAMMA] * 8
    # what the layout-priced stop would have done: Θ drops at the first draft of the second depth
    from dspark_export.runtime.scheduler import _sorted_candidates, _throughputs
    order, ranked = _sorted_candidates(survival_probs(conf))
    theta = _throughputs(ranked, 8, p, depth=order // 8 + 1)
    assert theta[9] < theta[8] and theta[-1] > 2 * theta[0]


def test_async_without_a_layout_cost_never_caps():
    """A lagged block shorter than the current one caps nothing unless the layout cost chose a cap."""
    worked = ThroughputProfile((2, 4, 8), (100.0, 90.0, 75.0))
    conf = np.full((1, 4), 0.9, np.float32)
    lagged = np.full((2, 2), 0.9, np.float32)
    assert dspark_async_lengths(conf, lagged, worked).tolist() == [4]


def test_skip_decision_prices_the_layout():
    """Drafting pays at S = 4 over a short cache and stops paying over a long one."""
    mean = np.broadcast_to(np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]), (4, GAMMA))
    assert mean_survival_capacity(mean, 4, _layout_profile(slots=4, capacity=136, draft=True), draft_slots=4) > 0
    assert mean_survival_capacity(mean, 4, _layout_profile(c_a=0.02, slots=4, capacity=4096, draft=True),
                                  draft_slots=4) == 0


@pytest.mark.parametrize("policy", ["dspark", "dspark-async"])
def test_layout_priced_admission_never_depends_on_later_confidences(policy):
    pol = parse_policy(policy)
    bound = lambda p: ThroughputProfile(p.buckets, p.steps_per_s, attention_ms=2e-3, kv_read_ms=1e-3,  # noqa: E731
                                        profiled_layout=tuple((1, 1, 64) for _ in p.buckets)).at(8, 512)
    assert _count_anticipations(lambda c, lagged, p: pol.verify_lengths(c, GAMMA, bound(p), lagged)) == 0


# -- the profiler and the runtime ------------------------------------------------------------------

def test_built_profile_has_the_layout_fit(engine_dir):  # noqa: F811
    data = json.loads((engine_dir / "profile" / "sps.json").read_text())
    fit = data["attention"]
    assert fit["ms_per_row_entry"] >= 0 and fit["ms_per_slot_entry"] >= 0 and fit["layouts"]
    for row in fit["layouts"]:
        assert {"S", "Q", "P", "N", "rows", "median_ms", "fit_ms"} <= set(row) and row["rows"] <= row["N"]
    assert all(row["P"] % 128 == 0 for row in fit["layouts"]) and len({row["P"] for row in fit["layouts"]}) >= 2
    ctx, w = data["context_len"], data["block_size"] + 1
    for row in data["target"]:
        assert row["S"] * row["Q"] >= row["B"] and row["P"] == aligned(max(ctx + w, ctx + row["Q"]))
    p = ThroughputProfile.from_json(data)
    assert len(p.profiled_layout) == len(p.buckets)


def test_layout_fit_with_one_capacity_is_refused_not_guessed():
    """Layouts that cannot tell c_a from c_kv apart (one capacity and one query width: S·Q·P ∝ S·P): the fit
    says so and prices nothing."""
    from dspark_export.engines.profiler import fit_layout_cost

    rows = [{"S": s, "Q": 6, "P": 256, "N": 16, "median_ms": 1.0 + s} for s in (1, 2, 3)]
    fit, fitted = fit_layout_cost(rows)
    assert fit["underdetermined"] is True and fit["ms_per_row_entry"] == fit["ms_per_slot_entry"] == 0.0
    assert fitted == [None] * 3


def test_generator_binds_the_profile_to_its_layout(runtime, monkeypatch):  # noqa: F811
    from dspark_export.runtime.draft_control import DraftController
    from dspark_export.runtime.generator import Generator
    gen = Generator(runtime.engines, parse_policy("dspark"))
    seen = []
    original = type(gen.policy).verify_lengths

    def spy(self, confidence, block_size, profile=None, *args):
        seen.append((profile.num_slots, profile.kv_capacity, gen.num_slots, gen.target_kv.capacity))
        return original(self, confidence, block_size, profile, *args)

    monkeypatch.setattr(type(gen.policy), "verify_lengths", spy)
    # a profile timed on a loaded machine can price every draft out (then nothing is scheduled); drafting is
    # what this test needs, so perfect drafts always pay here
    monkeypatch.setattr(DraftController, "can_pay", lambda self, *args: True)
    gen.generate([list(p) for p in PROMPTS[:3]], [SamplingParams(max_new_tokens=6)] * 3)
    assert seen and all(s[:2] == s[2:] for s in seen)
    assert max(s[0] for s in seen) == 4                         # three requests run in the R = 4 slots


def test_bench_layout_cost_script_small(engine_dir, tmp_path):  # noqa: F811
    """scripts/bench_layout_cost.py on the tiny engine directory, so the script cannot rot."""
    from ..script_loader import load_script

    module = load_script("bench_layout_cost.py")
    out = tmp_path / "layout.json"
    assert module.main(["--engine-dir", str(engine_dir), "--repeats", "2", "--capacities", "128,256",
                        "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {128, 256} <= {c["P"] for c in report["layouts"]} and len(report["layouts"]) >= 10
    for c in report["layouts"]:
        assert c["measured_ms"] > 0 and c["sps_only_ms"] > 0 and c["layout_ms"] > 0 and c["B"] <= c["N"]
        assert c["Q"] == padded_width(max(c["rows"]), c["N"], c["S"])
    with pytest.raises(SystemExit) as e:
        module.main(["--engine-dir", str(engine_dir), "--capacities", "48,4096"])   # 48: not a multiple of 128
    assert e.value.code == 2


def _best_plan_loop(survival, num_requests, profile, draft_at_zero, draft_slots=None):
    """Reference for `_best_plan` with a layout cost: one `_throughputs` per cap, as the C++ port runs it."""
    from dspark_export.runtime.scheduler import _sorted_candidates, _throughputs

    order, ranked = _sorted_candidates(survival)
    depth = order // max(survival.shape[0], 1) + 1
    deepest = int(depth.max(initial=1))
    best = None
    for cap in range(1, deepest + 1):
        keep = depth <= cap
        theta = _throughputs(ranked[keep], num_requests, profile, draft_at_zero, draft_slots, depth[keep])
        k = int(np.argmax(theta))
        if best is None or theta[k] > best[2]:
            best = (k, cap if cap < deepest else None, float(theta[k]), float(theta[0]))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_vectorised_cap_search_equals_the_loop(seed):
    from dspark_export.runtime.scheduler import _best_plan

    rng = np.random.default_rng(seed)
    for _ in range(150):
        rows, gamma = int(rng.integers(1, 17)), int(rng.integers(1, 9))
        conf = rng.choice([0.0, 0.3, 0.5, 0.9, 1.0], size=(rows, gamma)) if rng.random() < 0.3 else \
            rng.uniform(0, 1, (rows, gamma))
        buckets = tuple(sorted(int(b) for b in rng.choice(np.arange(1, 129), int(rng.integers(1, 8)), replace=False)))
        p = ThroughputProfile(buckets, tuple(float(x) for x in rng.uniform(5, 100, len(buckets))),
                              (1, 16), (float(rng.uniform(0, 30)), float(rng.uniform(0, 30))),
                              attention_ms=float(rng.uniform(0, 3e-3)), kv_read_ms=float(rng.uniform(0, 3e-3)),
                              profiled_layout=tuple((int(rng.integers(1, 17)), int(rng.integers(1, 9)),
                                                     int(rng.integers(16, 513))) for _ in buckets))
        p = p.at(int(rng.integers(1, 17)), int(rng.integers(16, 2049)))
        a = survival_probs(conf.astype(np.float32))
        R = int(rng.integers(1, 17))
        for draft_at_zero in (False, True):
            assert _best_plan(a, R, p, draft_at_zero, 16) == _best_plan_loop(a, R, p, draft_at_zero, 16)


def test_exact_rows_interpolate_between_buckets_and_never_exceed_the_staircase():
    """With exact rows a B between buckets costs the latency interpolated between theirs (10 ms at 8, 18 ms at
    16: B = 12 costs 14 ms, not 18); at a bucket, and without exact rows, the staircase's; a larger bucket that
    ran faster still wins; beyond the largest bucket nothing runs."""
    sps = (1000 / 4.0, 1000 / 10.0, 1000 / 18.0, 1000 / 17.0)   # buckets 4, 8, 16, 32 (32 ran faster than 16)
    stair = ThroughputProfile((4, 8, 16, 32), sps)
    exact = ThroughputProfile((4, 8, 16, 32), sps, exact_rows=True)
    np.testing.assert_allclose(exact.step_seconds([1, 4, 6, 8, 12, 16, 24]) * 1e3, [4, 4, 7, 10, 14, 17, 17])
    np.testing.assert_allclose(stair.step_seconds([1, 4, 6, 8, 12, 16, 24]) * 1e3, [4, 4, 10, 10, 17, 17, 17])
    assert exact.sps(12) == pytest.approx(1000 / 14.0) and stair.sps(12) == pytest.approx(1000 / 17.0)
    np.testing.assert_allclose(exact.sps_range(5, 3), 1000 / np.array([5.5, 7.0, 8.5]))
    assert exact.sps(33) == 0 and np.isinf(exact.step_seconds([33])[0]) and exact.sps(-1) == exact.sps(0)
    assert exact.at(4, 256).exact_rows and exact != stair


def test_the_generator_prices_exact_rows_where_its_engines_run_them(engine_dir):  # noqa: F811
    from dspark_export.engines.engine_set import EngineSet
    from dspark_export.runtime.generator import Generator
    for prepack in (True, False):     # shared sessions run a feed's own rows; per-bucket sessions their bucket
        engines = EngineSet.open(engine_dir, verify=False, prepack=prepack)
        assert engines.runs_exact_rows("target") is prepack
        assert Generator(engines, parse_policy("dspark")).profile.exact_rows is prepack
