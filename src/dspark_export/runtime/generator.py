"""The speculative loop over an engine directory's engines (batch of requests, one slot each).

One step for the active requests (paper §2, §3; DeepSpec spec §2.3-2.6):

1. draft: the drafter block engine proposes γ tokens per request (skipped by `ar`);
2. schedule: the policy picks verify lengths ℓ_r (0..γ);
3. verify: one packed target pass over [anchor, draft_1..draft_ℓ] of every request, then the
   `SpeculativeVerify` engine accepts a prefix and draws the recovered/bonus token;
4. commit: the target KV and the drafter context advance by accepted+1 rows (the anchor and the
   accepted drafts); rejected rows are never written; the recovered/bonus token is the next anchor;
5. stop on EOS/stop ids, exactly max_new_tokens, or the engine's context capacity.

Host/device split: token ids, positions and caches are numpy on the host; every model computation
runs in an engine.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..engines.engine_set import EngineSet
from ..errors import EngineDirError, RequestError
from .kv_cache import KVCache
from ..engines.packing import Segment, pack_segments
from .policies import Policy
from .scheduler import ThroughputProfile
from .request import GenerationResult, SamplingParams

log = logging.getLogger(__name__)

__all__ = ["Generator"]


def _load_profile(engines: EngineSet) -> ThroughputProfile:
    """The engine directory's SPS(B) table (profile/sps.json), for the dspark policies."""
    manifest = engines.manifest
    rel = manifest.data.get("profile", {}).get("path")
    if not rel:
        raise EngineDirError(f"{manifest.root}: manifest has no profile; run `dspark-export profile`")
    try:
        return ThroughputProfile.from_json(json.loads(manifest.path_of(rel, "profile.path").read_text()))
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise EngineDirError(f"{manifest.root / rel}: unreadable throughput profile ({e})") from e


@dataclass
class _State:
    """One active request in a slot."""

    index: int
    slot: int
    prompt: np.ndarray
    params: SamplingParams
    rng: np.random.Generator
    stop_ids: frozenset
    result: GenerationResult
    prefilled: int = 0
    anchor: int = -1          # last committed token, not yet run through the target
    done: bool = False
    t0: float = field(default_factory=time.perf_counter)

    @property
    def start(self) -> int:
        """Absolute position of the anchor (= committed target KV length)."""
        return len(self.prompt) + len(self.result.token_ids) - 1


