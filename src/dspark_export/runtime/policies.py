"""Verification-length policies: how many draft tokens each request verifies this step.

Pure functions of the step's calibrated confidences c [R, γ] (conditional per-position acceptance
probabilities, see `runtime/scheduler.py`) and, for `dspark*`, the throughput profile SPS(B).
Each returns verify lengths ℓ [R] int64 in 0..γ.

- `ar`: ℓ_r = 0 (plain autoregressive decoding; the drafter does not run).
- `fixed:K`: ℓ_r = min(K, γ) (K = 1 is the paper's MTP-1-like baseline).
- `threshold:C`: ℓ_r = the first j with c[r, j] < C, else γ (per-step test, as DeepSpec's eval).
- `dspark`: paper Algorithm 1, throughput-maximising greedy admission with early stop.
- `dspark-async`: paper §5.2, capacity K from the confidences of two steps earlier, no early stop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..engines.sps import ThroughputProfile
from ..errors import ConfigError, RequestError
from .draft_control import DraftController, SkipController
from . import DEFAULT_POLICY
from .scheduler import dspark_async_lengths, dspark_lengths

__all__ = ["Policy", "parse_policy", "ar_lengths", "fixed_lengths", "threshold_lengths",
           "dspark_lengths", "dspark_async_lengths", "DEFAULT_POLICY"]

_FORMS = "'ar', 'fixed:K' (integer K >= 1), 'threshold:C' (0 < C <= 1), 'dspark' or 'dspark-async'"


def ar_lengths(confidence: np.ndarray) -> np.ndarray:
    """ℓ_r = 0. Example: any c of shape [2, 4] → [0, 0]. Returns [R] int64."""
    return np.zeros(confidence.shape[0], np.int64)


def fixed_lengths(confidence: np.ndarray, k: int) -> np.ndarray:
    """ℓ_r = min(K, γ). Example: K = 7, c of shape [2, 4] (γ = 4) → [4, 4]. Returns [R] int64."""
    return np.full(confidence.shape[0], min(k, confidence.shape[1]), np.int64)


def threshold_lengths(confidence: np.ndarray, threshold: float) -> np.ndarray:
    """ℓ_r = the 0-based index of the first position with c[r, j] < C, else γ (the leading run with c ≥ C).

    Per-step conditional test (DeepSpec `build_dspark_proposal`), not a test of the survival Π c.
    Example: C = 0.5, c = [[0.9, 0.6, 0.4, 0.9], [0.3, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5]]
    → ℓ = [2, 0, 4] (0.4 < 0.5 stops row 0 at j = 3; row 2 never drops below C).

    Args:
        confidence: [R, γ] float32 conditional confidences.
        threshold: C in (0, 1].
    Returns:
        [R] int64 in 0..γ.
    """
    below = np.asarray(confidence) < threshold
    return np.where(below.any(axis=1), below.argmax(axis=1), confidence.shape[1]).astype(np.int64)


@dataclass(frozen=True)
class Policy:
    """A parsed policy.

    Args:
        name: "ar", "fixed", "threshold", "dspark" or "dspark-async".
        k: the fixed length K (fixed only).
        threshold: the confidence threshold C (threshold only).
    """

    name: str
    k: int = 0
    threshold: float = 0.0

    @property
    def drafts(self) -> bool:
        """Whether the policy uses the drafter at all."""
        return self.name != "ar" and (self.name != "fixed" or self.k > 0)

    @property
    def needs_profile(self) -> bool:
        """Whether verify_lengths needs the throughput profile SPS(B)."""
        return self.name in ("dspark", "dspark-async")

    def draft_controller(self, profile: ThroughputProfile | None, block_size: int) -> DraftController:
        """What decides, step by step, whether the drafter runs (`runtime.draft_control`): dspark-async with
        a drafter cost in its profile skips the drafter block when drafting does not pay by its margin; dspark
        with one only where not even drafts that all survive would beat not drafting (margin 0, priced at
        SPS(B) as its Algorithm 1 prices); fixed and threshold draft every step."""
        priced = profile is not None and profile.has_draft_cost
        if self.name == "dspark-async" and priced:
            return SkipController(profile, block_size)
        if self.name == "dspark" and priced:
            return DraftController(True, profile, block_size)
        return DraftController(self.drafts)

    def verify_lengths(self, confidence: np.ndarray | None, block_size: int,
                       profile: ThroughputProfile | None = None, lagged_confidence: np.ndarray | None = None,
                       max_lengths: np.ndarray | None = None) -> np.ndarray:
        """Draft tokens to verify per request.

        Args:
            confidence: [R, γ] float32 calibrated conditional confidences, one row per request in the
                step (active requests only: for dspark every row adds one anchor token to B). May be
                None for ar/fixed (then R = 0).
            block_size: γ.
            profile: SPS(B); required by dspark and dspark-async.
            lagged_confidence: [R', γ] float32 confidences from two steps earlier (dspark-async only);
                None on the first steps (dspark-async then runs Algorithm 1 on `confidence`).
            max_lengths: [R] int, optional cap on ℓ_r (cache room, tokens left), known before drafting.
        Returns:
            [R] int64 in 0..γ.
        Raises:
            ConfigError: dspark/dspark-async without a profile.
            ValueError: confidence missing, of the wrong shape, or outside [0, 1].
        """
        if confidence is None:
            if self.name in ("ar", "fixed"):
                return np.zeros(0, np.int64)
            raise ValueError(f"policy {self}: confidence is required, found None")
        confidence = np.asarray(confidence)
        if confidence.ndim != 2 or confidence.shape[1] != block_size:
            raise ValueError(f"policy {self}: expected confidence [R, γ={block_size}], found shape {confidence.shape}")
        if self.needs_profile and profile is None:
            raise ConfigError(f"policy {self} needs the throughput profile SPS(B) (profile/sps.json), found None; "
                              f"use 'fixed:K' or 'threshold:C' for engines without a profile")
        if self.name == "dspark":
            return dspark_lengths(confidence, profile, max_lengths)
        if self.name == "dspark-async":
            return dspark_async_lengths(confidence, lagged_confidence, profile, max_lengths)
        if self.name == "threshold":
            lengths = threshold_lengths(confidence, self.threshold)
        else:
            lengths = fixed_lengths(confidence, self.k) if self.name == "fixed" else ar_lengths(confidence)
        return lengths if max_lengths is None else np.minimum(lengths, np.asarray(max_lengths, np.int64))

    def __str__(self) -> str:
        if self.name == "fixed":
            return f"fixed:{self.k}"
        return f"threshold:{self.threshold!r}" if self.name == "threshold" else self.name


def parse_policy(text: str) -> Policy:
    """Parse "ar", "fixed:K" (K ≥ 1), "threshold:C" (0 < C ≤ 1), "dspark" or "dspark-async".

    Raises:
        RequestError: anything else, naming the accepted forms.
    """
    text = str(text).strip()
    if text in ("ar", "dspark", "dspark-async"):
        return Policy(text)
    name, _, arg = text.partition(":")
    if name == "fixed":
        try:
            k = int(arg)
        except ValueError:
            k = -1
        if k >= 1:
            return Policy("fixed", k)
        raise RequestError(f"policy: 'fixed:K' needs an integer K >= 1, found {text!r}; accepted: {_FORMS}")
    if name == "threshold":
        try:
            c = float(arg)
        except ValueError:
            c = math.nan
        if 0.0 < c <= 1.0:
            return Policy("threshold", threshold=c)
        raise RequestError(f"policy: 'threshold:C' needs a number C in (0, 1], found {text!r}; accepted: {_FORMS}")
    raise RequestError(f"policy: expected one of {_FORMS}, found {text!r}")
