"""The speculative loop over an engine directory's engines, with continuous batching.

Requests are submitted at any time and admitted into KV slots. One step for the admitted requests
(paper §2, §3; DeepSpec spec §2.3-2.6):

1. draft: the drafter block engine proposes γ tokens per request (skipped by `ar`);
2. schedule: the policy picks verify lengths ℓ_r (0..γ);
3. verify: one packed target pass over [anchor, draft_1..draft_ℓ] of every decoding request plus
   prefill chunks of newly admitted ones, then the `SpeculativeVerify` engine accepts a prefix and
   draws the recovered/bonus token (and the first token of requests whose prefill just ended);
4. commit: the target KV and the drafter context advance by accepted+1 rows (the anchor and the
   accepted drafts); rejected rows are never written; the recovered/bonus token is the next anchor;
5. stop on EOS/stop ids, exactly max_new_tokens, or the engine's context capacity.

Host/device split: token ids, positions and caches are numpy on the host; every model computation
runs in an engine.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..engines.engine_set import EngineSet
from ..engines.packing import Segment, pack_segments
from ..errors import EngineDirError, RequestError
from .kv_cache import KVCache
from .policies import Policy
from .request import GenerationResult, SamplingParams
from .scheduler import ThroughputProfile, dspark_async_capacity

log = logging.getLogger(__name__)

__all__ = ["Generator"]

_MIN_PROBE_INTERVAL, _MAX_PROBE_INTERVAL = 4, 64  # dspark-async: skipped steps between drafter probes


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
    """One request: waiting, prefilling, decoding or finished."""

    index: int
    prompt: np.ndarray
    params: SamplingParams
    rng: np.random.Generator
    stop_ids: frozenset
    result: GenerationResult
    on_token: Callable | None = None
    slot: int = -1
    prefilled: int = 0
    anchor: int = -1          # last committed token, not yet run through the target
    done: bool = False
    cancelled: bool = False
    t0: float = field(default_factory=time.perf_counter)

    @property
    def start(self) -> int:
        """Absolute position of the anchor (= committed target KV length)."""
        return len(self.prompt) + len(self.result.token_ids) - 1

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)


class Generator:
    """Continuous batching of DSpark speculative decoding over one engine directory's engines.

    Requests are submitted at any time (`submit`), admitted into KV-cache slots as slots free up,
    and advanced together by `step`: one step drafts for every decoding request, then runs ONE
    packed target pass carrying every request's verification rows plus prefill chunks of newly
    admitted requests, then verifies and commits. Each request's output equals its solo run
    (greedy). The slot count follows the request-count buckets (grows and compacts at bucket
    boundaries), so a lone request runs the R=1 engines.

    Args:
        engines (EngineSet): the loaded engines.
        policy (Policy): verification-length policy.
        max_slots (int): requests decoded at once; defaults to the largest drafter bucket.

    Thread safety: `submit` and `cancel` may be called from any thread; `step`/`generate` from one
    thread at a time.
    """

    def __init__(self, engines: EngineSet, policy: Policy, max_slots: int | None = None):
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
        self.max_slots = min(max_slots or engines.buckets("drafter_block")[-1], engines.buckets("drafter_block")[-1],
                             self.max_tokens // (self.block_size + 1))
        self.profile = _load_profile(engines) if policy.needs_profile else None
        self._history: list[np.ndarray] = []  # confidences of the last two steps (dspark-async)
        self._skipped, self._probe_interval = 0, _MIN_PROBE_INTERVAL  # dspark-async drafter skipping
        self.drafts_skipped = 0  # steps whose drafter block was skipped (dspark-async), for benchmarks
        self._lock = threading.Lock()
        self._waiting: deque[_State] = deque()
        self._slots: list[_State | None] = []
        self._requests: dict[int, _State] = {}
        self._next_id = 0
        m = engines.manifest.data
        tg, dg = m["graphs"]["target"]["spec"], m["graphs"]["drafter_block"]["spec"]
        self.target_kv = KVCache(tg["num_layers"], 0, tg["num_kv_heads"], tg["head_dim"], self.max_context, 256)
        self.draft_kv = KVCache(dg["num_layers"], 0, dg["num_kv_heads"], dg["head_dim"], self.max_context, 256)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    # -- public ------------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, on_token: Callable | None = None) -> int:
        """Queue a request; returns its id. An invalid request is finished at once with
        finish_reason "error" (its result says why) and never disturbs the others.

        Args:
            prompt: token ids.
            params: sampling parameters.
            on_token: called as on_token(request_id, new_token_ids, result) after each step that
                commits tokens for this request (streaming); `result.finish_reason` is set when done.
        """
        with self._lock:
            index, self._next_id = self._next_id, self._next_id + 1
        result = GenerationResult()
        result.stats.prompt_tokens = len(prompt)
        seed = params.seed if isinstance(params.seed, int) and params.seed >= 0 else None
        state = _State(index, np.asarray(list(prompt), np.int64), params,
                       np.random.default_rng([seed if seed is not None else np.random.SeedSequence().entropy, index]),
                       self.eos_ids | frozenset(params.stop_token_ids), result, on_token)
        self._requests[index] = state
        try:
            self._check_request(prompt, params)
        except RequestError as e:
            result.finish_reason, result.error = "error", str(e)
            self._finish(state)
            return index
        with self._lock:
            self._waiting.append(state)
        return index

    def cancel(self, request_id: int) -> bool:
        """Ask to stop a request; it finishes with finish_reason "cancelled" at the next step and its
        slot is freed. Returns False if the request is unknown or already finished."""
        state = self._requests.get(request_id)
        if state is None or state.done:
            return False
        state.cancelled = True
        return True

    def result(self, request_id: int) -> GenerationResult:
        return self._requests[request_id].result

    def has_work(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    def step(self) -> None:
        """Admit waiting requests, then advance every admitted request by one step."""
        self._drop_cancelled()
        self._release_finished()      # a cancelled request's slot goes to the next waiting one
        self._admit()
        active = [s for s in self._slots if s is not None]
        if active:
            self._step(active)
        self._release_finished()

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_finish: Callable[[int], None] | None = None) -> list[GenerationResult]:
        """Generate for every prompt (continuous batching); a bad request fails alone.

        Args:
            prompts: token ids per request.
            params: sampling parameters per request (same length as prompts).
            on_finish: called with the prompt's position when it finishes (progress reporting).
        Returns:
            one GenerationResult per prompt, in order.
        """
        position: dict[int, int] = {}

        def finished(request_id, tokens, result):
            if result.finish_reason is not None and on_finish is not None:
                on_finish(position[request_id])

        for i, (p, sp) in enumerate(zip(prompts, params)):
            position[self._next_id] = i  # the id submit is about to assign (single submitting thread)
            rid = self.submit(p, sp, finished)
            assert position.get(rid) == i
        while self.has_work():
            self.step()
        return [self._requests.pop(rid).result for rid in position]

    # -- admission and slots -----------------------------------------------------------------
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

    def _admit(self) -> None:
        with self._lock:
            while self._waiting and sum(s is not None for s in self._slots) < self.max_slots:
                state = self._waiting.popleft()
                if None not in self._slots:
                    self._resize(len(self._slots) + 1)
                state.slot = self._slots.index(None)
                self._slots[state.slot] = state
                state.t0 = time.perf_counter()

    def _resize(self, needed: int) -> None:
        """Move live requests into the smallest slot bucket ≥ `needed` (compacting them in order)."""
        size = self.engines.bucket_for("drafter_block", max(1, needed))
        live = [s for s in self._slots if s is not None]
        moves = {s.slot: new for new, s in enumerate(live)}
        self.target_kv.remap(size, moves)
        self.draft_kv.remap(size, moves)
        self._slots = live + [None] * (size - len(live))
        for new, s in enumerate(live):
            s.slot = new
        self._history = []  # rows of lagged confidences no longer line up with requests

    def _drop_cancelled(self) -> None:
        for s in [s for s in self._slots if s is not None and s.cancelled and not s.done] + \
                 [s for s in list(self._waiting) if s.cancelled]:
            s.result.finish_reason = "cancelled"
            self._finish(s)
        with self._lock:
            self._waiting = deque(s for s in self._waiting if not s.done)

    def _release_finished(self) -> None:
        for i, s in enumerate(self._slots):
            if s is not None and s.done:
                self._slots[i] = None
                self.target_kv.reset(i)
                self.draft_kv.reset(i)
        live = sum(s is not None for s in self._slots)
        if self._slots and self.engines.bucket_for("drafter_block", max(1, live)) < len(self._slots) \
                and not self._waiting:
            self._resize(live)

    def _finish(self, s: _State, tokens: list[int] | None = None) -> None:
        s.done = True
        s.result.stats.wall_s = time.perf_counter() - s.t0
        if s.on_token:
            s.on_token(s.index, tokens or [], s.result)

    # -- one step ----------------------------------------------------------------------------
    def _step(self, active: list[_State]) -> None:
        """Draft → schedule → one packed target pass (verification rows + prefill chunks) → verify → commit."""
        decoding = [s for s in active if s.decoding]
        drafts = self._draft(decoding) if self.policy.drafts and decoding and not self._skip_drafting(decoding) \
            else None
        verify_lens = self._schedule(decoding, drafts)
        segments = [Segment(s.slot, np.concatenate([[s.anchor], drafts["draft_ids"][s.slot, :verify_lens[s.slot]]])
                            if drafts else np.array([s.anchor]), s.start) for s in decoding]
        budget = self.max_tokens - sum(len(seg.token_ids) for seg in segments)
        finishing = []
        for s in [s for s in active if not s.decoding]:
            n = min(budget, len(s.prompt) - s.prefilled)
            if n <= 0:
                break
            last = s.prefilled + n == len(s.prompt)
            segments.append(Segment(s.slot, s.prompt[s.prefilled:s.prefilled + n], s.prefilled,
                                    "last" if last else "none"))
            s.prefilled, budget = s.prefilled + n, budget - n
            finishing += [s] if last else []
        packed, out = self._target_pass(segments)
        rows = {s.slot: out["logits"][packed.logit_start[s.slot]:packed.logit_start[s.slot] + verify_lens[s.slot] + 1]
                for s in decoding}
        rows.update({s.slot: out["logits"][packed.logit_start[s.slot]][None] for s in finishing})
        verify_lens.update({s.slot: 0 for s in finishing})
        num_accepted, next_ids = self._verify(decoding + finishing, rows, drafts, verify_lens)
        keep = {seg.slot: len(seg.token_ids) for seg in segments}          # prefill chunks: every row
        keep.update({s.slot: int(num_accepted[s.slot]) + 1 for s in decoding})  # anchor + accepted drafts
        self._commit(packed, out, keep)
        for s in decoding:
            a = int(num_accepted[s.slot])
            s.result.stats.draft_tokens += verify_lens[s.slot]
            s.result.stats.accepted_tokens += a
            s.result.stats.observe_round(verify_lens[s.slot], a)
            committed = [int(t) for t in drafts["draft_ids"][s.slot, :a]] if drafts else []
            self._emit(s, committed + [int(next_ids[s.slot])], rounds=1)
        for s in finishing:
            self._emit(s, [int(next_ids[s.slot])], rounds=0)

    def _skip_drafting(self, decoding: list[_State]) -> bool:
        """dspark-async with a known drafter cost: skip the drafter block when the capacity K* from earlier
        confidences is 0 (nothing would be verified, `scheduler.dspark_async_capacity`).

        Skipping gives no new confidences, so every `probe_interval` skipped steps the history is cleared:
        the next steps draft again (Algorithm 1 on fresh confidences, then K* from them). The interval
        doubles after each probe that ends in another skip (4, 8, ..., 64 steps) and drops back to 4 when
        drafting pays again. The drafter context keeps growing with every committed token either way
        (`_commit`), so a skipped block never leaves the drafter state stale (failure case SD-20).
        """
        if self.policy.name != "dspark-async" or self.profile is None or not self.profile.has_draft_cost \
                or len(self._history) < 2:
            return False
        if self._skipped >= self._probe_interval:
            self._history, self._skipped = [], 0
            self._probe_interval = min(2 * self._probe_interval, _MAX_PROBE_INTERVAL)
            return False
        if dspark_async_capacity(self._history[0], len(decoding), self.profile) > 0:
            self._probe_interval = _MIN_PROBE_INTERVAL
            return False
        self._skipped += 1
        self.drafts_skipped += 1
        return True

    def _schedule(self, decoding: list[_State], drafts) -> dict[int, int]:
        """Verify lengths ℓ per decoding slot, capped so a round never passes max_new_tokens or capacity."""
        if not decoding:
            return {}
        slots = np.array([s.slot for s in decoding], np.int64)
        caps = np.array([max(0, min(self.block_size,
                                    self.max_context - s.start - 1,                     # cache rows after the anchor
                                    s.params.max_new_tokens - len(s.result.token_ids) - 1))  # drafts past max are waste
                         for s in decoding], np.int64)
        if drafts is None:
            return {int(slot): 0 for slot in slots}
        conf = drafts["confidence"][slots]
        lag = self._history[0] if len(self._history) == 2 else None
        lens = self.policy.verify_lengths(conf, self.block_size, self.profile, lag, caps)
        self._history = (self._history + [conf])[-2:]
        return {int(slot): int(n) for slot, n in zip(slots, np.minimum(lens, caps))}

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
            self._finish(s, kept)
        elif s.on_token:
            s.on_token(s.index, kept, s.result)

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
