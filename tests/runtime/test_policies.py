"""Verification-length policies and the hardware-aware prefix scheduler (runtime/policies.py, scheduler.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dspark_export.errors import ConfigError, ProfileError, RequestError
from dspark_export.plugins.common.sampling import SamplingBatch
from dspark_export.plugins.speculative_verify.reference import speculative_verify
from dspark_export.runtime.policies import Policy, parse_policy, threshold_lengths
from dspark_export.engines.sps import ThroughputProfile
from dspark_export.runtime.scheduler import (dspark_async_lengths, dspark_lengths,
                                             expected_throughput, survival_probs)

GAMMA = 7
POW2 = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _linear_latency(t0_ms: float, t1_ms: float, buckets=tuple(range(1, 257))) -> ThroughputProfile:
    """SPS(B) = 1000 / (t0 + t1·B): a smooth profile when every B is a bucket, a staircase otherwise."""
    return ThroughputProfile(buckets, tuple(1000.0 / (t0_ms + t1_ms * b) for b in buckets))


def _random_confidence(rng, num_requests: int, gamma: int = GAMMA, low: float = 0.2) -> np.ndarray:
    return rng.uniform(low, 1.0, (num_requests, gamma)).astype(np.float32)


def _greedy_path(confidence: np.ndarray, profile: ThroughputProfile) -> np.ndarray:
    """Θ_k for k = 0..n along the survival-sorted admission path (reference, written independently)."""
    num_requests = confidence.shape[0]
    ranked = sorted(survival_probs(confidence).ravel(), reverse=True)
    ranked = [a for a in ranked if a > 0]
    tau = num_requests + np.concatenate(([0.0], np.cumsum(ranked)))
    return np.array([t * profile.sps(num_requests + k) for k, t in enumerate(tau)])


def _brute_force(confidence: np.ndarray, profile: ThroughputProfile) -> tuple[float, list[tuple[int, ...]]]:
    """max Θ over every ℓ ∈ {0..γ}^R (all prefix-respecting allocations) and the allocations reaching it."""
    best, arg = -1.0, []
    for lengths in itertools.product(range(confidence.shape[1] + 1), repeat=confidence.shape[0]):
        theta = expected_throughput(confidence, np.array(lengths), profile)
        if theta > best * (1 + 1e-12):
            best, arg = theta, [lengths]
        elif theta >= best * (1 - 1e-12):
            arg.append(lengths)
    return best, arg


def _retrospective_lengths(confidence, profile):
    """Global argmax over K on the CURRENT confidences (no early stop): what Appendix A warns against."""
    return dspark_async_lengths(confidence, confidence, profile)


# -- profile ---------------------------------------------------------------------------------------

def test_profile_from_sps_json_pads_up_to_the_next_bucket():
    data = {"target": [{"B": 4, "median_ms": 12.5, "p10_ms": 12.0, "p90_ms": 13.0, "sps": 80.0},
                       {"B": 1, "median_ms": 10.0, "p10_ms": 9.5, "p90_ms": 10.5, "sps": 100.0},
                       {"B": 16, "median_ms": 25.0, "p10_ms": 24.0, "p90_ms": 26.0, "sps": 40.0}],
            "drafter_block": [], "warnings": []}
    profile = ThroughputProfile.from_json(data)
    assert profile.buckets == (1, 4, 16) and profile.max_tokens == 16
    assert [profile.sps(b) for b in (1, 2, 4, 5, 16, 17)] == [100.0, 80.0, 80.0, 40.0, 40.0, 0.0]
    np.testing.assert_array_equal(profile.sps(np.array([1, 3, 9, 100])), [100.0, 80.0, 40.0, 0.0])


@pytest.mark.parametrize("data, match", [
    ({}, "non-empty 'target'"),
    ({"target": [{"B": 1}]}, "numeric 'sps'"),
    ({"target": [{"B": 1, "sps": 10.0}, {"B": 1, "sps": 9.0}]}, "strictly increasing"),
    ({"target": [{"B": 1, "sps": 0.0}]}, "> 0"),
    ({"target": [{"B": 0, "sps": 1.0}]}, ">= 1|≥ 1"),
])
def test_profile_rejects_bad_tables(data, match):
    with pytest.raises(ProfileError, match=match):
        ThroughputProfile.from_json(data)


# -- parsing and the ar / fixed behaviour the generator relies on -----------------------------------

@pytest.mark.parametrize("text, policy", [
    ("ar", Policy("ar")), ("fixed:3", Policy("fixed", 3)), (" fixed:7 ", Policy("fixed", 7)),
    ("threshold:0.85", Policy("threshold", threshold=0.85)), ("threshold:1", Policy("threshold", threshold=1.0)),
    ("dspark", Policy("dspark")), ("dspark-async", Policy("dspark-async")),
])
def test_parse_policy_round_trips(text, policy):
    assert parse_policy(text) == policy
    assert parse_policy(str(policy)) == policy


@pytest.mark.parametrize("text, match", [
    ("fixed:0", "integer K >= 1"), ("fixed:-2", "integer K >= 1"), ("fixed:x", "integer K >= 1"),
    ("threshold:1.5", r"C in \(0, 1\]"), ("threshold:0", r"C in \(0, 1\]"), ("threshold:nan", r"C in \(0, 1\]"),
    ("threshold:", r"C in \(0, 1\]"), ("dspark:3", "expected one of"), ("greedy", "expected one of"),
    ("", "expected one of"),
])
def test_parse_policy_rejects_bad_text(text, match):
    with pytest.raises(RequestError, match=match):
        parse_policy(text)


def test_ar_and_fixed_are_unchanged():
    conf = np.random.default_rng(0).uniform(0, 1, (5, 4)).astype(np.float32)
    assert not Policy("ar").drafts and Policy("fixed", 2).drafts and Policy("dspark").drafts
    np.testing.assert_array_equal(Policy("ar").verify_lengths(conf, 4), [0] * 5)
    np.testing.assert_array_equal(Policy("fixed", 2).verify_lengths(conf, 4), [2] * 5)
    np.testing.assert_array_equal(Policy("fixed", 7).verify_lengths(conf, 4), [4] * 5)   # min(K, γ)
    assert Policy("fixed", 3).verify_lengths(None, 4).shape == (0,)
    for lengths in (Policy("ar").verify_lengths(conf, 4), Policy("fixed", 3).verify_lengths(conf, 4)):
        assert lengths.dtype == np.int64


def test_dspark_policies_need_a_profile():
    conf = np.full((2, 4), 0.9, np.float32)
    for text in ("dspark", "dspark-async"):
        with pytest.raises(ConfigError, match="needs the throughput profile"):
            parse_policy(text).verify_lengths(conf, 4)


def test_confidence_is_checked_at_the_boundary():
    profile = _linear_latency(2.0, 0.1)
    with pytest.raises(ValueError, match=r"\[R, γ=4\]"):
        Policy("dspark").verify_lengths(np.full((2, 3), 0.5, np.float32), 4, profile)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Policy("dspark").verify_lengths(np.array([[0.5, 1.5, 0.2, 0.1]], np.float32), 4, profile)
    with pytest.raises(ValueError, match="NaN"):
        dspark_lengths(np.array([[0.5, np.nan]], np.float32), profile)
    with pytest.raises(ValueError, match="max_lengths"):
        dspark_lengths(np.full((2, 3), 0.5, np.float32), profile, max_lengths=np.array([1]))


# -- hand cases -------------------------------------------------------------------------------------

def test_threshold_is_a_per_step_conditional_test():
    conf = np.array([[0.9, 0.6, 0.4, 0.9], [0.3, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5]], np.float32)
    np.testing.assert_array_equal(threshold_lengths(conf, 0.5), [2, 0, 4])
    # The survival of row 2 is 0.0625 at j = 4, far below C: the test is on c, not on Π c.
    np.testing.assert_array_equal(parse_policy("threshold:0.5").verify_lengths(conf, 4), [2, 0, 4])
    np.testing.assert_array_equal(parse_policy("threshold:1").verify_lengths(conf, 4), [0, 0, 0])


DOC_CONF = np.array([[0.9, 0.8, 0.5], [0.6, 0.5, 0.9]], np.float32)
DOC_PROFILE = ThroughputProfile((2, 4, 8), (100.0, 90.0, 75.0))


def test_dspark_docstring_example_stops_at_the_cliff():
    lengths = dspark_lengths(DOC_CONF, DOC_PROFILE)
    np.testing.assert_array_equal(lengths, [2, 0])
    assert expected_throughput(DOC_CONF, lengths, DOC_PROFILE) == pytest.approx(325.8, rel=1e-6)


def test_dspark_async_docstring_example_searches_past_the_cliff():
    lengths = dspark_async_lengths(DOC_CONF, DOC_CONF, DOC_PROFILE)
    np.testing.assert_array_equal(lengths, [3, 3])
    assert expected_throughput(DOC_CONF, lengths, DOC_PROFILE) == pytest.approx(386.25, rel=1e-6)


def test_dspark_tie_break_prefers_lower_position_then_lower_request():
    # Every survival is 1: the order is (0,1), (1,1), (0,2), (1,2), ...; B = 2..4 share a bucket, 5 is a cliff.
    conf = np.ones((2, 3), np.float32)
    profile = ThroughputProfile((4, 8), (100.0, 10.0))
    np.testing.assert_array_equal(dspark_lengths(conf, profile), [1, 1])
    np.testing.assert_array_equal(dspark_async_lengths(conf, np.ones((2, 3), np.float32), profile), [1, 1])
    np.testing.assert_array_equal(dspark_lengths(np.ones((3, 3), np.float32), profile), [1, 0, 0])


def test_dspark_never_admits_zero_survival_and_respects_caps():
    conf = np.array([[0.9, 0.0, 0.9], [1.0, 1.0, 1.0]], np.float32)
    flat = ThroughputProfile((64,), (100.0,))                # verifying is free: admit every a > 0
    np.testing.assert_array_equal(dspark_lengths(conf, flat), [1, 3])
    np.testing.assert_array_equal(dspark_lengths(conf, flat, max_lengths=np.array([3, 2])), [1, 2])
    np.testing.assert_array_equal(dspark_async_lengths(conf, conf, flat, max_lengths=np.array([0, 1])), [0, 1])
    np.testing.assert_array_equal(Policy("fixed", 3).verify_lengths(conf, 3, max_lengths=np.array([3, 2])), [3, 2])


def test_dspark_stays_within_the_largest_bucket():
    conf = np.ones((3, 4), np.float32)
    profile = ThroughputProfile((1, 2, 4, 8), (100.0, 99.0, 98.0, 97.0))
    assert dspark_lengths(conf, profile).sum() + 3 == 8
    assert dspark_async_lengths(conf, conf, profile).sum() + 3 == 8
    # R itself beyond the largest bucket: nothing can run, nothing is admitted.
    np.testing.assert_array_equal(dspark_lengths(np.ones((9, 4), np.float32), profile), [0] * 9)


def test_dspark_async_without_history_falls_back_to_algorithm_1():
    rng = np.random.default_rng(1)
    profile = _linear_latency(2.0, 0.05, POW2)
    for _ in range(20):
        conf = _random_confidence(rng, 6)
        np.testing.assert_array_equal(dspark_async_lengths(conf, None, profile), dspark_lengths(conf, profile))
        np.testing.assert_array_equal(Policy("dspark-async").verify_lengths(conf, GAMMA, profile),
                                      dspark_lengths(conf, profile))


def test_dspark_async_takes_the_lagged_capacity_by_current_rank():
    lagged = np.full((2, 3), 0.9, np.float32)
    current = np.array([[0.2, 0.9, 0.9], [0.95, 0.9, 0.9]], np.float32)
    flat = ThroughputProfile((3,), (100.0,))                 # B ≤ 3: the lagged search picks K = 1
    np.testing.assert_array_equal(dspark_async_lengths(current, lagged, flat), [0, 1])
    # More lagged requests than current ones: K = 4 is searched with the current R = 2 anchors.
    roomy = ThroughputProfile((6,), (100.0,))
    np.testing.assert_array_equal(dspark_async_lengths(current, np.full((5, 3), 0.9, np.float32), roomy), [1, 3])


def _algorithm_1_loop(confidence: np.ndarray, profile: ThroughputProfile, early_stop: bool = True) -> np.ndarray:
    """Paper Algorithm 1 transcribed line by line (one candidate per iteration); early_stop=False: global argmax."""
    num_requests, gamma = confidence.shape
    a = survival_probs(confidence)
    cands = sorted(((a[r, j], j, r) for r in range(num_requests) for j in range(gamma) if a[r, j] > 0),
                   key=lambda t: (-t[0], t[1], t[2]))
    lengths, best_lengths = np.zeros(num_requests, np.int64), np.zeros(num_requests, np.int64)
    batch, tau = num_requests, float(num_requests)
    best = tau * profile.sps(batch)
    for survival, j, r in cands:
        lengths[r] = j + 1
        batch, tau = batch + 1, tau + survival
        theta = tau * profile.sps(batch)
        if theta > best:
            best, best_lengths = theta, lengths.copy()
        elif early_stop:
            break
    return best_lengths


def test_vectorised_scheduler_equals_the_literal_algorithm():
    rng = np.random.default_rng(2)
    for _ in range(200):
        num_requests = int(rng.integers(1, 17))
        conf = _random_confidence(rng, num_requests, low=0.0)
        conf[rng.uniform(size=conf.shape) < 0.15] = 1.0      # exact ties in survival
        conf[rng.uniform(size=conf.shape) < 0.05] = 0.0
        profile = _linear_latency(rng.uniform(0.5, 4.0), rng.uniform(0.01, 0.5), POW2)
        np.testing.assert_array_equal(dspark_lengths(conf, profile), _algorithm_1_loop(conf, profile))
        np.testing.assert_array_equal(_retrospective_lengths(conf, profile),
                                      _algorithm_1_loop(conf, profile, early_stop=False))


# -- Algorithm 1 against a brute force --------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_dspark_equals_brute_force_on_smooth_profiles(seed):
    """On a smooth profile Θ is unimodal along the greedy path, so the early stop finds the global optimum."""
    rng = np.random.default_rng(seed)
    for _ in range(25):
        conf = _random_confidence(rng, int(rng.integers(1, 4)), gamma=3, low=0.0)
        profile = _linear_latency(rng.uniform(0.5, 5.0), rng.uniform(0.05, 2.0), tuple(range(1, 17)))
        theta = _greedy_path(conf, profile)
        peak = int(np.argmax(theta))
        assert np.all(np.diff(theta[:peak + 1]) > 0) and np.all(np.diff(theta[peak:]) <= 0)  # unimodal
        best, arg = _brute_force(conf, profile)
        lengths = dspark_lengths(conf, profile)
        assert expected_throughput(conf, lengths, profile) == pytest.approx(best, rel=1e-12)
        assert tuple(lengths) in arg


@pytest.mark.parametrize("seed", range(4))
def test_dspark_on_staircases_is_optimal_exactly_when_unimodal(seed):
    """On a staircase Algorithm 1 may stop at a cliff; the global search always reaches the brute-force optimum."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(25):
        conf = _random_confidence(rng, int(rng.integers(1, 4)), gamma=3, low=0.0)
        profile = _linear_latency(rng.uniform(0.5, 5.0), rng.uniform(0.05, 2.0), (1, 2, 4, 8, 16))
        best, arg = _brute_force(conf, profile)
        theta = _greedy_path(conf, profile)
        got = expected_throughput(conf, dspark_lengths(conf, profile), profile)
        assert got <= best * (1 + 1e-12)
        peak = int(np.argmax(theta))
        if np.all(np.diff(theta[:peak + 1]) > 0):           # the first descent is the global peak
            assert got == pytest.approx(best, rel=1e-12)
        else:                                                # a cliff before the peak stops it short
            assert got < best
        retro = _retrospective_lengths(conf, profile)
        assert expected_throughput(conf, retro, profile) == pytest.approx(best, rel=1e-12)


