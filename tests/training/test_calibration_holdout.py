"""scripts/calibration_holdout.py: held-out ECE of Sequential Temperature Scaling on synthetic rounds."""

from __future__ import annotations

import json

import numpy as np

from ..script_loader import load_script


def _rounds_file(tmp_path, M=4000, G=3, shift=1.5, seed=0):
    """Rounds whose conditional acceptance is σ(z − shift): the raw head overrates every draft by `shift` logits."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.5, 1.5, size=(M, G)).astype(np.float32)
    accepted = rng.random((M, G)) < 1 / (1 + np.exp(-(z - shift)))
    path = tmp_path / "rounds.npz"
    np.savez_compressed(path, conf_logits=z, accepted=accepted, valid=np.ones((M, G), bool),
                        sources=np.array(["gsm8k"] * M))
    return path


def test_holdout_fit_beats_raw_on_the_other_half(tmp_path):
    script = load_script("calibration_holdout.py")
    out = script.holdout(script.load_rounds(str(_rounds_file(tmp_path))))
    assert out["rounds"] == 4000
    for key in ("fit_first_score_second", "fit_second_score_first"):
        e = out[key]
        assert e["temperature_bias"] < 0.5 * e["raw"], e       # a constant logit shift: the bias recovers it
        assert e["temperature_only"] < e["raw"], e


def test_holdout_cli_prints_one_line_per_file(tmp_path, capsys, monkeypatch):
    path = _rounds_file(tmp_path, M=600)
    monkeypatch.setattr("sys.argv", ["calibration_holdout.py", str(path), str(path)])
    load_script("calibration_holdout.py").main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["rounds_file"] for line in lines] == [str(path)] * 2
