"""Verification-length policies: how many draft tokens each request verifies this step.

Pure functions of the step's confidences (and, for later policies, the throughput profile).

- `ar`: no drafting; every request verifies 0 drafts (plain autoregressive decoding).
- `fixed:K`: every request verifies min(K, γ) drafts (K = 1 is the paper's MTP-1-like baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import RequestError

__all__ = ["Policy", "parse_policy"]


@dataclass(frozen=True)
class Policy:
    """A parsed policy. `name` is "ar" or "fixed"; `k` the fixed length."""

    name: str
    k: int = 0

    @property
    def drafts(self) -> bool:
        """Whether the policy uses the drafter at all."""
        return self.name != "ar" and self.k > 0

    def verify_lengths(self, confidence: np.ndarray | None, block_size: int) -> np.ndarray:
        """Draft tokens to verify per request.

        Args:
            confidence: [R, γ] float32 calibrated conditional confidences (unused by ar/fixed).
            block_size: γ.
        Returns:
            [R] int64 in 0..γ.
        """
        num = 0 if confidence is None else confidence.shape[0]
        k = 0 if self.name == "ar" else min(self.k, block_size)
        return np.full(num, k, np.int64)

    def __str__(self) -> str:
        return "ar" if self.name == "ar" else f"fixed:{self.k}"


def parse_policy(text: str) -> Policy:
    """Parse "ar" or "fixed:K" (K ≥ 1). Raises RequestError naming the accepted forms."""
    text = str(text).strip()
    if text == "ar":
        return Policy("ar")
    if text.startswith("fixed:"):
        try:
            k = int(text.split(":", 1)[1])
        except ValueError:
            k = -1
        if k >= 1:
            return Policy("fixed", k)
    raise RequestError(f"policy: expected 'ar' or 'fixed:K' with an integer K >= 1, found {text!r}")
