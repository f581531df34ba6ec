"""Offline drafting rounds, Sequential Temperature Scaling (paper §3.2.1) and reliability reports.

Rounds are replayed offline on cached target sequences whose responses were generated greedily by
the target: for an anchor p the drafter drafts γ tokens exactly as at inference (parallel block,
then the Markov chain fed with its own argmax drafts), and draft k is accepted when drafts 0..k all
equal the target's greedy continuation ``tokens[p+1..p+k+1]``. That is the T = 0 verification
outcome, so the offline τ here is the τ of the offline protocol at temperature 0 (on the cached
contexts).

STS: the confidence head gives conditional logits z_k (σ(z_k) ≈ P(draft k accepted | drafts < k
accepted)); the scheduler uses the survival ``a_k = Π_{i≤k} σ(z_i / T_i + b_k)``. Temperatures (and
biases) are fitted left to right: (T_k, b_k) minimises the ECE (20 equal-width bins) of a_k against
the observed survival ``y_k = Π_{i≤k} accepted_i`` with positions 0..k-1 already fixed. Dividing a
logit by T > 0 and adding b keeps the order of the confidences at each position.

The bias b_k is this project's addition to the paper's STS (§3.2.1 fits T_k only; b = 0 gives it
back exactly). Serving engines with DSpark support (SGLang, TensorRT-LLM) compute σ(z_k / T_k) only, so
`fit_calibration` also fits the paper's temperature-only STS on the same rounds, with its own ECE, and stores
it under ``temperature_only``: that is the fit `export-profile` writes for them. A temperature cannot move the mean confidence, and the shipped SmolLM2 drafter's head is
biased (its calibrated first-position survival overrates acceptance); a bias per position halved the mean
ECE on the same rounds (reports/measurement_history.md, "STS bias"). The
head is trained on the analytic acceptance 1 − ½‖p − q‖₁, the rounds count greedy matches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..modeling.drafter import DSparkDrafter
from .features import FeatureCache
from ..modeling.loading import TEMPERATURE_ONLY_FIELDS, temperature_only  # noqa: F401 (re-exported)
from .objective import TrainBatch, block_forward

__all__ = ["Rounds", "replay_rounds", "expected_calibration_error", "fit_sts", "fit_calibration", "survival",
           "reliability_diagram", "reliability_bins", "temperature_only", "DEFAULT_GRID", "DEFAULT_BIAS_GRID", "CALIBRATION_FILE"]

#: Written next to a drafter checkpoint; `dspark-export build` copies the temperatures into the manifest.
CALIBRATION_FILE = "calibration.json"
DEFAULT_GRID = np.round(np.exp(np.linspace(np.log(0.1), np.log(20.0), 161)), 4)
#: candidate biases b_k (logit units); (0.0,) fits the paper's temperature-only STS
DEFAULT_BIAS_GRID = np.round(np.arange(-3.0, 3.0001, 0.1), 2)


@dataclass
class Rounds:
    """Replayed rounds: conf_logits [M, γ] float32 (zeros without a confidence head); accepted [M, γ]
    bool (draft k equals the target's token); valid [M, γ] bool (the target's token exists);
    sources: dataset name per round."""

    conf_logits: np.ndarray
    accepted: np.ndarray
    valid: np.ndarray
    sources: list

    @property
    def survived(self) -> np.ndarray:
        """[M, γ] bool: drafts 0..k all accepted."""
        return np.cumprod(self.accepted & self.valid, axis=1).astype(bool)

    def acceptance_length(self) -> float:
        """τ = 1 + mean accepted prefix (bonus token included), over rounds with a full block of labels."""
        full = self.valid.all(axis=1)
        return float(1 + self.survived[full].sum(axis=1).mean()) if full.any() else float("nan")

    def conditional_acceptance(self) -> list:
        """P(draft k accepted | drafts < k accepted), k = 0..γ-1 (paper Fig. 2)."""
        s = self.survived
        reached = np.concatenate([np.ones((len(s), 1), bool), s[:, :-1]], axis=1) & self.valid
        return [float((s[:, k] & reached[:, k]).sum() / max(1, reached[:, k].sum())) for k in range(s.shape[1])]


@torch.no_grad()
def replay_rounds(drafter: DSparkDrafter, cache: FeatureCache, *, greedy_only: bool = True, stride: int = 1,
                  max_len: int = 768, chunk: int = 96, d2t=None, limit: int | None = None) -> Rounds:
    """Replay a drafting round at every `stride`-th assistant position of every cached sequence.

    Args:
        greedy_only: use only sequences whose response was generated at temperature 0 (only there is
            the cached continuation the target's verification outcome).
        d2t: a draft vocabulary [N] (`exporter.drafter.draft_vocab_head`): drafts are argmaxes over these
            tokens only, as the exported block drafts; None = the full vocabulary.
        limit: replay the first `limit` sequences of the cache only (None = all).
    """
    G = drafter.config.block_size
    outside = None
    if d2t is not None:
        outside = torch.full((drafter.config.vocab_size,), float("-inf"))
        outside[torch.as_tensor(np.asarray(d2t), dtype=torch.long)] = 0.0
    confs, accs, valids, sources = [], [], [], []
    for i in range(len(cache) if limit is None else min(limit, len(cache))):
        s = cache[i]
        if greedy_only and (s.source.get("temperature") or 0) != 0:
            continue
        T = min(len(s.tokens), max_len)
        positions = np.arange(s.prompt_len, T - 1, stride)
        for a in range(0, len(positions), chunk):
            anchors = positions[a:a + chunk]
            n = len(anchors)
            idx = anchors[:, None] + 1 + np.arange(G)
            ok = idx < T
            labels = np.where(ok, s.tokens[np.minimum(idx, T - 1)], 0)
            batch = TrainBatch(torch.from_numpy(s.tokens[None, :T]), torch.from_numpy(s.aux[None, :T]),
                               torch.from_numpy(s.last[None, :T]), torch.tensor([T]), torch.from_numpy(anchors[None]),
                               torch.ones(1, n, dtype=torch.bool), torch.from_numpy(labels[None]),
                               torch.from_numpy(ok[None]))
            hidden, U = block_forward(drafter, batch)
            hidden, U = hidden[0], U[0]  # [n, γ, H], [n, γ, V]
            prev = torch.from_numpy(s.tokens[anchors])
            drafts = torch.zeros(n, G, dtype=torch.long)
            z = torch.zeros(n, G)
            for k in range(G):
                logits = U[:, k] + (drafter.markov_bias(prev) if drafter.markov_head is not None else 0)
                if outside is not None:
                    logits = logits + outside
                if drafter.confidence_head is not None:
                    z[:, k] = drafter.confidence_logits(hidden[:, k:k + 1], prev[:, None])[:, 0]
                prev = logits.argmax(-1)
                drafts[:, k] = prev
            confs.append(z.numpy())
            accs.append((drafts.numpy() == labels) & ok)
            valids.append(ok)
            sources += [s.source.get("dataset")] * n
    if not confs:
        raise ValueError("replay_rounds: no usable sequence in the cache (greedy_only and no temperature-0 record?)")
    return Rounds(np.concatenate(confs), np.concatenate(accs), np.concatenate(valids), sources)


def expected_calibration_error(pred: np.ndarray, target: np.ndarray, bins: int = 20) -> float:
    """ECE with `bins` equal-width bins on [0, 1]: Σ_b (n_b / n)·|mean(pred_b) − mean(target_b)|."""
    pred, target = np.asarray(pred, np.float64), np.asarray(target, np.float64)
    if pred.size == 0:
        return float("nan")
    which = np.minimum((pred * bins).astype(np.int64), bins - 1)
    n = np.bincount(which, minlength=bins)
    sp = np.bincount(which, weights=pred, minlength=bins)
    st = np.bincount(which, weights=target, minlength=bins)
    used = n > 0
    return float(np.sum(np.abs(sp[used] - st[used])) / pred.size)


def survival(conf_logits: np.ndarray, temperatures, biases=None) -> np.ndarray:
    """a_k = Π_{i≤k} σ(z_i / T_i + b_i): [M, γ] logits, [γ] temperatures, [γ] biases (None = 0) → [M, γ] float64."""
    z = np.asarray(conf_logits, np.float64) / np.asarray(temperatures, np.float64)
    if biases is not None:
        z = z + np.asarray(biases, np.float64)
    return np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=1)


def fit_sts(rounds: Rounds, grid=DEFAULT_GRID, bins: int = 20, bias_grid=DEFAULT_BIAS_GRID) -> dict:
    """Fit one temperature and one bias per position, left to right, by grid search (module docstring).

    Args:
        rounds: replayed rounds.
        grid: candidate temperatures.
        bins: ECE bins.
        bias_grid: candidate biases; (0.0,) = the paper's STS (temperatures only).
    Returns:
        {"confidence_temperature": [γ], "confidence_bias": [γ], "ece_before": [γ], "ece_after": [γ],
         "mean_ece_before", "mean_ece_after", "rounds": M, "bins": bins}.
    """
    z, y, valid = rounds.conf_logits.astype(np.float64), rounds.survived, rounds.valid
    G = z.shape[1]
    temps, biases = np.ones(G), np.zeros(G)
    before = survival(z, temps)
    prefix = np.ones(len(z))
    ece_before, ece_after = [], []
    for k in range(G):
        rows = valid[:, k]
        ece_before.append(expected_calibration_error(before[rows, k], y[rows, k], bins))
        best = (np.inf, 1.0, 0.0)
        for t in grid:
            zt = z[rows, k] / t
            for b in bias_grid:     # ties go to the smaller |b| (b = 0 when it is as good)
                a = prefix[rows] / (1.0 + np.exp(-(zt + b)))
                e = expected_calibration_error(a, y[rows, k], bins)
                if e < best[0] - 1e-12 or (abs(e - best[0]) <= 1e-12 and abs(b) < abs(best[2])):
                    best = (e, float(t), float(b))
        temps[k], biases[k] = best[1], best[2]
        prefix = prefix / (1.0 + np.exp(-(z[:, k] / temps[k] + biases[k])))
        ece_after.append(best[0])
    return {"confidence_temperature": [float(t) for t in temps], "confidence_bias": [float(b) for b in biases],
            "ece_before": [round(e, 5) for e in ece_before],
            "ece_after": [round(e, 5) for e in ece_after], "mean_ece_before": round(float(np.mean(ece_before)), 5),
            "mean_ece_after": round(float(np.mean(ece_after)), 5), "rounds": int(len(z)), "bins": bins}


def fit_calibration(rounds: Rounds, grid=DEFAULT_GRID, bins: int = 20, bias_grid=DEFAULT_BIAS_GRID) -> dict:
    """Both fits on the same rounds: temperature + bias per position (what this project's runtime applies)
    and the paper's temperature-only STS (what σ(z/T) consumers apply), each with its own ECE.

    Returns:
        `fit_sts(rounds, grid, bins, bias_grid)` plus ``"temperature_only"``: {confidence_temperature [γ],
        ece_before [γ], ece_after [γ], mean_ece_before, mean_ece_after, rounds, bins} of
        `fit_sts(rounds, grid, bins, bias_grid=(0.0,))`; ece_after there is the ECE of Π σ(z_i / T_i) itself.
    """
    fit = fit_sts(rounds, grid, bins, bias_grid)
    plain = fit_sts(rounds, grid, bins, (0.0,))
    fit["temperature_only"] = {k: plain[k] for k in TEMPERATURE_ONLY_FIELDS}
    return fit


def reliability_bins(rounds: Rounds, temperatures, bins: int = 20, biases=None) -> dict:
    """Per-position reliability table of the survival a_k, before (all T = 1) and after STS.

    For position k (1-based in the output) the valid rounds are put into `bins` equal-width bins of the
    predicted survival a_k; each non-empty bin gives its mean predicted survival, its observed survival
    (the fraction of its rounds whose drafts 1..k were all accepted) and its round count.

    Returns:
        {"bins": bins, "rounds": M, "positions": [{"position": k, "raw": {...}, "sts": {...}}]} where each of
        "raw" and "sts" is {"predicted": [...], "observed": [...], "count": [...], "ece": float} over the
        non-empty bins in ascending order (ECE with the same bins).
    """
    G = rounds.conf_logits.shape[1]
    y = rounds.survived
    curves = {"raw": survival(rounds.conf_logits, np.ones(G)), "sts": survival(rounds.conf_logits, temperatures, biases)}
    positions = []
    for k in range(G):
        rows = rounds.valid[:, k]
        entry = {"position": k + 1}
        for label, a_all in curves.items():
            a, t = a_all[rows, k], y[rows, k].astype(np.float64)
            which = np.minimum((a * bins).astype(np.int64), bins - 1)
            n = np.bincount(which, minlength=bins)
            sp = np.bincount(which, weights=a, minlength=bins)
            st = np.bincount(which, weights=t, minlength=bins)
            used = n > 0
            entry[label] = {"predicted": [round(float(x), 5) for x in sp[used] / n[used]],
                            "observed": [round(float(x), 5) for x in st[used] / n[used]],
                            "count": [int(x) for x in n[used]],
                            "ece": round(expected_calibration_error(a, t, bins), 5)}
        positions.append(entry)
    return {"bins": bins, "rounds": int(len(y)), "positions": positions}


def reliability_diagram(rounds: Rounds, temperatures, path: str | Path, bins: int = 20, biases=None) -> Path:
    """PNG: per position, observed survival vs predicted survival, before (T=1) and after STS
    (`reliability_bins` drawn by `figures.reliability_figure`)."""
    from ..figures import reliability_figure

    path = Path(path)
    path.write_bytes(reliability_figure(reliability_bins(rounds, temperatures, bins, biases)))
    return path


def write_calibration(folder: str | Path, fit: dict, extra: dict | None = None) -> Path:
    """Write `<folder>/calibration.json` ({"method": "sts", **fit, **extra})."""
    path = Path(folder) / CALIBRATION_FILE
    path.write_text(json.dumps({"method": "sts", **fit, **(extra or {})}, indent=1) + "\n", encoding="utf-8")
    return path
