"""Triton twins of ``common.warp_probs`` and ``common.sample_from_probs``: device helpers of one vocab row.

Each ``@triton.jit`` helper runs inside one program (one request row, vLLM style) and walks a row of
V logits in blocks of ``BLOCK_V`` (the tail block is masked, so V need not be a multiple). Nothing
over V is kept between passes: ``warp_stats`` reduces a row to a few scalars, from which
``warped_block`` recomputes the final probabilities of any block, so every later pass re-reads the
logits. The whole warp and the sampling run on the device, with no sort:

    pass                              gives                                      runs when
    argmax of the raw logits          row max, first argmax g                    always
    top-k search (see below) on the   kth = the k-th largest l/T (ties kept)     1 < top_k < V (top_k = 1: kth = max)
      order-preserving int32 key of l/T: the largest key t with count(key >= t) >= k
    softmax sum                       E = Σ exp(l/T − max) over tokens >= kth    temperature > 0
    top-p search on the key of p:     pivot: keep p > pivot, and the first        top_p < 1
      the smallest t with               pivot_keep tokens (by index) with p == pivot
      Σ_{key(p) > t} p < top_p;         (one pass counts the ties, then a scalar loop adds them one by one)
    kept sum                          S = Σ kept p                               temperature > 0

A search narrows an integer key interval with NUM_PROBES evenly spaced probes per pass (a
[NUM_PROBES, BLOCK_V] tile), so it needs about 33 / log2(NUM_PROBES + 1) passes (9 for 15 probes,
33 for 1: plain bisection). This matches the reference's stable descending sort exactly: of equal
probabilities the lower index comes first, and the top-1 token is always kept.

The final distribution is ``p_i = kept_i / S`` (greedy rows: a one-hot at g), with the float32
operations of the numpy reference (correctly rounded division ``div_rn``, ``exp``). ``sample_row``
draws "the first index i with cumsum(d)_i > u·Σd" (d = p, or the residual max(p − q, 0)) by a
two-pass block scan: pass 1 computes Σd as the last cumulative sum, pass 2 counts the cumulative
sums <= u·Σd. The running sum of earlier blocks is folded into the first element of each block
before ``tl.cumsum``, so a sequential scan (the interpreter's) performs exactly the additions of
numpy's float32 cumsum.

Numerics against the numpy reference (the ids agree unless a uniform or top_p lands within a few
float32 ulps of a boundary):
- E and S are block sums (a tree within a block, sequential across blocks) where numpy sums
  pairwise, so p may differ by an ulp.
- top-p compares top_p with Σ_{p > pivot} p (a block sum) plus the ties added one by one, where the
  reference adds the sorted probabilities one by one.
- On a GPU ``tl.exp`` is the approximate ex2-based exponential and ``tl.cumsum`` a tree scan, so p
  and the cumulative sums may differ by a few ulps more; divisions stay correctly rounded.
Dimension letters: V vocab.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A row's stats tuple (``warp_stats``):
# (greedy, argmax, safe_temperature, kth, scaled_max, exp_sum, pivot, pivot_keep, kept_sum).
# Hot loops inline small expressions rather than call helpers: each helper call costs a language
# re-patch in the interpreter (the compiled kernel inlines them anyway).


@triton.jit
def ordered_key(x):
    """float32 -> int32 with the same order (for non-NaN values; -0.0 sorts just below +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def key_to_float(key):
    """The inverse of ``ordered_key`` (the map is an involution on the bits); key fits int32."""
    bits = key.to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    """(max, first index of the max) of a row of V float32."""
    offs0 = tl.arange(0, BLOCK_V)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        values = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        block_max = tl.max(values, 0)
        block_index = tl.argmax(values, 0, tie_break_left=True)
        # Strictly greater: an earlier block keeps a tie, so the first index wins.
        best_index = tl.where(block_max > best, start + block_index.to(tl.int64), best_index)
        best = tl.maximum(best, block_max)
    return best, best_index


@triton.jit
def _softmax_block(row_ptr, offs, mask, safe_temperature, kth, scaled_max, exp_sum):
    """Top-k-masked softmax probabilities of one block: exp(l/T − max) / E (0 where masked or below kth).

    With exp_sum = 1 these are the exps themselves (division by 1 is exact).
    """
    logits = tl.load(row_ptr + offs, mask=mask, other=float("-inf"))
    scaled = tl.math.div_rn(logits, safe_temperature)
    exps = tl.where(mask & (scaled >= kth), tl.exp(scaled - scaled_max), 0.0)
    return tl.math.div_rn(exps, exp_sum)


@triton.jit
def _probes(low, high, NUM_PROBES: tl.constexpr):
    """NUM_PROBES evenly spaced int64 keys above low, and whether each lies below high."""
    step = (high - low + NUM_PROBES) // (NUM_PROBES + 1)  # ceil((high - low) / (NUM_PROBES + 1)) >= 1
    probes = low + step * (tl.arange(0, NUM_PROBES) + 1).to(tl.int64)
    return probes, probes < high


@triton.jit
def _narrow(probes, in_range, holds, low, high):
    """New (low, high) of a monotone predicate (true below a threshold) from its values at the probes."""
    holds = in_range & holds
    fails = in_range & (holds == 0)
    new_low = tl.maximum(low, tl.max(tl.where(holds, probes, low), 0))
    new_high = tl.minimum(high, tl.min(tl.where(fails, probes, high), 0))
    return new_low, new_high


@triton.jit
def _kth_largest(row_ptr, V, safe_temperature, top_k, scaled_max, BLOCK_V: tl.constexpr, NUM_PROBES: tl.constexpr):
    """The top_k-th largest l/T of the row (1 < top_k < V): the largest key t with count(key >= t) >= k."""
    offs0 = tl.arange(0, BLOCK_V)
    low = tl.full((), -2147483649, tl.int64)  # below every int32 key: count = V >= k
    high = ordered_key(scaled_max).to(tl.int64) + 1  # above the max: count = 0 < k
    while high - low > 1:
        probes, in_range = _probes(low, high, NUM_PROBES)
        counts = tl.zeros((NUM_PROBES,), tl.int64)
        for start in range(0, V, BLOCK_V):
            offs = start + offs0
            mask = offs < V
            scaled = tl.math.div_rn(tl.load(row_ptr + offs, mask=mask, other=float("-inf")), safe_temperature)
            bits = scaled.to(tl.int32, bitcast=True)
            keys = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # ordered_key, inlined
            counts += tl.sum((mask[None, :] & (keys[None, :] >= probes[:, None])).to(tl.int64), 1)
        low, high = _narrow(probes, in_range, counts >= top_k, low, high)
    return key_to_float(low)


@triton.jit
def _top_p_pivot(row_ptr, V, safe_temperature, kth, scaled_max, exp_sum, top_p,
                 BLOCK_V: tl.constexpr, NUM_PROBES: tl.constexpr):
    """(pivot key, number of ties at the pivot kept) of top-p over the top-k softmax (top_p < 1).

    The stable descending order keeps token i iff the mass before it in that order is < top_p. With
    G(t) = Σ_{key(p) > t} p, the pivot is the smallest key t with G(t) < top_p: tokens above it are
    kept, tokens below it are not, and of the ties at the pivot (in index order) the m-th is kept iff
    G(pivot) + m·p_pivot < top_p. The largest probability is always kept. For p >= 0 the key is the
    float's bits.
    """
    offs0 = tl.arange(0, BLOCK_V)
    max_key = tl.math.div_rn(1.0, exp_sum).to(tl.int32, bitcast=True).to(tl.int64)  # exp(0) = 1: the top p
    low = tl.full((), -1, tl.int64)  # G(-1) is the whole mass
    high = max_key + 1  # G = 0
    while high - low > 1:
        probes, in_range = _probes(low, high, NUM_PROBES)
        masses = tl.zeros((NUM_PROBES,), tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + offs0
            probs = _softmax_block(row_ptr, offs, offs < V, safe_temperature, kth, scaled_max, exp_sum)
            keys = probs.to(tl.int32, bitcast=True)
            masses += tl.sum(tl.where(keys[None, :] > probes[:, None], probs[None, :], 0.0), 1)
        low, high = _narrow(probes, in_range, masses >= top_p, low, high)
    pivot = tl.minimum(high, max_key)
    mass_above = tl.full((), 0.0, tl.float32)
    num_ties = tl.full((), 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        mask = offs < V
        probs = _softmax_block(row_ptr, offs, mask, safe_temperature, kth, scaled_max, exp_sum)
        keys = probs.to(tl.int32, bitcast=True)
        mass_above += tl.sum(tl.where(keys > pivot, probs, 0.0), 0)
        num_ties += tl.sum((mask & (keys == pivot)).to(tl.int64), 0)
    tie_prob = pivot.to(tl.int32).to(tl.float32, bitcast=True)
    kept_ties = tl.full((), 0, tl.int64)
    if tie_prob == 0.0:
        kept_ties = num_ties  # zero-probability tokens: keeping them changes nothing
    else:
        cumulative = mass_above
        while (kept_ties < num_ties) & (cumulative < top_p):
            cumulative += tie_prob
            kept_ties += 1
    if pivot == max_key:
        kept_ties = tl.maximum(kept_ties, 1)  # the top-1 token is always kept
    return pivot, kept_ties


@triton.jit
def warped_block(row_ptr, offs, mask, stats, ties_seen):
    """(final probabilities of one block, updated ties_seen); visit the blocks in order from 0, ties_seen = 0.

    ``ties_seen`` counts the tokens at the top-p pivot in earlier blocks, so the first ``pivot_keep``
    of them (by index) are kept. pivot = -1 (top-p off) keeps every token.
    """
    greedy, argmax, safe_temperature, kth, scaled_max, exp_sum, pivot, pivot_keep, kept_sum = stats
    probs = _softmax_block(row_ptr, offs, mask, safe_temperature, kth, scaled_max, exp_sum)
    keys = probs.to(tl.int32, bitcast=True)  # p >= 0: its bits are ordered
    is_tie = mask & (keys == pivot)
    ties = is_tie.to(tl.int32)
    rank = ties_seen + tl.cumsum(ties, 0) - ties
    keep = (keys > pivot) | (is_tie & (rank < pivot_keep))
    final = tl.math.div_rn(tl.where(keep, probs, 0.0), kept_sum)
    final = tl.where(greedy, tl.where(offs == argmax, 1.0, 0.0), final)
    return final, ties_seen + tl.sum(ties, 0)


@triton.jit
def warp_stats(row_ptr, V, temperature, top_k, top_p, BLOCK_V: tl.constexpr, NUM_PROBES: tl.constexpr):
    """The scalars that define warp(row) (see the module docstring), as the tuple ``warped_block`` takes."""
    offs0 = tl.arange(0, BLOCK_V)
    row_max, argmax = row_argmax(row_ptr, V, BLOCK_V)
    greedy = temperature == 0
    safe_temperature = tl.where(greedy, 1.0, temperature)
    scaled_max = tl.math.div_rn(row_max, safe_temperature)  # correctly rounded division is monotone
    kth = tl.full((), float("-inf"), tl.float32)
    exp_sum = tl.full((), 1.0, tl.float32)
    pivot = tl.full((), -1, tl.int64)
    pivot_keep = tl.full((), 0, tl.int64)
    kept_sum = tl.full((), 1.0, tl.float32)
    if temperature > 0:
        if top_k == 1:
            kth = scaled_max
        elif (top_k > 1) & (top_k < V):
            kth = _kth_largest(row_ptr, V, safe_temperature, top_k, scaled_max, BLOCK_V, NUM_PROBES)
        exp_sum = tl.full((), 0.0, tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + offs0
            exp_sum += tl.sum(_softmax_block(row_ptr, offs, offs < V, safe_temperature, kth, scaled_max, 1.0), 0)
        if top_p < 1:
            pivot, pivot_keep = _top_p_pivot(row_ptr, V, safe_temperature, kth, scaled_max, exp_sum, top_p,
                                             BLOCK_V, NUM_PROBES)
        unnormalised = (greedy, argmax, safe_temperature, kth, scaled_max, exp_sum, pivot, pivot_keep, 1.0)
        kept_sum = tl.full((), 0.0, tl.float32)
        ties_seen = tl.full((), 0, tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + offs0
            kept, ties_seen = warped_block(row_ptr, offs, offs < V, unnormalised, ties_seen)
            kept_sum += tl.sum(kept, 0)
    return greedy, argmax, safe_temperature, kth, scaled_max, exp_sum, pivot, pivot_keep, kept_sum


@triton.jit
def no_stats():
    """A placeholder stats tuple (the types of ``warp_stats``'s), to declare a loop-carried variable."""
    return (tl.full((), 0, tl.int1), tl.full((), 0, tl.int64), tl.full((), 1.0, tl.float32),
            tl.full((), float("-inf"), tl.float32), tl.full((), 0.0, tl.float32), tl.full((), 1.0, tl.float32),
            tl.full((), -1, tl.int64), tl.full((), 0, tl.int64), tl.full((), 1.0, tl.float32))


@triton.jit
def probs_at(p_ptr, p_stats, q_ptr, q_stats, index, V, BLOCK_V: tl.constexpr):
    """(warp(p row)[index], warp(q row)[index]) in one pass (exactly 1 or 0 for greedy rows)."""
    offs0 = tl.arange(0, BLOCK_V)
    p_value = tl.where(index == p_stats[1], 1.0, 0.0)
    q_value = tl.where(index == q_stats[1], 1.0, 0.0)
    if p_stats[0] == 0:  # not greedy (both rows share the sampling parameters)
        p_value = tl.full((), 0.0, tl.float32)
        q_value = tl.full((), 0.0, tl.float32)
        p_ties = tl.full((), 0, tl.int32)
        q_ties = tl.full((), 0, tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + offs0
            probs, p_ties = warped_block(p_ptr, offs, offs < V, p_stats, p_ties)
            q_probs, q_ties = warped_block(q_ptr, offs, offs < V, q_stats, q_ties)
            p_value += tl.sum(tl.where(offs == index, probs, 0.0), 0)
            q_value += tl.sum(tl.where(offs == index, q_probs, 0.0), 0)
    return p_value, q_value


@triton.jit
def residual_is_positive(p_ptr, p_stats, q_ptr, q_stats, V, BLOCK_V: tl.constexpr):
    """Whether max(p − q, 0) has a positive entry (exactly the reference's Σ residual > 0)."""
    offs0 = tl.arange(0, BLOCK_V)
    largest = tl.full((), 0.0, tl.float32)
    p_ties = tl.full((), 0, tl.int32)
    q_ties = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        probs, p_ties = warped_block(p_ptr, offs, offs < V, p_stats, p_ties)
        q_probs, q_ties = warped_block(q_ptr, offs, offs < V, q_stats, q_ties)
        largest = tl.maximum(largest, tl.max(probs - q_probs, 0))
    return largest > 0


@triton.jit
def sample_row(p_ptr, p_stats, q_ptr, q_stats, uniform, V, BLOCK_V: tl.constexpr, RESIDUAL: tl.constexpr):
    """The first index i with cumsum(d)_i > u·Σd (d = p, or max(p − q, 0) when RESIDUAL), as int64.

    Σd is the last cumulative sum, as in the reference; should rounding leave no index, the last
    token with d > 0 is taken. Without RESIDUAL, q is not read.
    """
    offs0 = tl.arange(0, BLOCK_V)
    total = tl.full((), 0.0, tl.float32)
    p_ties = tl.full((), 0, tl.int32)
    q_ties = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK_V):  # pass 1: Σd, the last cumulative sum
        offs = start + offs0
        values, p_ties = warped_block(p_ptr, offs, offs < V, p_stats, p_ties)
        if RESIDUAL:
            q_values, q_ties = warped_block(q_ptr, offs, offs < V, q_stats, q_ties)
            values = tl.maximum(values - q_values, 0.0)
        cumulative = tl.cumsum(tl.where(offs == start, values + total, values), 0)  # continues the running sum
        total = tl.sum(tl.where(offs0 == BLOCK_V - 1, cumulative, 0.0), 0)  # the masked tail adds zeros
    threshold = uniform * total
    carry = tl.full((), 0.0, tl.float32)
    count = tl.full((), 0, tl.int64)
    last_positive = tl.full((), -1, tl.int64)
    p_ties = tl.full((), 0, tl.int32)
    q_ties = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK_V):  # pass 2: the same scan, counting the sums <= u·Σd
        offs = start + offs0
        mask = offs < V
        values, p_ties = warped_block(p_ptr, offs, mask, p_stats, p_ties)
        if RESIDUAL:
            q_values, q_ties = warped_block(q_ptr, offs, mask, q_stats, q_ties)
            values = tl.maximum(values - q_values, 0.0)
        cumulative = tl.cumsum(tl.where(offs == start, values + carry, values), 0)
        carry = tl.sum(tl.where(offs0 == BLOCK_V - 1, cumulative, 0.0), 0)
        count += tl.sum((mask & (cumulative <= threshold)).to(tl.int64), 0)
        last_positive = tl.maximum(last_positive, tl.max(tl.where(mask & (values > 0), offs.to(tl.int64), -1), 0))
    if last_positive < 0:
        last_positive = tl.full((), -1, tl.int64) + V  # an all-zero row, as the reference (never a warp)
    return tl.minimum(count, last_positive)