# -- Appendix A: selection bias without the early stop ----------------------------------------------

APPENDIX_PROFILE = ThroughputProfile((1, 2, 3), (1.0, 0.5, 0.45))
# x1 = A (token 0) makes the next confidence high, x1 = B (token 1) makes it zero.
APPENDIX_CONF = {0: np.array([[0.8, 0.9]], np.float32), 1: np.array([[0.8, 0.0]], np.float32)}


def test_appendix_a_admission_of_x1_depends_on_x1_only_without_early_stop():
    retro = {x: int(_retrospective_lengths(c, APPENDIX_PROFILE)[0]) for x, c in APPENDIX_CONF.items()}
    assert retro == {0: 2, 1: 0}              # Θ = (1.0, 0.9, 1.134) vs (1.0, 0.9, 0.81)
    assert expected_throughput(APPENDIX_CONF[0], [2], APPENDIX_PROFILE) == pytest.approx(1.134)
    assert expected_throughput(APPENDIX_CONF[1], [2], APPENDIX_PROFILE) == pytest.approx(0.81)
    # Algorithm 1 stops at Θ_1 = 0.9 < Θ_0 = 1.0 before c_2 is looked at.
    assert {x: int(dspark_lengths(c, APPENDIX_PROFILE)[0]) for x, c in APPENDIX_CONF.items()} == {0: 0, 1: 0}
    # dspark-async: the capacity comes from an earlier step, the same whatever x1 is now.
    for lagged, admitted in ((np.array([[0.8, 0.9]], np.float32), True), (np.array([[0.8, 0.0]], np.float32), False)):
        lengths = {x: int(dspark_async_lengths(c, lagged, APPENDIX_PROFILE)[0]) for x, c in APPENDIX_CONF.items()}
        assert {x: n >= 1 for x, n in lengths.items()} == {0: admitted, 1: admitted}


