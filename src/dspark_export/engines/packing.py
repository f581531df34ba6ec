"""Packing ragged per-request segments into the target graph's inputs (docs/ARCHITECTURE.md).

A segment is the new tokens of one slot in one target pass: a prefill chunk, a decode token, or
[anchor, draft_1..draft_ℓ] for verification. Slots without a segment get an empty query.
Padding rows (to reach the engine's bucket N) are spread over the slots, each slot's after its real
rows, so the causal mask keeps every real row blind to them, and their outputs (logits, features,
K/V) are never read back. That makes them inert. A padding row takes its slot's last real position
(a slot without a segment: its next position, cache_lens[slot]).

Why spread: the graph pads every slot's query to the longest one (`pad_index` [S, Q]) and attends
S × Q query rows over the cache, so Q should stay near N / S. Filling every slot up to a common width gives
Q = max(longest segment, ⌈N / S⌉). All padding on the last segment made Q as large as the padding, and
the pass about twice as slow (reports/measurement_history.md, "spread padding").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Segment", "PackedBatch", "pack_segments", "padded_width"]


@dataclass
class Segment:
    """New tokens of one slot: ids [q] int64 at positions start..start+q-1."""

    slot: int
    token_ids: np.ndarray
    start_position: int
    logits: str = "all"   # "all" rows, "last" row, or "none"


@dataclass
class PackedBatch:
    """Target-graph inputs (without the KV cache) and where each segment landed.

    Attributes:
        feed: input_ids [N], position_ids [N], query_start [S+1], cache_lens [S], pad_index [S, Q],
            logit_rows [M] (all int64).
        row_start: {slot: first packed row of its segment}.
        logit_start: {slot: first row of its logits in the `logits` output}.
        num_real_tokens: rows that are not padding.
        real_rows: [num_real_tokens] int64, the packed rows that are not padding, in order.
        engines: {slot: the engine that computed its rows}, filled in by the runtime (for messages).
    """

    feed: dict[str, np.ndarray]
    row_start: dict[int, int]
    logit_start: dict[int, int]
    num_real_tokens: int
    real_rows: np.ndarray | None = None
    engines: dict[int, str] = field(default_factory=dict)


def pack_segments(segments: list[Segment], num_slots: int, cache_lens: np.ndarray, bucket: int) -> PackedBatch:
    """Pack `segments` (at most one per slot) into N = `bucket` rows.

    Args:
        segments: the step's segments; at least one non-empty.
        num_slots: S, the cache's slot count (every slot gets a query range, maybe empty).
        cache_lens: [S] int64, valid cache entries per slot (the segment's past).
        bucket: the engine's N (≥ total tokens).
    """
    by_slot = {s.slot: s for s in segments}
    lengths = np.array([len(by_slot[s].token_ids) if s in by_slot else 0 for s in range(num_slots)], np.int64)
    total = int(lengths.sum())
    if total == 0 or total > bucket:
        raise ValueError(f"pack_segments: {total} tokens do not fit bucket {bucket}")
    padded = _spread_padding(lengths, bucket - total)
    query_start = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
    ids = np.zeros(bucket, np.int64)
    pos = np.zeros(bucket, np.int64)
    real = np.zeros(bucket, bool)
    logit_rows, row_start, logit_start = [], {}, {}
    for slot in sorted(by_slot):
        seg, a = by_slot[slot], int(query_start[slot])
        q = len(seg.token_ids)
        ids[a:a + q] = seg.token_ids
        pos[a:a + q] = seg.start_position + np.arange(q)
        pos[a + q:query_start[slot + 1]] = seg.start_position + q - 1   # its padding: any position
        real[a:a + q] = True
        row_start[slot] = a
        if seg.logits != "none":
            logit_start[slot] = len(logit_rows)
            logit_rows += list(range(a, a + q)) if seg.logits == "all" else [a + q - 1]
    for slot in range(num_slots):                       # a slot with padding only: its next position
        if slot not in by_slot:
            pos[query_start[slot]:query_start[slot + 1]] = cache_lens[slot]
    width = int(padded.max())
    j = np.arange(width)[None, :]
    pad_index = np.where(j < padded[:, None], query_start[:-1, None] + j, 0).astype(np.int64)
    feed = {"input_ids": ids, "position_ids": pos, "query_start": query_start,
            "cache_lens": np.asarray(cache_lens, np.int64), "pad_index": pad_index,
            "logit_rows": np.asarray(logit_rows or [0], np.int64)}
    return PackedBatch(feed, row_start, logit_start, total, np.flatnonzero(real))


def padded_width(longest, bucket, num_slots):
    """Q, the query width every slot is padded to in `pack_segments`: max(longest segment, ⌈N / S⌉) for N =
    `bucket` rows over S = `num_slots` slots; the graph attends S × Q query rows. Works elementwise on
    numpy int arrays."""
    return np.maximum(longest, -(-np.asarray(bucket) // num_slots))


def _spread_padding(lengths: np.ndarray, pad: int) -> np.ndarray:
    """Per-slot query lengths [S] after adding `pad` padding rows: every slot is filled up to the width
    max(max(lengths), ⌈(Σ lengths + pad) / S⌉), in slot order, until the padding runs out; so no slot's
    query grows past that width."""
    width = int(padded_width(int(lengths.max()), int(lengths.sum()) + pad, len(lengths)))
    room = width - lengths
    before = np.cumsum(room) - room                   # room in the slots before each one
    return lengths + np.clip(pad - before, 0, room)
