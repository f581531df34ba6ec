"""STS, ECE and offline rounds."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_export.modeling.config import DrafterConfig
from dspark_export.modeling.drafter import init_drafter
from dspark_export.training.calibration import (Rounds, expected_calibration_error, fit_sts, reliability_bins,
                                                reliability_diagram, replay_rounds, survival)


def test_ece_known_values():
    assert expected_calibration_error(np.array([0.9, 0.9]), np.array([1, 1])) == pytest.approx(0.1)
    assert expected_calibration_error(np.array([0.25, 0.75]), np.array([0, 1])) == pytest.approx(0.25)
    assert expected_calibration_error(np.full(4, 0.5), np.array([0, 1, 0, 1])) == pytest.approx(0.0)


def _synthetic_rounds(n=20000, G=5, true_scale=0.5, seed=0):
    """Logits twice as sharp as the truth: the right temperature is 2 at every position."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.0, 2.0, size=(n, G))
    p = 1 / (1 + np.exp(-z * true_scale))
    accepted = rng.random((n, G)) < p
    return Rounds(z.astype(np.float32), accepted, np.ones((n, G), bool), ["x"] * n)


def test_sts_recovers_the_temperature_and_lowers_ece(tmp_path):
    rounds = _synthetic_rounds()
    fit = fit_sts(rounds)
    assert np.allclose(fit["confidence_temperature"], 2.0, rtol=0.15)
    assert fit["mean_ece_after"] < 0.02 < fit["mean_ece_before"]
    assert all(a <= b + 1e-9 for a, b in zip(fit["ece_after"], fit["ece_before"]))
    # order-preserving per position
    s1, s2 = survival(rounds.conf_logits, np.ones(5)), survival(rounds.conf_logits, fit["confidence_temperature"])
    assert (np.argsort(s1[:, 0], kind="stable") == np.argsort(s2[:, 0], kind="stable")).all()
    png = reliability_diagram(rounds, fit["confidence_temperature"], tmp_path / "rel.png")
    assert png.stat().st_size > 1000


def test_reliability_bins_agree_with_the_fit():
    """The bins' ECE is fit_sts's ECE (same bins), counts cover every valid round, and after STS the observed
    survival tracks the predicted one bin by bin."""
    rounds = _synthetic_rounds(n=8000, G=3)
    rounds.valid[:100, 2] = False
    fit = fit_sts(rounds)
    rel = reliability_bins(rounds, fit["confidence_temperature"])
    assert rel["bins"] == 20 and rel["rounds"] == 8000 and [p["position"] for p in rel["positions"]] == [1, 2, 3]
    assert [p["sts"]["ece"] for p in rel["positions"]] == pytest.approx(fit["ece_after"], abs=1e-5)
    assert [p["raw"]["ece"] for p in rel["positions"]] == pytest.approx(fit["ece_before"], abs=1e-5)
    assert [sum(p["sts"]["count"]) for p in rel["positions"]] == [8000, 8000, 7900]
    for p in rel["positions"]:
        gap = sum(n * abs(pr - ob) for pr, ob, n in zip(p["sts"]["predicted"], p["sts"]["observed"], p["sts"]["count"]))
        assert gap / sum(p["sts"]["count"]) == pytest.approx(p["sts"]["ece"], abs=1e-4) and p["sts"]["ece"] < 0.03
    assert all(sorted(p["raw"]["predicted"]) == p["raw"]["predicted"] for p in rel["positions"])


def test_rounds_acceptance_length_counts_the_bonus_token():
    acc = np.array([[1, 1, 0], [0, 1, 1], [1, 1, 1]], bool)
    r = Rounds(np.zeros((3, 3), np.float32), acc, np.ones((3, 3), bool), ["a"] * 3)
    assert r.acceptance_length() == pytest.approx(1 + (2 + 0 + 3) / 3)
    assert r.conditional_acceptance() == pytest.approx([2 / 3, 1.0, 0.5])


def test_replay_rounds_on_a_tiny_drafter(train_target, feature_cache):
    cfg = DrafterConfig.from_target(train_target.config, block_size=4, markov_rank=8)
    rounds = replay_rounds(init_drafter(train_target, cfg), feature_cache, stride=3)
    assert rounds.conf_logits.shape == rounds.accepted.shape and rounds.accepted.shape[1] == 4
    assert 1.0 <= rounds.acceptance_length() <= 5.0
    assert not (rounds.accepted & ~rounds.valid).any()


def test_bias_recovers_a_shifted_head_that_temperature_cannot_fix():
    """A head whose logits are twice as sharp AND shifted by −0.8: temperatures alone cannot move the
    mean confidence; a per-position bias recovers T ≈ 2, b ≈ 0.8 and a low ECE."""
    rng = np.random.default_rng(1)
    n, G = 20000, 3
    z = rng.normal(0.0, 2.0, size=(n, G))
    accepted = rng.random((n, G)) < 1 / (1 + np.exp(-(z * 0.5 + 0.8)))
    rounds = Rounds(z.astype(np.float32), accepted, np.ones((n, G), bool), ["x"] * n)
    temps_only = fit_sts(rounds, bias_grid=(0.0,))
    both = fit_sts(rounds)
    assert temps_only["confidence_bias"] == [0.0] * G
    assert np.allclose(both["confidence_temperature"], 2.0, rtol=0.2)
    assert np.allclose(both["confidence_bias"], 0.8, atol=0.25)
    assert both["mean_ece_after"] < 0.015 < temps_only["mean_ece_after"]
    rel = reliability_bins(rounds, both["confidence_temperature"], biases=both["confidence_bias"])
    assert [p["sts"]["ece"] for p in rel["positions"]] == pytest.approx(both["ece_after"], abs=1e-5)


def test_fit_calibration_keeps_a_temperature_only_fit_with_its_own_ece():
    """σ(z/T) consumers get the paper's STS fitted on the same rounds; its ECE is that of Π σ(z_i/T_i) itself
    (not the temperature + bias fit's), and a shifted head leaves it worse than the biased fit."""
    from dspark_export.training.calibration import fit_calibration, temperature_only

    rng = np.random.default_rng(2)
    n, G = 12000, 3
    z = rng.normal(0.0, 2.0, size=(n, G))
    accepted = rng.random((n, G)) < 1 / (1 + np.exp(-(z * 0.5 + 0.8)))
    rounds = Rounds(z.astype(np.float32), accepted, np.ones((n, G), bool), ["x"] * n)
    fit = fit_calibration(rounds)
    plain = fit["temperature_only"]
    assert plain == {k: fit_sts(rounds, bias_grid=(0.0,))[k] for k in plain}
    assert any(fit["confidence_bias"]) and "confidence_bias" not in plain
    a = survival(rounds.conf_logits, plain["confidence_temperature"])
    y = rounds.survived
    assert plain["ece_after"] == pytest.approx([expected_calibration_error(a[:, k], y[:, k]) for k in range(G)],
                                               abs=1e-5)
    assert fit["mean_ece_after"] < plain["mean_ece_after"]
    assert temperature_only(fit) is plain
    # an old file (biases, no entry) has no temperature-only fit; a bias-free one is its own
    old = {k: v for k, v in fit.items() if k != "temperature_only"}
    assert temperature_only(old) is None
    assert temperature_only({**old, "confidence_bias": [0.0] * G})["confidence_temperature"] == \
        fit["confidence_temperature"]
