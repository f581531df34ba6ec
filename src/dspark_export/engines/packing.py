"""Packing ragged per-request segments into the target graph's inputs (docs/ARCHITECTURE.md).

A segment is the new tokens of one slot in one target pass: a prefill chunk, a decode token, or
[anchor, draft_1..draft_ℓ] for verification. Slots without a segment get an empty query.
Padding rows (to reach the engine's bucket N) are appended to the last non-empty segment: they
come after its real rows, so the causal mask keeps every real row blind to them, and their
outputs (logits, features, K/V) are never read back. That makes them inert.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Segment", "PackedBatch", "pack_segments"]


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
        num_real_tokens: rows before padding.
    """

    feed: dict[str, np.ndarray]
    row_start: dict[int, int]
    logit_start: dict[int, int]
    num_real_tokens: int


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
    last = max(s for s in range(num_slots) if lengths[s] > 0)
    lengths[last] += bucket - total
    query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.zeros(bucket, np.int64)
    pos = np.zeros(bucket, np.int64)
    logit_rows, row_start, logit_start = [], {}, {}
    for slot in sorted(by_slot):
        seg, a = by_slot[slot], int(query_start[slot])
        q = len(seg.token_ids)
        ids[a:a + q] = seg.token_ids
        pos[a:a + q] = seg.start_position + np.arange(q)
        row_start[slot] = a
        if seg.logits != "none":
            logit_start[slot] = len(logit_rows)
            logit_rows += list(range(a, a + q)) if seg.logits == "all" else [a + q - 1]
    real_end = int(query_start[last]) + len(by_slot[last].token_ids)
    pos[real_end:] = pos[real_end - 1]  # padding rows: any position; they are never read back
    width = int(lengths.max())
    j = np.arange(width)[None, :]
    pad_index = np.where(j < lengths[:, None], query_start[:-1, None] + j, 0).astype(np.int64)
    feed = {"input_ids": ids, "position_ids": pos, "query_start": query_start,
            "cache_lens": np.asarray(cache_lens, np.int64), "pad_index": pad_index,
            "logit_rows": np.asarray(logit_rows or [0], np.int64)}
    return PackedBatch(feed, row_start, logit_start, total)
