"""Fault isolation of the speculative step (docs/ARCHITECTURE.md, "Faults").

A step computes everything (every engine call) before it commits anything, so a failed step leaves caches
and requests as they were. `run_isolated` wraps the step: if an engine call raises, the step is undone
(the requests' random streams included) and each of its requests is retried once in a step of its own; a
request whose own step raises again finishes with finish_reason "error" and the engine's message, the
others go on. The `check_*` functions find non-finite engine outputs (NaN/Inf logits, features, K/V,
draft logits or confidences) and out-of-range token ids; the stages that call the engines use them to fail
only the requests whose rows hold them. Dimension letters: S slots, γ draft block size, V vocab, n rows.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

import numpy as np

from ..errors import EngineRunError
from .batch import RequestState

log = logging.getLogger(__name__)

__all__ = ["run_isolated", "check_drafts", "check_target", "check_verify", "check_rows"]

Round = TypeVar("Round")


def run_isolated(active: list[RequestState], compute: Callable[[list[RequestState]], Round],
                 apply: Callable[[Round], None], fail: Callable[[RequestState, str], None]) -> None:
    """`apply(compute(active))`; on EngineRunError, each request of `active` alone, and `fail` the ones
    whose own step raises again (one request alone: failed at once)."""
    try:
        rnd = _attempt(compute, active)
    except EngineRunError as e:
        if len(active) == 1:
            fail(active[0], str(e))
            return
        log.warning("%s; retrying the step's %d requests one at a time", e, len(active))
        for s in active:
            try:
                rnd = _attempt(compute, [s])
            except EngineRunError as e1:
                fail(s, str(e1))
            else:
                apply(rnd)
        return
    apply(rnd)


def _attempt(compute: Callable[[list[RequestState]], Round], active: list[RequestState]) -> Round:
    """`compute(active)`, restoring the requests' random streams if it raises (nothing else has changed)."""
    streams = [(s, s.rng.bit_generator.state) for s in active]
    try:
        return compute(active)
    except EngineRunError:
        for s, state in streams:
            s.rng.bit_generator.state = state
        raise


def check_drafts(drafts: dict, decoding: list[RequestState], vocab_size: int, engine: str) -> dict[int, str]:
    """Slots whose drafter outputs ({"draft_ids" [S, γ], "draft_logits" [S, γ, Vd], "confidence" [S, γ]}) are
    non-finite or out of range → reason."""
    slots = np.array([s.slot for s in decoding], np.int64)
    logits = drafts["draft_logits"]
    ok = np.array([np.isfinite(logits[slot].sum()) for slot in slots], bool)   # no copy of [R, γ, V]
    conf = drafts["confidence"][slots]
    ok &= np.isfinite(conf).all(axis=1) & (conf >= 0).all(axis=1) & (conf <= 1).all(axis=1)
    ids = drafts["draft_ids"][slots]
    ok &= ((ids >= 0) & (ids < vocab_size)).all(axis=1)
    return {int(slot): f"engine {engine} returned non-finite or out-of-range drafts (draft_logits, confidence "
                       f"or draft_ids) for this request" for slot in slots[~ok]}


def check_target(packed, out: dict, kv: np.ndarray, segments: list, engine: str) -> dict[int, str]:
    """Slots whose target rows (logits, aux_hidden, new K/V) hold NaN/Inf → reason. A row is finite iff its
    sum is (a NaN or ±Inf term makes the sum non-finite); a row's features and every layer's K/V (`kv`
    [2L, n, kvH, D], the pass's K/V outputs as `EngineStages.target_pass` stacks them) are summed together: a
    few numpy calls per pass, not one per output, since this check runs on every step. `engine` names the
    pass where `packed` has none."""
    row_ok = np.isfinite(out["aux_hidden"].sum(axis=1) + kv.sum(axis=(0, 2, 3)))
    logit_ok = np.isfinite(out["logits"].sum(axis=1))
    failed = {}
    for seg in segments:
        a, q = packed.row_start[seg.slot], len(seg.token_ids)
        m = q if seg.logits == "all" else int(seg.logits == "last")
        la = packed.logit_start.get(seg.slot, 0)
        if not (row_ok[a:a + q].all() and logit_ok[la:la + m].all()):
            failed[seg.slot] = (f"engine {packed.engines.get(seg.slot) or engine} returned non-finite "
                                f"outputs (logits, aux_hidden or K/V) for this request's rows at positions "
                                f"{seg.start_position}..{seg.start_position + q - 1}")
    return failed


def check_verify(num_accepted: np.ndarray, next_ids: np.ndarray, verify_lens: np.ndarray,
                 states: list[RequestState], vocab_size: int, engine: str) -> dict[int, str]:
    """Slots whose verify outputs are out of range (accepted > ℓ, or a next id outside the vocab) → reason."""
    failed = {}
    for s in states:
        a, t = int(num_accepted[s.slot]), int(next_ids[s.slot])
        if not (0 <= a <= verify_lens[s.slot] and 0 <= t < vocab_size):
            failed[s.slot] = (f"engine {engine} returned out-of-range values for this request (num_accepted {a} "
                              f"of {verify_lens[s.slot]} drafts, next id {t}, vocab {vocab_size})")
    return failed


def check_rows(slots: np.ndarray, arrays: list[np.ndarray], engine: str) -> dict[int, str]:
    """Slots any of whose rows (`slots` [n], each array [n, ...]) holds NaN/Inf → reason (drafter context)."""
    n = len(slots)
    ok = np.ones(n, bool)
    for x in arrays:
        ok &= np.isfinite(x.reshape(n, -1).sum(axis=1))
    return {int(slot): f"engine {engine} returned non-finite drafter context rows for this request"
            for slot in np.unique(slots[~ok])}