def _first_token_distribution(lengths_of) -> np.ndarray:
    """Exact Pr(Y) of the first output token on the Appendix A example, through the verify reference op.

    p_t = (0.7, 0.3), p_d = (0.5, 0.5). x1 ~ p_d; ℓ = lengths_of(x1); the uniforms (u_1 for the test
    of x1, u_γ for the recovered/bonus draw) run over a 100 × 100 midpoint grid, on which every
    threshold (0.6, 0.7) falls between grid points, so the average is exact.
    """
    n = 100
    u = (np.arange(n) + 0.5) / n
    u_test, u_next = (g.ravel() for g in np.meshgrid(u, u, indexing="ij"))
    num = n * n
    target = np.log(np.array([0.7, 0.3], np.float32))
    draft = np.log(np.array([0.5, 0.5], np.float32))
    probs = np.zeros(2)
    for x1 in (0, 1):
        length = int(lengths_of(x1))
        uniforms = np.stack([u_test, np.full(num, 0.5), u_next], axis=1).astype(np.float32)
        out = speculative_verify(
            np.tile(target, (num * (length + 1), 1)), np.arange(num + 1, dtype=np.int64) * (length + 1),
            np.tile(np.array([x1, 0], np.int64), (num, 1)), np.tile(draft, (num, 2, 1)),
            np.full(num, length, np.int64),
            SamplingBatch(np.ones(num, np.float32), np.zeros(num, np.int64), np.ones(num, np.float32)), uniforms)
        first = np.where(out.num_accepted >= 1, x1, out.next_ids)
        probs += 0.5 * np.bincount(first, minlength=2) / num
    return probs


