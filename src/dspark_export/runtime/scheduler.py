"""Hardware-aware prefix scheduler (DSpark paper §3.2.2 Algorithm 1, §5.2, Appendix A).

Pure functions of calibrated confidences and the throughput profile: no clocks, no state, no I/O.
Dimension letters: R requests in the step, γ draft block size, B verification tokens in the step
(one anchor/bonus row per request plus the admitted drafts), K admitted draft positions (B = R + K).

Quantities (positions j = 1..γ, column j-1 of the arrays):
    c[r, j]  calibrated conditional acceptance probability of draft j given drafts < j accepted;
    a[r, j]  = Π_{i ≤ j} c[r, i], the survival (probability that drafts 1..j are all accepted);
    τ        = Σ_r (1 + Σ_{j ≤ ℓ_r} a[r, j]), expected tokens committed by the step (bonus included);
    SPS(B)   target steps per second at B verification tokens (profile, staircase over buckets);
    Θ        = τ · SPS(B), expected tokens per second: tokens per step ÷ step latency.

Where the profile also measured what padded attention costs (`ThroughputProfile.at`, sps.json's
`attention` section), a step's target latency depends on its layout, not on B alone: the graph pads
every slot's query to the longest one, so one request verifying 7 drafts next to 15 decoding ones
attends 16 × 8 query rows. `dspark-async` and the runtime's drafter-skip rule then price that and also
search a cap L on every ℓ_r (see `_best_plan`); `dspark` keeps SPS(B) (see `dspark_lengths` for why).

Because a[r, j] is non-increasing in j, the K candidates (r, j) with the largest survivals always form
a prefix of every request's block (ties broken by lower j first, then lower r), so a capacity K
fixes the lengths: ℓ_r = number of request r's positions among the top K.

Non-anticipation (lossless speculative decoding): the admission of draft j of request r (ℓ_r ≥ j)
may depend on c[r, 1..j] but not on c[r, j+1..γ], which are functions of the drawn token x_{r,j}.
`dspark_lengths` guarantees it with the early stop: (r, j) is admitted from the sorted prefix up to
itself only. `dspark_async_lengths` guarantees it by choosing K from confidences of an earlier step.
A global argmax over K on the *current* confidences does not (Appendix A; see the tests).
"""

from __future__ import annotations

import numpy as np

from ..engines.sps import ThroughputProfile

__all__ = ["survival_probs", "expected_throughput", "search_capacity",
           "top_k_lengths", "dspark_lengths", "dspark_async_lengths", "dspark_async_capacity",
           "mean_survival_capacity"]


def _check_confidence(confidence: np.ndarray, name: str = "confidence") -> np.ndarray:
    c = np.asarray(confidence)
    if c.ndim != 2:
        raise ValueError(f"{name}: expected [R, γ] float, found shape {c.shape}")
    if c.size and not (c.min() >= 0 and c.max() <= 1):     # min/max propagate NaN: also rejects NaN
        raise ValueError(f"{name}: expected probabilities in [0, 1], found min {np.nanmin(c)}, max {np.nanmax(c)}"
                         f"{' and NaN' if np.isnan(c).any() else ''}")
    return c


def survival_probs(confidence: np.ndarray, max_lengths: np.ndarray | None = None) -> np.ndarray:
    """a[r, j] = Π_{i ≤ j} c[r, i]; positions beyond max_lengths[r] get survival 0 (never admitted).

    Args:
        confidence: [R, γ] float32 conditional confidences in [0, 1].
        max_lengths: [R] int, optional cap on ℓ_r (cache room, tokens left); none by default.
    Returns:
        [R, γ] float64, non-increasing along γ.
    Raises:
        ValueError: bad shape, values outside [0, 1], max_lengths not [R].
    """
    c = _check_confidence(confidence)
    a = np.cumprod(c, axis=1, dtype=np.float64)    # x·c ≤ x for c ≤ 1, also after rounding
    if max_lengths is not None:
        cap = np.asarray(max_lengths)
        if cap.shape != (c.shape[0],):
            raise ValueError(f"max_lengths: expected [R] = [{c.shape[0]}], found shape {cap.shape}")
        a[np.arange(c.shape[1])[None, :] >= cap[:, None]] = 0.0
    return a


