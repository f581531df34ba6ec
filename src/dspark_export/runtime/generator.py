"""The speculative loop over an engine directory's engines, with continuous batching.

Requests are submitted at any time and admitted into KV slots. One step for the admitted requests
(paper §2, §3; DeepSpec spec §2.3-2.6):

1. draft: the drafter block engine proposes γ tokens per request (skipped by `ar`);
2. schedule: the policy picks verify lengths ℓ_r (0..γ);
3. verify: one packed target pass over [anchor, draft_1..draft_ℓ] of every decoding request plus
   prefill chunks of newly admitted ones, then the `SpeculativeVerify` engine accepts a prefix and
   draws the recovered/bonus token (and the first token of requests whose prefill just ended);
4. commit: the target KV advances by accepted+1 rows (the anchor and the accepted drafts), and their
   tapped features join the request's drafter-context backlog; rejected rows are never written; the
   recovered/bonus token is the next anchor. The backlog runs through the drafter context engine just
   before the request's next draft (or once it fills BACKLOG_CONTEXT_CALLS largest context buckets), so steps that
   skip the drafter (`ar`-like rounds of dspark-async) pay no drafter cost at all;
5. stop on EOS/stop ids, exactly max_new_tokens, or the engine's context capacity.

Host/device split: token ids, positions and caches are numpy on the host; every model computation
runs in an engine.

Where each concern lives: `Generator.speculative_step` (here) is the step itself; `batch.py` the queue,
slots and KV caches; `stages.py` each engine call with its feeds and output checks; `faults.py` the
fault-isolation wrapper around the step; `draft_control.py` whether the drafter runs (the policy's
controller).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from ..engines.engine_set import EngineSet
from ..engines.packing import Segment
from ..engines.sps import ThroughputProfile, profile_path, read_sps
from ..errors import EngineDirError, ProfileError, RequestError
from . import faults
from .batch import Batch, RequestState, finish
from .policies import Policy
from .request import GenerationResult, SamplingParams
from .stages import EngineStages, Round

log = logging.getLogger(__name__)

__all__ = ["Generator", "BACKLOG_CONTEXT_CALLS"]

BACKLOG_CONTEXT_CALLS = 4   # a backlog is flushed without a draft at this many largest drafter_context buckets


def _load_profile(engines: EngineSet) -> ThroughputProfile:
    """The engine directory's SPS(B) table (profile/sps.json), for the dspark policies."""
    manifest = engines.manifest
    path = profile_path(manifest)
    if path is None:
        raise EngineDirError(f"{manifest.root}: manifest has no profile; run `dspark-export profile`")
    try:
        return read_sps(path).throughput(exact_rows=engines.runs_exact_rows("target"))
    except ProfileError as e:
        raise EngineDirError(str(e)) from e


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
        detokenize (Callable[[list[int]], str]): token ids → text, for stop strings (`Runtime` passes
            its tokenizer's decode). Requests with stop strings are refused without it.
        drafter (Callable): replaces the DSpark drafter block: drafter(generator, active states) →
            {"draft_ids" [S, γ] int64, "draft_logits" [S, γ] × Vd float32 (Vd: the draft vocabulary, V without one), "confidence" [S, γ] float32}
            (e.g. `tests/runtime/self_draft.py`, the target drafting for itself). The DSpark
            drafter context (`draft_kv`) is not for such a drafter: its valid length may lag the target's
            (rows wait in each request's backlog until a DSpark draft flushes them).

    Thread safety: `submit` and `cancel` may be called from any thread; `step`/`generate` from one
    thread at a time.
    """

    def __init__(self, engines: EngineSet, policy: Policy, max_slots: int | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, drafter: Callable | None = None):
        rt = engines.manifest.runtime
        self.engines, self.policy = engines, policy
        self.detokenize, self.drafter = detokenize, drafter
        self.block_size = int(rt["block_size"])
        if policy.name == "fixed" and policy.k > self.block_size:
            raise RequestError(f"policy {policy}: K={policy.k} exceeds this engine directory's block size "
                               f"{self.block_size} (drafts per block); use fixed:1..fixed:{self.block_size}")
        self.max_context = int(rt["max_context"])
        self.eos_ids = frozenset(int(t) for t in rt["eos_token_ids"])
        self.vocab_size = int(rt["vocab_size"])
        self.max_tokens = engines.buckets("target")[-1]
        self.max_slots = min(max_slots or engines.buckets("drafter_block")[-1], engines.buckets("drafter_block")[-1],
                             self.max_tokens // (self.block_size + 1))
        self.batch = Batch(engines, self.max_slots, self.max_context)
        self.batch.on_resize = lambda: self.controller.reset()
        self.profile = _load_profile(engines) if policy.needs_profile else None
        self.target_kv, self.draft_kv = self.batch.target_kv, self.batch.draft_kv
        self.stages = EngineStages(engines, self.batch, self.block_size, self.vocab_size, policy.drafts,
                                   np.asarray(rt.get("confidence_temperature") or [1.0] * self.block_size, np.float32),
                                   np.asarray(engines.manifest.confidence_bias, np.float64), drafter, self)
        # a backlog this long is flushed even without a draft, so held features stay bounded (11.5 KB a row for
        # SmolLM2, a quarter of its target K/V). Why 4 context calls' worth, not 1: at C = 16 dspark-async drafts
        # nothing, and flushing every backlog that reached 256 rows cost 0.6 % of ar's throughput for drafter
        # context no draft read (reports/runtime_split/s38)
        self.backlog_limit = BACKLOG_CONTEXT_CALLS * engines.buckets("drafter_context")[-1]
        self.draft_clock = 0   # drafted steps so far; RequestState.drafted_at is the last one that drafted for it

    @property
    def profile(self) -> ThroughputProfile | None:
        """The SPS(B) table the policy prices steps with (None for policies that need none)."""
        return self._profile

    @profile.setter
    def profile(self, profile: ThroughputProfile | None) -> None:
        """Set the profile and re-derive what depends on it: the policy's draft controller (`controller`)."""
        self._profile = profile
        self._bound_profile: tuple[tuple[int, int], ThroughputProfile] | None = None  # `_step_profile`'s cache
        self.controller = self.policy.draft_controller(profile, self.block_size)

    @property
    def num_slots(self) -> int:
        return self.batch.num_slots

    @property
    def drafts_skipped(self) -> int:
        """Steps whose drafter block was skipped (dspark-async; dspark where perfect drafts cannot pay),
        for benchmarks."""
        return self.controller.drafts_skipped

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
        index = self.batch.new_id()
        result = GenerationResult()
        seed = params.seed if isinstance(params.seed, int) and params.seed >= 0 else None
        try:
            prompt = list(prompt) if not isinstance(prompt, (str, bytes)) else prompt
            prompt_ids = np.asarray(prompt, np.int64)
        except (TypeError, ValueError, OverflowError):
            prompt_ids = np.zeros(0, np.int64)
        result.stats.prompt_tokens = len(prompt_ids)
        stop_ids = frozenset(int(t) for t in params.stop_token_ids
                             if isinstance(t, (int, np.integer))) if isinstance(params.stop_token_ids, tuple) else ()
        state = RequestState(index, prompt_ids, params,
                       # a seeded request owns the stream of its seed alone (batch-independent
                       # while its verification lengths are: not under dspark's batch-wide allocation)
                       np.random.default_rng(seed if seed is not None else [np.random.SeedSequence().entropy, index]),
                       self.eos_ids | frozenset(stop_ids), result, on_token)
        self.batch.requests[index] = state
        try:
            self.check_request(prompt, params)
        except RequestError as e:
            result.finish_reason, result.error = "error", str(e)
            finish(state)
            return index
        self.batch.enqueue(state)
        return index

    def cancel(self, request_id: int) -> bool:
        """Ask to stop a request; it finishes with finish_reason "cancelled" at the next step and its
        slot is freed. Returns False if the request is unknown or already finished."""
        state = self.batch.requests.get(request_id)
        if state is None or state.done:
            return False
        self.batch.mark_cancelled(state)
        return True

    def result(self, request_id: int) -> GenerationResult:
        return self.batch.requests[request_id].result

    def release(self, request_id: int) -> GenerationResult:
        """Forget a finished request and return its result (a long-running server calls this once it
        has read a result, so finished requests do not accumulate).

        Raises:
            RequestError: the request is unknown or still running.
        """
        state = self.batch.requests.get(request_id)
        if state is None or not state.done:
            raise RequestError(f"request {request_id}: expected a finished request, found "
                               f"{'none' if state is None else 'one still running'}")
        del self.batch.requests[request_id]
        return state.result

    def has_work(self) -> bool:
        return self.batch.has_work()

    def step(self) -> None:
        """Admit waiting requests, then advance every admitted request by one step (`speculative_step`,
        inside `faults.run_isolated`: an engine fault fails only the requests it touched)."""
        self.batch.drop_cancelled()
        self.batch.release_finished()      # a cancelled request's slot goes to the next waiting one
        idle = not self.batch.active()
        self.batch.admit()
        active = self.batch.active()
        if idle and active:
            self.controller.restart()      # nothing it learnt was about these requests
        if active:
            faults.run_isolated(active, self.speculative_step, self._apply, self._fail)
        self.batch.release_finished(resize=False)   # the slot count shrinks at the next step, if nothing arrived

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_finish: Callable[[int, GenerationResult], None] | None = None) -> list[GenerationResult]:
        """Generate for every prompt (continuous batching); a bad request fails alone.

        Args:
            prompts: token ids per request.
            params: sampling parameters per request (same length as prompts).
            on_finish: called as on_finish(position, result) when a prompt finishes (progress, results
                written as they land).
        Returns:
            one GenerationResult per prompt, in order.
        """
        position: dict[int, int] = {}

        def finished(request_id, tokens, result):
            if result.finish_reason is not None and on_finish is not None:
                on_finish(position[request_id], result)

        for i, (p, sp) in enumerate(zip(prompts, params)):
            position[self.batch.next_id] = i  # the id submit is about to assign (single submitting thread)
            rid = self.submit(p, sp, finished)
            assert position.get(rid) == i
        while self.has_work():
            self.step()
        return [self.batch.requests.pop(rid).result for rid in position]

    def check_request(self, ids, p: SamplingParams) -> None:
        """Raise RequestError naming what is wrong with a request (its parameters, then its prompt)."""
        p.validate()
        if p.stop and self.detokenize is None:
            raise RequestError("stop: stop strings need a tokenizer; use Runtime, or Generator(detokenize=...)")
        if isinstance(ids, (str, bytes)) or not isinstance(ids, list) or \
                not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise RequestError(f"prompt: expected a list of token ids (integers), found {str(ids)[:60]!r}"
                               f"{' (encode text with Runtime.encode first)' if isinstance(ids, str) else ''}")
        if len(ids) == 0:
            raise RequestError("prompt: expected at least one token, found an empty prompt")
        if any((not 0 <= int(t) < self.vocab_size) for t in ids):
            raise RequestError(f"prompt: token ids must be in [0, {self.vocab_size}), found "
                               f"{[int(t) for t in ids if not 0 <= int(t) < self.vocab_size][:5]}")
        if len(ids) + 1 > self.max_context:
            raise RequestError(f"prompt: {len(ids)} tokens exceed the engine's context capacity "
                               f"{self.max_context} (prompt + at least 1 generated token)")
        bad_stops = [int(t) for t in p.stop_token_ids if not 0 <= int(t) < self.vocab_size]
        if bad_stops:
            raise RequestError(f"stop_token_ids: token ids must be in [0, {self.vocab_size}), found {bad_stops[:5]}")

    # -- one step ----------------------------------------------------------------------------
    def speculative_step(self, active: list[RequestState]) -> Round:
        """One step over the batch, computed but not applied: draft → target pass → accept → commit rows.

        Runs every engine call of the step and changes no request's state or valid cache length (only the
        requests' random streams advance; flushed drafter-context rows sit past the valid length until
        `_apply`). A request whose engine outputs fail a check leaves the round (`Round.live`) in the stage
        that checked them.
        """
        S, stages = self.num_slots, self.stages
        rnd = Round(active, np.zeros(S, np.int64))
        decoding = [s for s in active if s.decoding]
        # 1. draft γ tokens for the requests the controller picks (all, a probe's few, or none), after flushing
        #    the drafter-context backlog the draft reads
        count = self.controller.draft_count(len(decoding), S, self._step_profile()) if decoding else 0
        drafting = sorted(decoding, key=lambda s: (s.drafted_at, s.index))[:count]   # least recently drafted
        rnd.flushed = stages.flush_context(rnd, [s for s in active if s.backlog_rows and (
            s in drafting or s.backlog_rows >= self.backlog_limit)])
        decoding, drafting = rnd.live(decoding), rnd.live(drafting)
        if drafting:
            every = len(drafting) == len(decoding)     # else a block over the drafted slots' rows alone
            rnd.drafts, seconds = stages.propose(rnd, drafting, every)
            self.controller.observe_draft_time(S if every else len(drafting), seconds)
            decoding, rnd.drafted = rnd.live(decoding), rnd.live(drafting)
        rnd.conf = self._schedule(rnd, decoding)      # ℓ_r: how many of its drafts each request verifies
        # 2. one target pass: [anchor, ℓ_r drafts] per decoding request, then prefill chunks within the budget
        drafts, lens = rnd.drafts, rnd.verify_lens
        segments = [Segment(s.slot, np.concatenate([[s.anchor], drafts["draft_ids"][s.slot, :lens[s.slot]]])
                            if drafts else np.array([s.anchor]), s.start) for s in decoding]
        budget = self.max_tokens - sum(len(seg.token_ids) for seg in segments)
        for s in rnd.live([s for s in active if not s.decoding]):
            n = min(budget, len(s.prompt) - s.prefilled)
            if n <= 0:
                break
            last = s.prefilled + n == len(s.prompt)
            segments.append(Segment(s.slot, s.prompt[s.prefilled:s.prefilled + n], s.prefilled,
                                    "last" if last else "none"))
            rnd.prefill[s.slot], budget = s.prefilled + n, budget - n
            rnd.finishing += [s] if last else []
        rnd.decoding = decoding
        if not segments:
            return rnd
        packed, out, new_kv = stages.target_pass(rnd, segments)
        # 3. accept a prefix of each request's drafts and draw the next token (the first one after a prefill)
        rnd.decoding, rnd.finishing = rnd.live(rnd.decoding), rnd.live(rnd.finishing)
        at = packed.logit_start
        rows = {s.slot: out["logits"][at[s.slot]:at[s.slot] + lens[s.slot] + 1] for s in rnd.decoding}
        rows.update({s.slot: out["logits"][at[s.slot]][None] for s in rnd.finishing})
        if rows:
            rnd.num_accepted, rnd.next_ids = stages.verify(rnd, rnd.decoding + rnd.finishing, rows)
        # 4. commit: the K/V (and drafter features) of every prefill row and of anchor + accepted drafts
        keep = {seg.slot: len(seg.token_ids) for seg in segments}
        keep.update({s.slot: int(rnd.num_accepted[s.slot]) + 1 for s in rnd.live(rnd.decoding)})
        keep = {slot: n for slot, n in keep.items() if slot not in rnd.failed}
        if keep:
            rnd.commit = stages.commit_rows(packed, out, new_kv, keep)
        return rnd

    def _schedule(self, rnd: Round, decoding: list[RequestState]) -> np.ndarray | None:
        """Set the verify lengths ℓ of the decoding slots (`rnd.verify_lens`), capped so a round never passes
        max_new_tokens or the capacity; returns the confidences [R', γ] of the R' requests drafted for (None
        without drafts), which the controller learns from."""
        if not decoding or rnd.drafts is None:
            return None
        slots = np.array([s.slot for s in decoding], np.int64)
        caps = np.array([max(0, min(self.block_size,
                                    self.max_context - s.start - 1,                     # cache rows after the anchor
                                    s.params.max_new_tokens - len(s.result.token_ids) - 1))  # drafts past max are waste
                         for s in decoding], np.int64)
        drafted = [s.slot for s in rnd.drafted]
        conf = np.where(np.isin(slots, drafted)[:, None], rnd.drafts["confidence"][slots], 0)   # not drafted: 0
        lens = self.policy.verify_lengths(conf, self.block_size, self._step_profile(), self.controller.lagged(), caps)
        rnd.verify_lens[slots] = np.minimum(lens, caps)
        return rnd.drafts["confidence"][drafted] if drafted else None

    def _step_profile(self) -> ThroughputProfile | None:
        """The profile bound to this step's layout (slot count S, key entries a verification pass attends
        per slot P: `KVCache.attended`), so the policies price padded attention where the profile measured it
        (`ThroughputProfile.at`); cached per layout."""
        if self.profile is None:
            return None
        kv = self.batch.target_kv
        key = (self.num_slots, kv.attended(self.block_size + 1))
        if self._bound_profile is None or self._bound_profile[0] != key:
            self._bound_profile = (key, self.profile.at(*key))
        return self._bound_profile[1]

    def _apply(self, rnd: Round) -> None:
        """Commit a computed step: caches, prefill progress, tokens, failures."""
        for s in rnd.active:
            if s.slot in rnd.prefill and s.slot not in rnd.failed:
                s.prefilled = rnd.prefill[s.slot]
        if rnd.conf is not None:
            self.controller.observe(rnd.conf)
            self.draft_clock += 1
            for s in rnd.drafted:
                s.drafted_at = self.draft_clock
            verified = {s.slot for s in rnd.live(rnd.decoding)}
            done = np.array([s.slot for s in rnd.drafted if s.slot in verified], np.int64)
            if done.size:
                self.controller.observe_outcome(rnd.drafts["confidence"][done], rnd.verify_lens[done],
                                                rnd.num_accepted[done])
        for s in rnd.active:                  # the flushed backlog rows, written past lens in the step
            if s.slot in rnd.flushed and s.slot not in rnd.failed:
                self.batch.draft_kv.lens[s.slot] = rnd.flushed[s.slot]
                s.clear_backlog()
        if rnd.commit is not None:
            c = rnd.commit
            self.batch.target_kv.append_stacked(c.slots, c.target_kv)
            if c.backlog is not None:
                for s in rnd.active:
                    if s.slot in c.backlog:
                        s.add_backlog(*c.backlog[s.slot])
        drafts = rnd.drafts
        for s in rnd.decoding:
            if s.slot in rnd.failed:
                continue
            a, n = int(rnd.num_accepted[s.slot]), int(rnd.verify_lens[s.slot])
            s.result.stats.draft_tokens += n
            s.result.stats.accepted_tokens += a
            s.result.stats.observe_round(n, a)
            committed = [int(t) for t in drafts["draft_ids"][s.slot, :a]] if drafts else []
            self._emit(s, committed + [int(rnd.next_ids[s.slot])], rounds=1)
        for s in rnd.finishing:
            if s.slot not in rnd.failed:
                self._emit(s, [int(rnd.next_ids[s.slot])], rounds=0)
        for s in rnd.active:
            if s.slot in rnd.failed and not s.done:
                self._fail(s, rnd.failed[s.slot])

    def _fail(self, s: RequestState, reason: str) -> None:
        log.warning("request %d failed: %s", s.index, reason)
        s.result.finish_reason, s.result.error = "error", reason
        finish(s)

    def _emit(self, s: RequestState, tokens: list[int], rounds: int) -> None:
        """Append committed tokens in order, applying to each: stop ids, then stop strings, then
        max_new_tokens, then capacity; the first that triggers ends the request and drops the rest
        of the block (failure_cases.md note 4). The caches are not trimmed: a finished request's
        slot is released."""
        kept = []
        for t in tokens:
            kept.append(t)
            if t in s.stop_ids:
                s.done, s.result.finish_reason, s.result.stop_reason = True, "stop", t
                break
            if s.params.stop:
                hit = self._stop_string(s.result.token_ids + kept, s.params.stop)
                if hit is not None:
                    s.done, s.result.finish_reason, s.result.stop_reason = True, "stop", hit
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
            finish(s, kept)
        elif s.on_token:
            s.on_token(s.index, kept, s.result)

    def _stop_string(self, token_ids: list[int], stops: tuple[str, ...]) -> str | None:
        """The stop string that occurs first in the decoded output, or None. The whole output is
        decoded each time (not a tail window of tokens), so a string completed anywhere in an
        accepted block is found at the token that completes it, and a multi-byte character split
        over tokens matches only once all its bytes are committed."""
        text = self.detokenize(token_ids)
        found = [(text.find(stop), stop) for stop in stops]
        found = [f for f in found if f[0] >= 0]
        return min(found)[1] if found else None