def test_appendix_a_output_distribution():
    target = [0.7, 0.3]
    retro = _first_token_distribution(lambda x: _retrospective_lengths(APPENDIX_CONF[x], APPENDIX_PROFILE)[0])
    np.testing.assert_allclose(retro, [0.85, 0.15], atol=1e-12)          # the paper's biased distribution
    causal = _first_token_distribution(lambda x: dspark_lengths(APPENDIX_CONF[x], APPENDIX_PROFILE)[0])
    np.testing.assert_allclose(causal, target, atol=1e-12)
    for lagged in (np.array([[0.8, 0.9]], np.float32), np.array([[0.8, 0.0]], np.float32)):
        lag = _first_token_distribution(lambda x: dspark_async_lengths(APPENDIX_CONF[x], lagged, APPENDIX_PROFILE)[0])
        np.testing.assert_allclose(lag, target, atol=1e-12)
    # A fixed length is lossless too (sanity of the harness itself).
    np.testing.assert_allclose(_first_token_distribution(lambda x: 1), target, atol=1e-12)


def _count_anticipations(lengths_of, trials: int = 60) -> int:
    """How often 1[ℓ_r ≥ j] changes when c[r, j+1..γ] (functions of the drawn x_{r,j}) are redrawn.

    lengths_of(confidence, lagged, profile) → [R] lengths; a non-anticipating policy gives 0.
    """
    rng = np.random.default_rng(7)
    count = 0
    for _ in range(trials):
        num_requests = int(rng.integers(1, 9))
        profile = _linear_latency(rng.uniform(0.5, 4.0), rng.uniform(0.02, 0.5), POW2)
        conf, lagged = _random_confidence(rng, num_requests, low=0.0), _random_confidence(rng, num_requests, low=0.0)
        base = lengths_of(conf, lagged, profile)
        r, j = int(rng.integers(num_requests)), int(rng.integers(1, GAMMA + 1))
        changed = conf.copy()
        changed[r, j:] = rng.uniform(0.0, 1.0, GAMMA - j)
        count += bool((lengths_of(changed, lagged, profile)[r] >= j) != (base[r] >= j))
    return count