def _sorted_candidates(survival: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Candidates with a > 0, by a descending, ties by lower j then lower r.

    Returns (flat indices j·R + r, their survivals), both [n].
    """
    flat = survival.T.ravel()                       # j-major, so a stable sort breaks ties by j, then r
    order = np.argsort(-flat, kind="stable")
    ranked = flat[order]
    n = int(np.count_nonzero(ranked > 0))           # positives come first
    return order[:n], ranked[:n]


def _throughputs(ranked: np.ndarray, num_requests: int, profile: ThroughputProfile,
                 draft_at_zero: bool = True, draft_slots: int | None = None,
                 depth: np.ndarray | None = None) -> np.ndarray:
    """Θ_k for k = 0..n, as [n+1] float64, τ_k = R + Σ_{i ≤ k} ranked_i:

    without drafter cost, Θ_k = τ_k · SPS(R + k) (paper Algorithm 1);
    with it, Θ_k = τ_k / (1/SPS(R + k) + d(S)), S = `draft_slots` (the rows the drafter block runs
    over; R when None), where k = 0 pays d(S) only if `draft_at_zero` (the drafts already exist:
    Algorithm 1's cost is sunk) and not when the step may skip the drafter.
    With a layout cost (`ThroughputProfile.has_layout_cost`) and `depth` ([n] int, the position j of
    each ranked candidate), 1/SPS(R + k) becomes t(R + k, w_k), w_k = 1 + max depth of the first k.
    """
    if depth is not None and profile.has_layout_cost:
        keep = np.ones((1, ranked.size), bool)
        return _layout_throughputs(ranked, depth, keep, num_requests, profile, draft_at_zero, draft_slots)[0][0]
    tau = np.empty(ranked.size + 1)
    tau[0] = 0.0
    np.cumsum(ranked, out=tau[1:])
    tau += num_requests
    sps = profile.sps_range(num_requests, ranked.size + 1)
    if not profile.has_draft_cost:
        return tau * sps
    with np.errstate(divide="ignore"):
        step_s = np.where(sps > 0, 1.0 / np.where(sps > 0, sps, 1.0), np.inf)
    draft = np.full(step_s.shape, profile.draft_seconds(num_requests if draft_slots is None else draft_slots))
    if not draft_at_zero:
        draft[0] = 0.0
    return tau / (step_s + draft)


def _layout_throughputs(ranked: np.ndarray, depth: np.ndarray, keep: np.ndarray, num_requests: int,
                        profile: ThroughputProfile, draft_at_zero: bool,
                        draft_slots: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Θ and K under a layout cost for several subsets of the ranked candidates at once.

    Row l of `keep` ([L, n] bool) selects the candidates admitted in that row's order; Θ[l, i] is the
    step's throughput after the i-th ranked candidate when it is kept (-inf where it is not), priced at
    t(R + k, 1 + the deepest kept position so far); column 0 is k = 0. A cumulative sum over zeros where
    a candidate is left out adds nothing, so each row equals `_throughputs` on that subset bit for bit.

    Returns:
        (Θ [L, 1 + n] float64, K [L, 1 + n] int64: the candidates admitted at each column).
    """
    n = ranked.size
    tau = np.zeros((keep.shape[0], n + 1))
    np.cumsum(np.where(keep, ranked, 0.0), axis=1, out=tau[:, 1:])
    tau += num_requests
    k = np.zeros((keep.shape[0], n + 1), np.int64)
    np.cumsum(keep, axis=1, out=k[:, 1:])
    widths = np.ones((keep.shape[0], n + 1), np.int64)
    np.maximum.accumulate(np.where(keep, depth, 0), axis=1, out=widths[:, 1:])
    widths[:, 1:] += 1
    step_s = profile.step_seconds((num_requests + k).ravel(), widths.ravel()).reshape(k.shape)
    draft = np.full(step_s.shape, profile.draft_seconds(num_requests if draft_slots is None else draft_slots))
    if not draft_at_zero:
        draft[:, 0] = 0.0
    theta = tau / (step_s + draft)
    theta[:, 1:][~keep] = -np.inf
    return theta, k


def _best_plan(survival: np.ndarray, num_requests: int, profile: ThroughputProfile, draft_at_zero: bool,
               draft_slots: int | None = None) -> tuple[int, int | None, float, float]:
    """Global search (no early stop): (K*, L*, Θ(K*), Θ(0)) over the candidates of `survival` [R', γ'].

    Without a layout cost, L* = None (no cap) and K* = argmax_k Θ_k over all ranked candidates (§5.2).
    With one, the search also caps every verify length at L = 1..D (D the deepest position with a
    positive survival): for each L, Θ over the ranked candidates with j ≤ L, and the best (L, K) overall
    (the smallest L, then the smallest K, on ties); L* = D is returned as None, since no deeper cap was
    weighed against it. Why: the top-K by survival can stack one confident request's drafts, and its
    long segment pads every slot's query (16 slots, one request verifying 7: 16 × 8 query rows); a cap
    trades those deep drafts for shallow ones of other requests. Θ_0 does not depend on L.
    With a cost that depends on B and the longest ℓ only, the best (L, K) is the best allocation of
    drafts with a positive survival among all prefix-respecting ones (tested against brute force).
    """
    order, ranked = _sorted_candidates(survival)
    if not profile.has_layout_cost:
        theta = _throughputs(ranked, num_requests, profile, draft_at_zero, draft_slots)
        k = int(np.argmax(theta))
        return k, None, float(theta[k]), float(theta[0])
    depth = order // max(survival.shape[0], 1) + 1
    deepest = int(depth.max(initial=1))
    # every cap at once, row L - 1 for cap L: equal bit for bit to one `_throughputs` per cap, the loop the
    # C++ port runs (cpp/src/scheduler.cpp BestPlan); argmax's first hit is the smallest L, then K
    keep = depth[None, :] <= np.arange(1, deepest + 1)[:, None]
    theta, k = _layout_throughputs(ranked, depth, keep, num_requests, profile, draft_at_zero, draft_slots)
    cap, col = np.unravel_index(int(np.argmax(theta)), theta.shape)
    return int(k[cap, col]), (int(cap) + 1 if cap + 1 < deepest else None), float(theta[cap, col]), float(theta[0, 0])


def search_capacity(ranked: np.ndarray, num_requests: int, profile: ThroughputProfile, early_stop: bool,
                    draft_at_zero: bool = True) -> int:
    """The number K of ranked candidates to admit.

    early_stop=True (Algorithm 1): K = the last k before the first k with Θ_k ≤ Θ_{k-1}.
    early_stop=False (§5.2 global search): K = argmax_k Θ_k (the smallest k on ties).

    Args:
        ranked: [n] float64 survivals sorted descending.
        num_requests: R (anchor rows, each worth one expected token).
        profile: SPS(B), with the drafter cost d(R) where known.
        draft_at_zero: whether K = 0 still pays the drafter (see `_throughputs`).
    Returns:
        K in 0..n.
    """
    theta = _throughputs(ranked, num_requests, profile, draft_at_zero)
    if not early_stop:
        return int(np.argmax(theta))
    stops = np.flatnonzero(theta[1:] <= theta[:-1])   # k - 1 for every non-improving k
    return int(stops[0]) if stops.size else ranked.size


def top_k_lengths(order: np.ndarray, num_requests: int, k: int) -> np.ndarray:
    """ℓ_r = number of request r's candidates among the first k of `order` (flat indices j·R + r)."""
    return np.bincount(order[:k] % num_requests, minlength=num_requests).astype(np.int64)


def expected_throughput(confidence: np.ndarray, lengths: np.ndarray, profile: ThroughputProfile) -> float:
    """Θ = τ · SPS(B) of an allocation, τ = Σ_r (1 + Σ_{j ≤ ℓ_r} a[r, j]), B = Σ_r (1 + ℓ_r); tokens/s.
    With the drafter cost known: Θ = τ / (1/SPS(B) + d(R)) (the drafts were made). With a layout cost,
    1/SPS(B) becomes t(B, 1 + max ℓ) (`ThroughputProfile.step_seconds`).

    Args:
        confidence: [R, γ] float32 conditional confidences.
        lengths: [R] int verify lengths in 0..γ.
        profile: SPS(B).
    """
    a = survival_probs(confidence)
    lengths = np.asarray(lengths)
    taken = np.arange(a.shape[1])[None, :] < lengths[:, None]
    tau = a.shape[0] + a[taken].sum()
    if profile.has_layout_cost:
        width = 1 + int(lengths.max(initial=0))
        step_s = float(profile.step_seconds([int(a.shape[0] + lengths.sum())], [width])[0])
        return float(tau / (step_s + profile.draft_seconds(a.shape[0])))
    sps = profile.sps(int(a.shape[0] + lengths.sum()))
    if not profile.has_draft_cost:
        return float(tau * sps)
    return float(tau / (1.0 / sps + profile.draft_seconds(a.shape[0]))) if sps > 0 else 0.0


def dspark_lengths(confidence: np.ndarray, profile: ThroughputProfile,
                   max_lengths: np.ndarray | None = None) -> np.ndarray:
    """`dspark`: paper Algorithm 1, greedy admission by survival with the early stop.

    Sort the candidates (r, j) with a[r, j] > 0 by a descending (ties: lower j, then lower r). Start at
    B = R, τ = R, Θ_best = R·SPS(R); admit candidates one at a time (B += 1, τ += a, Θ = τ·SPS(B)) and
    stop at the FIRST Θ ≤ Θ_best. Computed for all prefixes at once (cumsum), no loop over candidates.
    The early stop makes the admission of (r, j) a function of the sorted list up to (r, j) only,
    which never contains (r, j' > j): the scheduler is non-anticipating. It reaches the global
    maximum of Θ only where Θ is unimodal along the greedy path (smooth SPS); a staircase cliff can
    stop it early (see `dspark_async_lengths`). It prices steps by SPS(B) alone, even where the profile
    has a layout cost: priced per prefix at t(B, 1 + its longest ℓ), Θ saw-tooths along the greedy path
    (the first draft at a new depth pays the padding of every slot, the next ones at that depth are
    nearly free), and the early stop fires at the first tooth. Example: 8 requests at c = 0.95, S = 8,
    P = 1,024, SmolLM2's fit on a 20 + 0.3·B ms profile: the layout-priced stop verified nothing
    (165 tokens/s under that model) where SPS(B) verifies 7 each (405 tokens/s under the same model).

    Worked example: c = [[0.9, 0.8, 0.5], [0.6, 0.5, 0.9]] → a = [[0.9, 0.72, 0.36], [0.6, 0.3, 0.27]];
    buckets {2: 100, 4: 90, 8: 75} steps/s. Θ_0 = 2·100 = 200; admit 0.9 → B=3 (bucket 4):
    2.9·90 = 261; admit 0.72 → B=4: 3.62·90 = 325.8; admit 0.6 → B=5 (bucket 8): 4.22·75 = 316.5
    ≤ 325.8 → stop. ℓ = [2, 0], B = 4, Θ = 325.8 tokens/s.

    Args:
        confidence: [R, γ] float32 calibrated conditional confidences in [0, 1].
        profile: SPS(B).
        max_lengths: [R] int, optional cap on ℓ_r.
    Returns:
        [R] int64 verify lengths in 0..γ. All zeros if even R exceeds the largest bucket (SPS 0).
    """
    a = survival_probs(confidence, max_lengths)
    order, ranked = _sorted_candidates(a)
    return top_k_lengths(order, a.shape[0], search_capacity(ranked, a.shape[0], profile, early_stop=True))


def dspark_async_lengths(confidence: np.ndarray, lagged_confidence: np.ndarray | None, profile: ThroughputProfile,
                         max_lengths: np.ndarray | None = None) -> np.ndarray:
    """`dspark-async`: paper §5.2, capacity K from an earlier step's confidences, top-K of the current ones.

    K* = argmax_K Θ(K), Θ(K) = τ(K)·SPS(R + K), τ(K) = R + sum of the K largest lagged survivals,
    searched over every K with NO early stop, so staircase cliffs of SPS(B) do not trap it (R is the
    current number of requests). The step then verifies the K* candidates with the largest CURRENT
    survivals (rank-preserving; fewer if fewer have a > 0). With a layout cost, the search also picks a
    cap L* on every ℓ_r from the lagged survivals (`_best_plan`) and the top-K* are taken among the
    current candidates with j ≤ L*. K* (and L*) do not depend on this step's draws,
    and the top-K of the current survivals admits (r, j) from the candidates ranked above it only, so
    the step is non-anticipating. Without history (lagged_confidence None: the first steps) it falls
    back to `dspark_lengths` on the current confidences, never to a global search on them, which
    would be biased (Appendix A).

    Worked example (as `dspark_lengths`, with lagged = current confidences for brevity):
    a sorted = 0.9, 0.72, 0.6, 0.36, 0.3, 0.27; Θ(K) for K = 0..6 = 200, 261, 325.8, 316.5, 343.5,
    366, 386.25 → K* = 6 (past the cliff at B = 5 where Algorithm 1 stops). The current top-6 gives
    ℓ = [3, 3], B = 8, Θ = 386.25 tokens/s.

    Args:
        confidence: [R, γ] float32 current calibrated conditional confidences in [0, 1].
        lagged_confidence: [R', γ'] float32 confidences of two steps earlier (R' may differ from R
            when requests joined or left), or None (or empty, as the C++ port reads it) when there is
            no history yet.
        profile: SPS(B).
        max_lengths: [R] int, optional cap on ℓ_r (applies to the current candidates).
    Returns:
        [R] int64 verify lengths in 0..γ.
    """
    if lagged_confidence is None or np.asarray(lagged_confidence).size == 0:
        return dspark_lengths(confidence, profile, max_lengths)
    R = np.asarray(confidence).shape[0]
    k, cap = _lagged_plan(lagged_confidence, R, profile)
    limit = max_lengths if cap is None else (
        np.full(R, cap, np.int64) if max_lengths is None else np.minimum(np.asarray(max_lengths), cap))
    a = survival_probs(confidence, limit)
    order, _ = _sorted_candidates(a)
    return top_k_lengths(order, a.shape[0], k)


def mean_survival_capacity(mean_survival: np.ndarray, num_requests: int, profile: ThroughputProfile,
                           margin: float = 0.0, draft_slots: int | None = None) -> int:
    """K* = argmax_K Θ(K) over the ranked survivals of R requests (no early stop, K = 0 priced without
    the drafter, as `dspark_async_capacity`), given each request's expected survival curve: whether
    drafting pays for the current requests.

    The runtime's drafter-skip decision passes, for every request, the running mean over earlier
    drafted steps of the request-averaged survival, so one unlucky step's low confidences do not
    switch the drafter off (a single step's survivals are noisy: at R = 1 they swing between ~0 and
    ~1 from one token to the next); see `SkipController` for why not per request.

    Worked example (buckets {1: 40, 2: 28, 4: 25, 8: 20} steps/s, d(1) = 10 ms, R = 1): steps that
    alternate between c = 0.95 and c = 0.05 at each of 4 positions have mean survival
    [0.5, 0.45, 0.43, 0.41]. Θ_0 = 40 tokens/s (no drafter), Θ_3 = (1 + 1.38) / (40 + 10 ms) = 47.7,
    Θ_4 = (1 + 1.79) / (50 + 10 ms) = 46.5: K* = 3, draft. The c = 0.05 step alone gives K* = 0.

    Args:
        mean_survival: [R, γ] float64, each row non-increasing, in [0, 1].
        num_requests: R, the requests of the current step (the rows).
        profile: SPS(B), with d(R) where known.
        margin: K* counts only if Θ(K*) ≥ (1 + margin) · Θ(0); otherwise 0 (a hedge against a cost
            model or confidences that favour drafting; the runtime passes 0.2). Defaults to 0.
        draft_slots: S ≥ R, the rows the drafter block would run over (the runtime's slot count: the
            block drafts for every slot, prefilling and empty ones included), priced as d(S);
            None prices d(R).
    Returns:
        K* ≥ 0.
    Raises:
        ValueError: mean_survival not [num_requests, γ] or outside [0, 1], or draft_slots < R.
    """
    a = np.asarray(mean_survival, np.float64)
    if a.ndim != 2 or a.shape[0] != num_requests or not np.all((a >= 0) & (a <= 1)):
        raise ValueError(f"mean_survival: expected [R={num_requests}, γ] values in [0, 1], found shape {a.shape}")
    if draft_slots is not None and draft_slots < num_requests:
        raise ValueError(f"draft_slots: expected at least R = {num_requests}, found {draft_slots}")
    return _skippable_capacity(a, num_requests, profile, margin, draft_slots)


def _skippable_capacity(survival: np.ndarray, num_requests: int, profile: ThroughputProfile,
                        margin: float = 0.0, draft_slots: int | None = None) -> int:
    """K* = argmax_K Θ(K) over every survival of `survival` ranked together, no early stop, K = 0 priced
    without the drafter (a step that verifies nothing need not draft); 0 unless Θ(K*) ≥ (1 + margin) Θ(0)."""
    k, _, best, zero = _best_plan(survival, num_requests, profile, draft_at_zero=False, draft_slots=draft_slots)
    return k if best >= (1.0 + margin) * zero else 0


def dspark_async_capacity(lagged_confidence: np.ndarray, num_requests: int, profile: ThroughputProfile) -> int:
    """K* = argmax_K Θ(K) over the lagged survivals, no early stop (paper §5.2; see `dspark_async_lengths`).

    With the drafter cost known, K = 0 is priced without the drafter block (a step that verifies no
    drafts need not draft), so K* = 0 tells the runtime it may skip drafting this step: the decision
    depends on earlier steps only, so skipping keeps the step non-anticipating.

    Args:
        lagged_confidence: [R', γ'] float32 confidences of an earlier step, in [0, 1].
        num_requests: R, requests in the current step.
        profile: SPS(B), with d(R) where known.
    Returns:
        K* ≥ 0, the number of draft positions to verify this step.
    """
    return _lagged_plan(lagged_confidence, num_requests, profile)[0]


def _lagged_plan(lagged_confidence: np.ndarray, num_requests: int, profile: ThroughputProfile) -> tuple[int, int | None]:
    """§5.2's (K*, cap L* or None) from the lagged confidences, K = 0 priced without the drafter."""
    k, cap, _, _ = _best_plan(survival_probs(_check_confidence(lagged_confidence, "lagged_confidence")),
                              num_requests, profile, draft_at_zero=False)
    return k, cap
