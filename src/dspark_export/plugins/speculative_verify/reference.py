"""Numpy reference of ``dspark::SpeculativeVerify``: the spec the ONNX function is held to.

Speculative sampling, Leviathan et al. 2023 (arXiv 2211.17192, Algorithm 1); DSpark paper §2;
DeepSpec ``verify_draft_tokens`` (deepspec_reference.md §2.5), batched over ragged requests.
Pure: no globals, no RNG (the uniforms are inputs), inputs never modified. Greedy is the
temperature-0 case of the same code: with one-hot p and q, u·q(x) < p(x) holds iff x == argmax p
(u < 1), and the residual or bonus sample is argmax p.
Dimension letters: R requests, γ draft slots, V vocab, M target logit rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from dspark_export.errors import PluginError
from dspark_export.plugins.common.sampling import SamplingBatch, check_sampling_values, sample_from_probs, warp_probs
from dspark_export.plugins.speculative_verify.schema import SCHEMA


class VerifyOutputs(NamedTuple):
    """num_accepted: [R] int64, the leading accepted run; next_ids: [R] int64, recovered or bonus token."""

    num_accepted: np.ndarray
    next_ids: np.ndarray


def speculative_verify(
    target_logits: np.ndarray,
    query_start: np.ndarray,
    draft_ids: np.ndarray,
    draft_logits: np.ndarray,
    verify_lens: np.ndarray,
    sampling: SamplingBatch,
    uniforms: np.ndarray,
) -> VerifyOutputs:
    """Accept the leading drafts the target agrees with, then emit one recovered or bonus token.

    Args:
        target_logits: [M, V] float32; request r owns rows query_start[r] .. query_start[r]+verify_lens[r].
        query_start: [R+1] int64, with query_start[r+1] - query_start[r] == verify_lens[r] + 1.
        draft_ids: [R, γ] int64; entries at j ≥ verify_lens[r] are ignored (any placeholder, e.g. -1).
        draft_logits: [R, γ, V] float32, the logits each draft was drawn from (before warping).
        verify_lens: [R] int64 in [0, γ].
        sampling: temperature/top_k/top_p, each [R], applied to target and draft rows alike.
        uniforms: [R, γ+1] float32 in [0, 1): u[:, j] tests draft j, u[:, γ] draws the next token.

    Returns:
        ``VerifyOutputs`` (num_accepted, next_ids).

    Raises:
        PluginError: an input breaks the schema (shapes, dtypes, query_start vs verify_lens, value ranges).
    """
    check_arguments(target_logits, query_start, draft_ids, draft_logits, verify_lens, sampling, uniforms)
    num_requests, gamma = draft_ids.shape
    starts = query_start[:-1]
    # Rows past a request's verify width repeat its last row; they are never used.
    rows = np.minimum(starts[:, None] + np.arange(gamma + 1), (starts + verify_lens)[:, None])
    target_probs = warp_probs(target_logits[rows], *sampling.expand(gamma + 1))  # [R, γ+1, V]
    draft_probs = warp_probs(draft_logits, *sampling.expand(gamma))  # [R, γ, V]
    is_verified = np.arange(gamma) < verify_lens[:, None]  # [R, γ]
    ids = np.where(is_verified, draft_ids, 0)[..., None]  # unverified slots may hold any placeholder
    target_at_draft = np.take_along_axis(target_probs[:, :gamma], ids, axis=-1)[..., 0]
    draft_at_draft = np.take_along_axis(draft_probs, ids, axis=-1)[..., 0]
    is_accepted = (uniforms[:, :gamma] * draft_at_draft < target_at_draft) & is_verified
    num_accepted = np.cumprod(is_accepted, axis=1).sum(axis=1).astype(np.int64)
    batch = np.arange(num_requests)
    target_next = target_probs[batch, num_accepted]  # [R, V]
    draft_next = draft_probs[batch, np.minimum(num_accepted, gamma - 1)]  # [R, V]
    next_probs = _next_token_probs(target_next, draft_next, num_accepted < verify_lens)
    return VerifyOutputs(num_accepted, sample_from_probs(next_probs, uniforms[:, gamma]))


def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``speculative_verify`` over a feed keyed by the schema's input names.

    Returns:
        {"num_accepted": [R] int64, "next_ids": [R] int64}.
    """
    SCHEMA.check_inputs(feeds)
    sampling = SamplingBatch(feeds["temperature"], feeds["top_k"], feeds["top_p"])
    outputs = speculative_verify(
        feeds["target_logits"], feeds["query_start"], feeds["draft_ids"], feeds["draft_logits"],
        feeds["verify_lens"], sampling, feeds["uniforms"],
    )
    return outputs._asdict()


def _next_token_probs(target_probs: np.ndarray, draft_probs: np.ndarray, is_rejected: np.ndarray) -> np.ndarray:
    """Residual max(p − q, 0) for rejected requests (p if the residual is all zero), else p (bonus).

    Args:
        target_probs: [R, V] float32, p at the first unaccepted position a.
        draft_probs: [R, V] float32, q at a (meaningless where a == verify_lens, where it is unused).
        is_rejected: [R] bool, a < verify_lens.

    Returns:
        [R, V] float32, unnormalised (``sample_from_probs`` scales by the row sum).
    """
    residual = np.maximum(target_probs - draft_probs, np.float32(0))
    use_residual = is_rejected & (np.sum(residual, axis=-1) > 0)
    return np.where(use_residual[:, None], residual, target_probs)


def check_arguments(target_logits, query_start, draft_ids, draft_logits, verify_lens, sampling, uniforms) -> None:
    """Schema shapes and dtypes, then value ranges and the query_start / verify_lens agreement."""
    feeds = dict(target_logits=target_logits, query_start=query_start, draft_ids=draft_ids, draft_logits=draft_logits,
                 verify_lens=verify_lens, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                 uniforms=uniforms)
    dims = SCHEMA.check_inputs(feeds)
    name = SCHEMA.qualified_name
    if dims["γ"] < 1:
        raise PluginError(f"{name} input 'draft_ids': expected γ >= 1 draft slots, found shape {draft_ids.shape}")
    check_sampling_values(name, sampling, uniforms)
    if np.any((verify_lens < 0) | (verify_lens > dims["γ"])):
        raise PluginError(f"{name} input 'verify_lens': expected values in [0, γ={dims['γ']}], found {verify_lens.tolist()}")
    widths = np.diff(query_start)
    if np.any(widths != verify_lens + 1):
        raise PluginError(f"{name} input 'query_start': expected query_start[r+1] - query_start[r] == verify_lens[r] + 1 "
                          f"= {(verify_lens + 1).tolist()}, found widths {widths.tolist()}")
    if query_start[0] < 0 or query_start[-1] > dims["M"]:
        raise PluginError(f"{name} input 'query_start': expected rows within target_logits [0, M={dims['M']}], "
                          f"found {query_start.tolist()}")
    is_bad = (np.arange(dims["γ"]) < verify_lens[:, None]) & ((draft_ids < 0) | (draft_ids >= dims["V"]))
    if np.any(is_bad):
        raise PluginError(f"{name} input 'draft_ids': expected verified ids in [0, V={dims['V']}), "
                          f"found {draft_ids[is_bad][:4].tolist()}")