@pytest.mark.parametrize("policy", ["threshold:0.6", "dspark", "dspark-async", "fixed:3"])
def test_admission_never_depends_on_later_confidences(policy):
    pol = parse_policy(policy)
    assert _count_anticipations(lambda c, lagged, p: pol.verify_lengths(c, GAMMA, p, lagged)) == 0


def test_retrospective_search_is_anticipating():
    """The same check catches a global search on the current confidences: the Appendix A pair, and random batches."""
    base, changed = (int(_retrospective_lengths(c, APPENDIX_PROFILE)[0]) for c in APPENDIX_CONF.values())
    assert (base >= 1) != (changed >= 1)
    assert _count_anticipations(lambda c, lagged, p: _retrospective_lengths(c, p)) > 0


# -- properties ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["ar", "fixed:1", "fixed:9", "threshold:0.7", "dspark", "dspark-async"])
def test_lengths_are_in_range_and_prefix_respecting(policy):
    rng = np.random.default_rng(3)
    pol = parse_policy(policy)
    for _ in range(100):
        num_requests = int(rng.integers(1, 17))
        conf = _random_confidence(rng, num_requests, low=0.0)
        conf[rng.uniform(size=conf.shape) < 0.1] = 1.0      # ties in survival
        profile = _linear_latency(rng.uniform(0.5, 4.0), rng.uniform(0.01, 0.5), POW2)
        lengths = pol.verify_lengths(conf, GAMMA, profile, _random_confidence(rng, num_requests))
        assert lengths.dtype == np.int64 and lengths.shape == (num_requests,)
        assert np.all((lengths >= 0) & (lengths <= GAMMA))
        if pol.needs_profile:
            # Prefix property: every admitted position survives at least as well as every rejected one
            # (ranked by survival, ties by position), and B stays within the largest bucket.
            a = survival_probs(conf)
            taken = np.arange(GAMMA)[None, :] < lengths[:, None]
            if taken.any() and (~taken).any():
                assert a[taken].min() >= a[~taken].max()
            assert num_requests + lengths.sum() <= profile.max_tokens