class Generator:
    """Runs DSpark speculative decoding over the engines of one engine directory.

    Args:
        engines (EngineSet): the loaded engines.
        policy (Policy): verification-length policy.
    """

    def __init__(self, engines: EngineSet, policy: Policy):
        rt = engines.manifest.runtime
        self.engines, self.policy = engines, policy
        self.block_size = int(rt["block_size"])
        if policy.name == "fixed" and policy.k > self.block_size:
            raise RequestError(f"policy {policy}: K={policy.k} exceeds this engine directory's block size "
                               f"{self.block_size} (drafts per block); use fixed:1..fixed:{self.block_size}")
        self.max_context = int(rt["max_context"])
        self.eos_ids = frozenset(int(t) for t in rt["eos_token_ids"])
        self.vocab_size = int(rt["vocab_size"])
        self.sts = np.asarray(rt.get("confidence_temperature") or [1.0] * self.block_size, np.float32)
        self.max_tokens = engines.buckets("target")[-1]
        self.profile = _load_profile(engines) if policy.needs_profile else None
        self._history: list[np.ndarray] = []  # confidences of the last two steps (dspark-async)

    # -- public ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_finish: Callable[[int], None] | None = None) -> list[GenerationResult]:
        """Generate for every prompt; a bad request fails alone (finish_reason "error").

        Args:
            prompts: token ids per request.
            params: sampling parameters per request (same length as prompts).
            on_finish: called with a request's index when it finishes (progress reporting).
        Returns:
            one GenerationResult per prompt, in order.
        """
        self._on_finish = on_finish or (lambda index: None)
        results = [GenerationResult() for _ in prompts]
        ok = []
        for i, (ids, p) in enumerate(zip(prompts, params)):
            try:
                self._check_request(ids, p)
                ok.append(i)
            except RequestError as e:
                results[i].finish_reason, results[i].error = "error", str(e)
                results[i].stats.prompt_tokens = len(ids)
                self._on_finish(i)
        wave = self.engines.buckets("drafter_block")[-1]
        for w in range(0, len(ok), wave):
            self._run_wave([(i, prompts[i], params[i], results[i]) for i in ok[w:w + wave]])
        return results

    # -- setup -------------------------------------------------------------------------------
    def _check_request(self, ids, p: SamplingParams) -> None:
        p.validate()
        if len(ids) == 0:
            raise RequestError("prompt: expected at least one token, found an empty prompt")
        if any((not 0 <= int(t) < self.vocab_size) for t in ids):
            raise RequestError(f"prompt: token ids must be in [0, {self.vocab_size}), found "
                               f"{[int(t) for t in ids if not 0 <= int(t) < self.vocab_size][:5]}")
        if len(ids) + 1 > self.max_context:
            raise RequestError(f"prompt: {len(ids)} tokens exceed the engine's context capacity "
                               f"{self.max_context} (prompt + at least 1 generated token)")

    def _run_wave(self, items) -> None:
        num_slots = self.engines.bucket_for("drafter_block", len(items))
        m = self.engines.manifest.data
        tg, dg = m["graphs"]["target"]["spec"], m["graphs"]["drafter_block"]["spec"]
        start_cap = min(self.max_context, max(256, max(len(p) for _, p, _, _ in items) + 64))
        self.target_kv = KVCache(tg["num_layers"], num_slots, tg["num_kv_heads"], tg["head_dim"],
                                 self.max_context, start_cap)
        self.draft_kv = KVCache(dg["num_layers"], num_slots, dg["num_kv_heads"], dg["head_dim"],
                                self.max_context, start_cap)
        self.num_slots = num_slots
        states = []
        for slot, (i, ids, p, res) in enumerate(items):
            seed = p.seed if p.seed is not None else np.random.SeedSequence().entropy
            res.stats.prompt_tokens = len(ids)
            states.append(_State(i, slot, np.asarray(ids, np.int64), p, np.random.default_rng([seed, i]),
                                 self.eos_ids | frozenset(p.stop_token_ids), res))
        self._history = []
        self._prefill(states)
        while active := [s for s in states if not s.done]:
            self._step(active)
        del self.target_kv, self.draft_kv

    # -- prefill -----------------------------------------------------------------------------
    def _prefill(self, states: list[_State]) -> None:
        """Run prompts through the target in packed chunks, then sample each first token."""
        pending = list(states)
        while pending:
            budget, segments, finishing = self.max_tokens, [], []
            for s in pending:
                if budget == 0:
                    break
                n = min(budget, len(s.prompt) - s.prefilled)
                last = s.prefilled + n == len(s.prompt)
                segments.append(Segment(s.slot, s.prompt[s.prefilled:s.prefilled + n], s.prefilled,
                                        "last" if last else "none"))
                s.prefilled += n
                budget -= n
                if last:
                    finishing.append(s)
            packed, out = self._target_pass(segments)
            self._commit(packed, out, {seg.slot: len(seg.token_ids) for seg in segments})
            if finishing:
                rows = {s.slot: out["logits"][packed.logit_start[s.slot]][None] for s in finishing}
                _, next_ids = self._verify(finishing, rows, None, {s.slot: 0 for s in finishing})
                for s in finishing:
                    self._emit(s, [int(next_ids[s.slot])], rounds=0)
            pending = [s for s in pending if s.prefilled < len(s.prompt)]

    # -- one speculative step ----------------------------------------------------------------
    def _step(self, active: list[_State]) -> None:
        drafts = self._draft(active) if self.policy.drafts else None
        slots = np.array([s.slot for s in active], np.int64)
        caps = np.array([max(0, min(self.block_size,
                                    self.max_context - s.start - 1,                     # cache rows after the anchor
                                    s.params.max_new_tokens - len(s.result.token_ids) - 1))  # drafts past max are waste
                         for s in active], np.int64)
        if drafts is None:
            lens = np.zeros(len(active), np.int64)
        else:
            conf = drafts["confidence"][slots]
            lens = self.policy.verify_lengths(conf, self.block_size, self.profile,
                                              self._history[0] if len(self._history) == 2 else None, caps)
            self._history = (self._history + [conf])[-2:]
        verify_lens = {int(slot): int(n) for slot, n in zip(slots, np.minimum(lens, caps))}
        segments = [Segment(s.slot, np.concatenate([[s.anchor], drafts["draft_ids"][s.slot, :verify_lens[s.slot]]])
                            if drafts else np.array([s.anchor]), s.start) for s in active]
        packed, out = self._target_pass(segments)
        rows = {s.slot: out["logits"][packed.logit_start[s.slot]:packed.logit_start[s.slot] + verify_lens[s.slot] + 1]
                for s in active}
        num_accepted, next_ids = self._verify(active, rows, drafts, verify_lens)
        self._commit(packed, out, {s.slot: int(num_accepted[s.slot]) + 1 for s in active})
        for s in active:
            a = int(num_accepted[s.slot])
            s.result.stats.draft_tokens += verify_lens[s.slot]
            s.result.stats.accepted_tokens += a
            committed = [int(t) for t in drafts["draft_ids"][s.slot, :a]] if drafts else []
            self._emit(s, committed + [int(next_ids[s.slot])], rounds=1)

    def _emit(self, s: _State, tokens: list[int], rounds: int) -> None:
        """Append committed tokens, applying stop ids, max_new_tokens and capacity in order."""
        kept = []
        for t in tokens:
            kept.append(t)
            if t in s.stop_ids:
                s.done, s.result.finish_reason = True, "stop"
                break
            if len(s.result.token_ids) + len(kept) >= s.params.max_new_tokens:
                s.done, s.result.finish_reason = True, "length"
                break
        s.result.token_ids += kept
        s.anchor = kept[-1]
        st = s.result.stats
        st.rounds += rounds
        st.committed_in_rounds += len(kept) * rounds
        st.completion_tokens = len(s.result.token_ids)
        if not s.done and s.start >= self.max_context:
            s.done, s.result.finish_reason = True, "capacity"
        if s.done:
            st.wall_s = time.perf_counter() - s.t0
            self._on_finish(s.index)

    # -- engine calls ------------------------------------------------------------------------
    def _target_pass(self, segments: list[Segment]):
        total = sum(len(seg.token_ids) for seg in segments)
        runner = self.engines.runner("target", total)
        packed = pack_segments(segments, self.num_slots, self.target_kv.lens, runner.key.bucket)
        for seg in segments:
            self.target_kv.reserve(int(self.target_kv.lens[seg.slot]) + len(seg.token_ids))
        feed = {**packed.feed, **self.target_kv.feed("past_key", "past_value")}
        return packed, runner.infer(feed)

    def _commit(self, packed, out: dict, keep: dict[int, int]) -> None:
        """Write the first keep[slot] rows of each slot's segment into the target KV and the
        drafter context (features of committed rows only; DeepSpec spec §5.2 pitfall 2)."""
        slots = np.concatenate([np.full(n, slot, np.int64) for slot, n in sorted(keep.items())])
        rows = np.concatenate([packed.row_start[slot] + np.arange(n) for slot, n in sorted(keep.items())])
        positions = self.target_kv.lens[slots] + np.concatenate([np.arange(n) for _, n in sorted(keep.items())])
        L = self.target_kv.num_layers
        self.target_kv.append(slots, [out[f"new_key.{i}"] for i in range(L)],
                              [out[f"new_value.{i}"] for i in range(L)], rows)
        if self.policy.drafts:
            self._extend_context(out["aux_hidden"][rows], positions, slots)

    def _extend_context(self, aux: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        step = self.engines.buckets("drafter_context")[-1]
        for a in range(0, len(aux), step):
            n = min(step, len(aux) - a)
            runner = self.engines.runner("drafter_context", n)
            b = runner.key.bucket
            feed_aux = np.zeros((b, aux.shape[1]), np.float32)
            feed_aux[:n] = aux[a:a + n]
            feed_pos = np.zeros(b, np.int64)
            feed_pos[:n] = positions[a:a + n]
            out = runner.infer({"aux_hidden": feed_aux, "position_ids": feed_pos})
            L = self.draft_kv.num_layers
            self.draft_kv.append(slots[a:a + n], [out[f"context_key.{i}"] for i in range(L)],
                                 [out[f"context_value.{i}"] for i in range(L)], np.arange(n))

    def _sampling_feed(self, states: list[_State]) -> dict[str, np.ndarray]:
        temp = np.zeros(self.num_slots, np.float32)
        top_k = np.zeros(self.num_slots, np.int64)
        top_p = np.ones(self.num_slots, np.float32)
        for s in states:
            temp[s.slot], top_k[s.slot], top_p[s.slot] = s.params.temperature, s.params.top_k, s.params.top_p
        return {"temperature": temp, "top_k": top_k, "top_p": top_p}

    def _draft(self, active: list[_State]) -> dict[str, np.ndarray]:
        anchors = np.zeros(self.num_slots, np.int64)
        starts = np.zeros(self.num_slots, np.int64)
        uniforms = np.zeros((self.num_slots, self.block_size), np.float32)
        for s in active:
            anchors[s.slot], starts[s.slot] = s.anchor, s.start
            uniforms[s.slot] = s.rng.random(self.block_size, dtype=np.float32)
        feed = {"anchor_ids": anchors, "start_positions": starts, "context_lens": self.draft_kv.lens.copy(),
                **self.draft_kv.feed("context_key", "context_value"), **self._sampling_feed(active),
                "uniforms": uniforms, "confidence_temperature": self.sts}
        return self.engines.runner("drafter_block", self.num_slots).infer(feed)

    def _verify(self, states: list[_State], rows: dict[int, np.ndarray], drafts, verify_lens: dict[int, int]):
        """SpeculativeVerify over all slots (slots without rows get one inert zero row)."""
        V, g = self.vocab_size, self.block_size
        blocks = [rows.get(slot, np.zeros((1, V), np.float32)) for slot in range(self.num_slots)]
        lens = np.array([verify_lens.get(slot, 0) for slot in range(self.num_slots)], np.int64)
        uniforms = np.zeros((self.num_slots, g + 1), np.float32)
        for s in states:
            uniforms[s.slot] = s.rng.random(g + 1, dtype=np.float32)
        feed = {"target_logits": np.concatenate(blocks).astype(np.float32, copy=False),
                "query_start": np.concatenate([[0], np.cumsum(lens + 1)]).astype(np.int64),
                "draft_ids": drafts["draft_ids"] if drafts else np.zeros((self.num_slots, g), np.int64),
                "draft_logits": drafts["draft_logits"] if drafts else self._zero_draft_logits(),
                "verify_lens": lens, **self._sampling_feed(states), "uniforms": uniforms}
        out = self.engines.runner("verify", self.num_slots).infer(feed)
        return out["num_accepted"], out["next_ids"]

    def _zero_draft_logits(self) -> np.ndarray:
        if getattr(self, "_zeros", None) is None or self._zeros.shape[0] != self.num_slots:
            self._zeros = np.zeros((self.num_slots, self.block_size, self.vocab_size), np.float32)
        return self._zeros
