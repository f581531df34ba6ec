"""Self-draft: the target engine drafts for itself (drafter := target).

The cheapest detector of KV, position and mask bugs in the speculative loop (failure_cases.md note 1,
rows SD-04, SD-18, SD-19): with the target as its own drafter, every draft is the token the target
itself produces one step at a time, so in fp32 greedy every draft must be accepted. Any rejection
means the (γ+1)-row verification pass disagrees with single-token decoding: a cache that holds a
wrong or stale row, a position off by one, or a mask that shows a key it should hide.

Also a working (if slow) drafter for a target without a trained DSpark drafter: acceptance is ~100 %,
but each draft costs one target pass.
"""

from __future__ import annotations

import numpy as np

from dspark_export.engines.packing import Segment, pack_segments
from dspark_export.plugins.common.sampling import sample_from_probs, warp_probs
from dspark_export.runtime.request import GREEDY_BELOW

__all__ = ["TargetDrafter"]


class TargetDrafter:
    """Drafts γ tokens per request with γ single-token passes of the target engine.

    Pass j (j = 0..γ-1) feeds x_{j-1} (x_{-1} = the request's anchor, the last committed token) at
    absolute position start + j, over the committed target KV (`cache_lens` = committed length + j)
    plus the K/V rows of passes < j. Those rows are written in place into the generator's target KV
    buffers past each slot's valid length, as into a preallocated TensorRT cache: every later pass of
    the verifier masks entries ≥ the valid length, and the commit overwrites them with the verified
    rows (failure_cases.md SD-17). Nothing here changes a valid length.

    x_j is drawn from warp(logits_j) with the request's own temperature / top-k / top-p and a uniform
    from the request's random stream (`plugins.common.sampling`, the same warping the verifier applies), and
    draft_logits_j = logits_j, so the q the verifier uses is exactly the distribution x_j was drawn
    from (failure_cases.md SD-08, SD-09). Greedy: x_j = argmax logits_j. Confidence is 1 (0 for a
    position the request's capacity does not reach).

    Use: `Generator(engines, parse_policy("fixed:4"), drafter=TargetDrafter())`.
    """

    def __call__(self, gen, active) -> dict[str, np.ndarray]:
        """Drafts for the generator's slots.

        Args:
            gen: the `Generator` (its engines, target KV and slot layout).
            active: the decoding request states (slot, anchor, start, params, rng).
        Returns:
            {"draft_ids": [S, γ] int64, "draft_logits": [S, γ, V] float32, "confidence": [S, γ] float32}.
        Raises:
            EngineRunError: a target pass failed.
        """
        S, g, V = gen.num_slots, gen.block_size, gen.vocab_size
        ids = np.zeros((S, g), np.int64)
        logits = np.zeros((S, g, V), np.float32)
        conf = np.zeros((S, g), np.float32)
        kv = gen.target_kv
        uniforms = {s.slot: s.rng.random(g, dtype=np.float32) for s in active}
        kv.reserve(min(kv.max_capacity, max(int(kv.lens[s.slot]) + g for s in active)))
        prev = {s.slot: s.anchor for s in active}
        L = kv.num_layers
        for j in range(g):
            live = [s for s in active if s.start + j < gen.max_context]
            if not live:
                break
            cache_lens = kv.lens.copy()
            for s in live:
                cache_lens[s.slot] += j
            segments = [Segment(s.slot, np.array([prev[s.slot]], np.int64), s.start + j, "last") for s in live]
            runner = gen.engines.runner("target", len(segments))
            packed = pack_segments(segments, S, cache_lens, runner.key.bucket)
            width = packed.feed["pad_index"].shape[1]
            out = gen.stages.infer(runner, {**packed.feed, **kv.feed("past_key", "past_value", width=width)})
            for s in live:
                row, lrow = packed.row_start[s.slot], packed.logit_start[s.slot]
                pos = int(cache_lens[s.slot])
                for layer in range(L):
                    kv.keys[layer][s.slot, :, pos] = out[f"new_key.{layer}"][row]
                    kv.values[layer][s.slot, :, pos] = out[f"new_value.{layer}"][row]
                p = s.params
                row_logits = out["logits"][lrow][None]
                t = p.temperature if p.temperature >= GREEDY_BELOW else 0.0   # as Batch.sampling
                probs = warp_probs(row_logits, np.array([t], np.float32), np.array([p.top_k], np.int64),
                                   np.array([p.top_p], np.float32))
                x = int(sample_from_probs(probs, uniforms[s.slot][j:j + 1])[0])
                ids[s.slot, j], logits[s.slot, j], conf[s.slot, j] = x, row_logits[0], 1.0
                prev[s.slot] = x
        return {"draft_ids": ids, "draft_logits": logits, "confidence": conf}