@pytest.mark.parametrize("policy", ["dspark", "dspark-async"])
def test_a_flatter_profile_never_shrinks_the_budget(policy):
    """SPS'(B) = SPS(B)·g(B) with g positive and non-decreasing: every improving step stays improving."""
    rng = np.random.default_rng(11)
    pol = parse_policy(policy)
    for _ in range(100):
        num_requests = int(rng.integers(1, 17))
        conf, lagged = _random_confidence(rng, num_requests), _random_confidence(rng, num_requests)
        steep = _linear_latency(rng.uniform(0.5, 4.0), rng.uniform(0.02, 0.5), POW2)
        growth = np.cumprod(rng.uniform(1.0, 1.3, len(POW2)))
        flat = ThroughputProfile(POW2, tuple(np.array(steep.steps_per_s) * growth))
        budget_flat = pol.verify_lengths(conf, GAMMA, flat, lagged).sum()
        assert budget_flat >= pol.verify_lengths(conf, GAMMA, steep, lagged).sum()


@pytest.mark.parametrize("policy", ["dspark", "dspark-async"])
def test_more_load_never_lengthens_a_request_on_a_smooth_profile(policy):
    """Holds for SPS = 1/(t0 + t1·B) on every B (checked over many random batches before writing this).

    Why: Θ = τ / (t0 + t1·B) is maximised by admitting exactly the candidates with a > λ*, where
    λ* = max Θ·t1 = max τ/(t0/t1 + B); added requests (each an anchor worth 1 token for 1 row) can only
    raise λ*, so no existing request's ℓ grows. On a staircase this fails (next test).
    """
    rng = np.random.default_rng(5)
    for _ in range(100):
        profile = _linear_latency(rng.uniform(0.5, 4.0), rng.uniform(0.02, 0.5))
        conf = _random_confidence(rng, int(rng.integers(1, 6)), low=0.3)
        more = np.vstack([conf, _random_confidence(rng, int(rng.integers(1, 10)), low=0.3)])
        lengths_of = (lambda c: dspark_lengths(c, profile)) if policy == "dspark" else \
            (lambda c: dspark_async_lengths(c, c, profile))
        base = lengths_of(conf)
        assert np.all(lengths_of(more)[:len(conf)] <= base)
        assert lengths_of(np.tile(conf, (3, 1))).mean() <= base.mean()


def test_more_load_can_lengthen_requests_on_a_staircase():
    """On a staircase, extra requests can fill a bucket that is already paid for, so the mean ℓ grows.

    R = 1: Θ_0 = 1·100 = 100, admitting a = 0.5 costs bucket 2: 1.5·60 = 90 → ℓ = 0.
    R = 3 (same request three times): B = 3 pads to bucket 4, so the 4th row is free: 3·55 = 165 →
    3.5·55 = 192.5; the next one costs bucket 8: 4·40 = 160 → stop. Mean ℓ = 1/3 > 0.
    """
    conf = np.full((1, 3), 0.5, np.float32)
    profile = ThroughputProfile((1, 2, 4, 8, 16), (100.0, 60.0, 55.0, 40.0, 25.0))
    assert dspark_lengths(conf, profile).mean() == 0
    assert dspark_lengths(np.tile(conf, (3, 1)), profile).mean() == pytest.approx(1 / 3)
    assert dspark_async_lengths(np.tile(conf, (3, 1)), np.tile(conf, (3, 1)), profile).mean() > 0
