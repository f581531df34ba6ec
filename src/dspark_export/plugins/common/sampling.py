"""The numpy warping and sampling both ``dspark`` ops use, and the per-batch sampling arrays they take.

Warping (docs/ARCHITECTURE.md, "The two ops"), identical for draft and target distributions:
temperature 0 → greedy (a one-hot at the argmax, first index on ties). Otherwise l/T → top-k (keep
values ≥ the k-th largest; 0 = off) → softmax → top-p (stable descending sort, keep tokens whose
exclusive cumulative probability is < top_p, top-1 always kept; 1 = off) → renormalise.
Sampling with a uniform u: the first index i with cumsum(p)_i > u · Σp.

Everything runs in float32 (softmax after subtracting the row max) so that the ONNX functions in
``onnx_sampling.py`` make the same choices. Source: DeepSpec ``utils/sampling.py``
(deepspec_reference.md §2.1), with the bf16 softmax quirk of §5.2.8 replaced by float32.
Dimension letters: R requests, γ draft block size, V vocab; ``...`` is any leading shape.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dspark_export.errors import PluginError


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """The sampling parameters of a batch of R requests, as the ops take them: one value per request.
    (A single request's settings are ``runtime.request.SamplingParams``; the runtime stacks them into this.)

    Attributes:
        temperature: [R] float32, 0 = greedy.
        top_k: [R] int64, 0 = off.
        top_p: [R] float32, 1 = off.
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray

    def expand(self, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(temperature, top_k, top_p), each repeated to [R, width] (read-only views)."""
        return tuple(np.broadcast_to(x[:, None], (x.shape[0], width)) for x in self.as_tuple())

    def as_tuple(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.temperature, self.top_k, self.top_p


def check_sampling_values(op: str, params: SamplingBatch, uniforms: np.ndarray) -> None:
    """Raise PluginError unless temperature ≥ 0, top_k ≥ 0, 0 ≤ top_p ≤ 1 and 0 ≤ uniforms < 1 (all finite).

    Args:
        op: the op's qualified name, for the message.
        params: shapes already checked against the op schema.
        uniforms: [R, ...] float32.
    """
    checks = (
        ("temperature", params.temperature, np.isfinite(params.temperature) & (params.temperature >= 0), "finite and >= 0"),
        ("top_k", params.top_k, params.top_k >= 0, ">= 0"),
        ("top_p", params.top_p, (params.top_p >= 0) & (params.top_p <= 1), "in [0, 1]"),
        ("uniforms", uniforms, (uniforms >= 0) & (uniforms < 1), "in [0, 1)"),
    )
    for name, values, is_ok, expected in checks:
        if not np.all(is_ok):
            bad = values[~is_ok]
            raise PluginError(f"{op} input {name!r}: every value must be {expected}, found {bad[:4].tolist()}")


def warp_probs(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """The sampling distribution of each row of ``logits`` (see the module docstring).

    Args:
        logits: [..., V] float32.
        temperature: [...] float32, 0 = greedy.
        top_k: [...] int64, 0 = off.
        top_p: [...] float32, 1 = off.

    Returns:
        probs: [..., V] float32, each row sums to 1; greedy rows are one-hot at the first argmax.
    """
    is_greedy = temperature == 0
    safe_temperature = np.where(is_greedy, np.float32(1), temperature).astype(np.float32)
    scaled = logits / safe_temperature[..., None]
    probs = _apply_top_p(_softmax(_apply_top_k(scaled, top_k)), top_p)
    one_hot = _one_hot(np.argmax(logits, axis=-1), logits.shape[-1])
    return np.where(is_greedy[..., None], one_hot, probs)


def sample_from_probs(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """The first index i with cumsum(p)_i > u · Σp, for each row.

    Σp is the last cumulative sum (not a separately rounded sum), so any u < 1 lands inside the
    row; should rounding still leave no index, the last token with p > 0 is taken.

    Args:
        probs: [..., V] float32, non-negative, each row with some p > 0.
        uniforms: [...] float32 in [0, 1).

    Returns:
        ids: [...] int64; never an index with p = 0.
    """
    cumulative = np.cumsum(probs, axis=-1, dtype=np.float32)
    threshold = uniforms[..., None] * cumulative[..., -1:]
    count = np.sum(cumulative <= threshold, axis=-1)
    last_nonzero = probs.shape[-1] - 1 - np.argmax((probs > 0)[..., ::-1], axis=-1)
    return np.minimum(count, last_nonzero).astype(np.int64)


def _softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in float32; -inf entries get probability 0."""
    shifted = x - np.max(x, axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / np.sum(exp, axis=-1, keepdims=True)


def _apply_top_k(scaled: np.ndarray, top_k: np.ndarray) -> np.ndarray:
    """Set to -inf every value below the k-th largest of its row (ties at the k-th value are kept)."""
    if not np.any(top_k > 0):
        return scaled
    vocab = scaled.shape[-1]
    descending = -np.sort(-scaled, axis=-1)
    kth_index = np.clip(top_k, 1, vocab) - 1
    kth = np.take_along_axis(descending, kth_index[..., None], axis=-1)
    keep = (scaled >= kth) | (top_k <= 0)[..., None]
    return np.where(keep, scaled, np.float32(-np.inf))


def _apply_top_p(probs: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Keep the shortest stable-descending prefix whose exclusive cumulative prob is < top_p; renormalise."""
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    # Exclusive cumsum as a shifted sequential float32 cumsum: the same additions ONNX CumSum does.
    inclusive = np.cumsum(sorted_probs, axis=-1, dtype=np.float32)
    exclusive = np.concatenate([np.zeros_like(inclusive[..., :1]), inclusive[..., :-1]], axis=-1)
    keep_sorted = (exclusive < top_p[..., None]) | (top_p >= 1)[..., None]
    keep_sorted[..., 0] = True
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    kept = np.where(keep, probs, np.float32(0))
    return kept / np.sum(kept, axis=-1, keepdims=True)


def _one_hot(ids: np.ndarray, vocab: int) -> np.ndarray:
    return (ids[..., None] == np.arange(vocab)).astype(np.float32)
