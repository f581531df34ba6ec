"""Held-out ECE of a drafter's calibration: fit on one half of the replayed rounds, score on the other.

`train_drafter.py calibrate` reports the ECE on the rounds it was fitted on (in sample). This splits its
``rounds.npz`` in sequence order (first half / second half), fits Sequential Temperature Scaling on one half
(temperature + bias, and temperature only) and scores the mean ECE over positions on the other, both ways.

    python scripts/calibration_holdout.py /work/runs/smollm2/v4/calibration/rounds.npz [more.npz ...]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from dspark_export.training.calibration import Rounds, expected_calibration_error, fit_sts, survival


def load_rounds(path: str) -> Rounds:
    z = np.load(path)
    return Rounds(z["conf_logits"], z["accepted"], z["valid"], list(z["sources"]))


def take(r: Rounds, rows: slice) -> Rounds:
    return Rounds(r.conf_logits[rows], r.accepted[rows], r.valid[rows], r.sources[rows])


def mean_ece(r: Rounds, temperatures, biases=None, bins: int = 20) -> float:
    """Mean over positions k of the ECE of a_k = Π σ(z_i / T_i + b_i) against the observed survival."""
    a, y = survival(r.conf_logits, temperatures, biases), r.survived
    return float(np.mean([expected_calibration_error(a[r.valid[:, k], k], y[r.valid[:, k], k], bins)
                          for k in range(a.shape[1])]))


def holdout(r: Rounds) -> dict:
    half = len(r.conf_logits) // 2
    halves = {"first": take(r, slice(0, half)), "second": take(r, slice(half, None))}
    out, G = {"rounds": len(r.conf_logits)}, r.conf_logits.shape[1]
    for fit_on, score_on in (("first", "second"), ("second", "first")):
        both = fit_sts(halves[fit_on])
        plain = fit_sts(halves[fit_on], bias_grid=(0.0,))
        test = halves[score_on]
        out[f"fit_{fit_on}_score_{score_on}"] = {
            "raw": round(mean_ece(test, np.ones(G)), 5),
            "temperature_bias": round(mean_ece(test, both["confidence_temperature"], both["confidence_bias"]), 5),
            "temperature_only": round(mean_ece(test, plain["confidence_temperature"]), 5)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rounds", nargs="+", help="rounds.npz files written by train_drafter.py calibrate")
    for path in ap.parse_args().rounds:
        print(json.dumps({"rounds_file": path, **holdout(load_rounds(path))}))


if __name__ == "__main__":
    main()
