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
   before the request's next draft (or once it reaches the largest context bucket), so steps that
   skip the drafter (`ar`-like rounds of dspark-async) pay no drafter cost at all;
5. stop on EOS/stop ids, exactly max_new_tokens, or the engine's context capacity.

Host/device split: token ids, positions and caches are numpy on the host; every model computation
runs in an engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..engines.engine_set import EngineSet
from ..engines.packing import PackedBatch, Segment, pack_segments
from ..engines.sps import ThroughputProfile, profile_path, read_sps
from ..errors import EngineDirError, EngineRunError, ProfileError, RequestError
from .kv_cache import KVCache
from .policies import Policy
from .request import GREEDY_BELOW, GenerationResult, SamplingParams
from .scheduler import mean_survival_capacity, survival_probs

log = logging.getLogger(__name__)

__all__ = ["Generator"]

_MIN_PROBE_INTERVAL, _MAX_PROBE_INTERVAL = 4, 64  # dspark-async: skipped steps between drafter probes
_SURVIVAL_EMA = 0.25   # dspark-async skip decision: least weight of the newest drafted step in the mean
_PROBE_STEPS = 2       # dspark-async: drafted steps per probe (the mean restarts from them)
_SKIP_MARGIN = 0.2     # dspark-async: draft only when the expected throughput gain is at least this fraction
_PROBE_OVERHEAD = 0.05  # dspark-async: probes' drafter time, at most this fraction of the skipped steps' time
_FLOOR_CAP = 10**6     # the most skipped steps `_probe_floor` asks for


def _load_profile(engines: EngineSet) -> ThroughputProfile:
    """The engine directory's SPS(B) table (profile/sps.json), for the dspark policies."""
    manifest = engines.manifest
    path = profile_path(manifest)
    if path is None:
        raise EngineDirError(f"{manifest.root}: manifest has no profile; run `dspark-export profile`")
    try:
        return read_sps(path).throughput()
    except ProfileError as e:
        raise EngineDirError(str(e)) from e


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
    # drafter-context backlog: tapped features [n, F] float32 and positions [n] int64 of committed rows
    # not yet run through `drafter_context` (draft_kv.lens + backlog_rows == target_kv.lens)
    backlog: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    @property
    def backlog_rows(self) -> int:
        return sum(len(p) for _, p in self.backlog)

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
        detokenize (Callable[[list[int]], str]): token ids → text, for stop strings (`Runtime` passes
            its tokenizer's decode). Requests with stop strings are refused without it.
        drafter (Callable): replaces the DSpark drafter block: drafter(generator, active states) →
            {"draft_ids" [S, γ] int64, "draft_logits" [S, γ] × V float32, "confidence" [S, γ] float32}
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
        self._last_key: dict[str, str] = {}   # graph -> path of the engine last called (for messages)
        self.block_size = int(rt["block_size"])
        if policy.name == "fixed" and policy.k > self.block_size:
            raise RequestError(f"policy {policy}: K={policy.k} exceeds this engine directory's block size "
                               f"{self.block_size} (drafts per block); use fixed:1..fixed:{self.block_size}")
        self.max_context = int(rt["max_context"])
        self.eos_ids = frozenset(int(t) for t in rt["eos_token_ids"])
        self.vocab_size = int(rt["vocab_size"])
        self.sts = np.asarray(rt.get("confidence_temperature") or [1.0] * self.block_size, np.float32)
        # per-position calibration bias b_k (training.calibration), applied to the drafter block's
        # confidence σ(z/T): σ(logit(c) + b); older manifests have none (all 0)
        self.confidence_bias = np.asarray(engines.manifest.confidence_bias, np.float64)
        self.max_tokens = engines.buckets("target")[-1]
        self.max_slots = min(max_slots or engines.buckets("drafter_block")[-1], engines.buckets("drafter_block")[-1],
                             self.max_tokens // (self.block_size + 1))
        self.profile = _load_profile(engines) if policy.needs_profile else None
        self._bound_profile: tuple[tuple[int, int], ThroughputProfile] | None = None  # `_step_profile`'s cache
        self._draft_wall: dict[int, float] = {}  # slots S -> running mean of the drafter block's wall time, s
        self._history: list[np.ndarray] = []  # confidences of the last two steps (dspark-async)
        self._skipped, self._probe_interval = 0, _MIN_PROBE_INTERVAL  # dspark-async drafter skipping
        self._probe_left = 0  # drafted steps left in the current probe
        # [γ] running mean over drafted steps of the request-averaged survival, and the steps in it since
        # the last probe (the newest weighs max(1/n, _SURVIVAL_EMA))
        self._survival_mean: np.ndarray | None = None
        self._survival_n = 0
        self.drafts_skipped = 0  # steps whose drafter block was skipped (dspark-async), for benchmarks
        self._lock = threading.Lock()
        self._waiting: deque[_State] = deque()
        self._cancel_marked: list[_State] = []
        self._slots: list[_State | None] = []
        self._requests: dict[int, _State] = {}
        self._next_id = 0
        m = engines.manifest.data
        tg, dg = m["graphs"]["target"]["spec"], m["graphs"]["drafter_block"]["spec"]
        self.target_kv = KVCache(tg["num_layers"], 0, tg["num_kv_heads"], tg["head_dim"], self.max_context, 256)
        self.draft_kv = KVCache(dg["num_layers"], 0, dg["num_kv_heads"], dg["head_dim"], self.max_context, 256)
        # a backlog this long is flushed even without a draft: one full context call, bounded memory
        self.backlog_limit = engines.buckets("drafter_context")[-1]

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
        seed = params.seed if isinstance(params.seed, int) and params.seed >= 0 else None
        try:
            prompt = list(prompt) if not isinstance(prompt, (str, bytes)) else prompt
            prompt_ids = np.asarray(prompt, np.int64)
        except (TypeError, ValueError, OverflowError):
            prompt_ids = np.zeros(0, np.int64)
        result.stats.prompt_tokens = len(prompt_ids)
        stop_ids = frozenset(int(t) for t in params.stop_token_ids
                             if isinstance(t, (int, np.integer))) if isinstance(params.stop_token_ids, tuple) else ()
        state = _State(index, prompt_ids, params,
                       # a seeded request owns the stream of its seed alone, so it reproduces in any batch
                       np.random.default_rng(seed if seed is not None else [np.random.SeedSequence().entropy, index]),
                       self.eos_ids | frozenset(stop_ids), result, on_token)
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
        with self._lock:
            state.cancelled = True
            self._cancel_marked.append(state)
        return True

    def result(self, request_id: int) -> GenerationResult:
        return self._requests[request_id].result

    def release(self, request_id: int) -> GenerationResult:
        """Forget a finished request and return its result (a long-running server calls this once it
        has read a result, so finished requests do not accumulate).

        Raises:
            RequestError: the request is unknown or still running.
        """
        state = self._requests.get(request_id)
        if state is None or not state.done:
            raise RequestError(f"request {request_id}: expected a finished request, found "
                               f"{'none' if state is None else 'one still running'}")
        del self._requests[request_id]
        return state.result

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
        """Finish the requests `cancel` marked (O(cancelled), not O(queue): the queue may be long)."""
        with self._lock:
            marked, self._cancel_marked = self._cancel_marked, []
        dropped = False
        for s in marked:
            if not s.done:
                dropped |= s.slot < 0
                s.result.finish_reason = "cancelled"
                self._finish(s)
        if dropped:
            with self._lock:
                self._waiting = deque(s for s in self._waiting if not s.done)

    def _release_finished(self) -> None:
        """Free the slots of finished requests; then shrink the caches' capacity to their longest live
        slot (`KVCache.shrink`) and the slot count to the live requests' bucket (unless requests wait).
        Capacity first, so a release that does both copies the caches at the smaller capacity."""
        released = False
        for i, s in enumerate(self._slots):
            if s is not None and s.done:
                self._slots[i] = None
                self.target_kv.reset(i)
                self.draft_kv.reset(i)
                released = True
        if released:
            self.target_kv.shrink()
            self.draft_kv.shrink()
        live = sum(s is not None for s in self._slots)
        if self._slots and self.engines.bucket_for("drafter_block", max(1, live)) < len(self._slots) \
                and not self._waiting:
            self._resize(live)

    def _finish(self, s: _State, tokens: list[int] | None = None) -> None:
        s.done = True
        s.backlog = []                          # never needed again; free the features now
        s.result.stats.wall_s = time.perf_counter() - s.t0
        if s.on_token:
            s.on_token(s.index, tokens or [], s.result)

    # -- one step ----------------------------------------------------------------------------
    def _step(self, active: list[_State]) -> None:
        """Advance `active` by one step, isolating engine faults.

        Fault policy (docs/ARCHITECTURE.md, "Faults"): a step computes everything (every engine call)
        before it commits anything, so a failed step leaves caches and requests as they were. If an
        engine call raises, the step is undone (the requests' random streams included) and each of
        its requests is retried once in a step of its own; a request whose own step raises again
        finishes with finish_reason "error" and the engine's message, the others go on. Non-finite
        engine outputs (NaN/Inf logits, features, K/V, draft logits or confidences) and out-of-range
        token ids fail only the requests whose rows hold them.
        """
        try:
            rnd = self._attempt(active)
        except EngineRunError as e:
            if len(active) == 1:
                self._fail(active[0], str(e))
                return
            log.warning("%s; retrying the step's %d requests one at a time", e, len(active))
            for s in active:
                try:
                    rnd = self._attempt([s])
                except EngineRunError as e1:
                    self._fail(s, str(e1))
                else:
                    self._apply(rnd)
            return
        self._apply(rnd)

    def _attempt(self, active: list[_State]) -> "_Round":
        """`_compute`, restoring the requests' random streams if it raises (nothing else has changed)."""
        streams = [(s, s.rng.bit_generator.state) for s in active]
        try:
            return self._compute(active)
        except EngineRunError:
            for s, state in streams:
                s.rng.bit_generator.state = state
            raise

    def _compute(self, active: list[_State]) -> "_Round":
        """Drafter context of the flushed backlogs → draft → schedule → one packed target pass
        (verification rows + prefill chunks) → verify → the committed rows (target K/V, backlog
        features). Runs every engine call of the step and changes no request's state or valid cache
        length (only the requests' random streams advance; flushed context rows sit past the valid
        length until `_apply`)."""
        decoding = [s for s in active if s.decoding]
        failed: dict[int, str] = {}
        drafting = bool(self.policy.drafts and decoding and not self._skip_drafting(decoding))
        flush = [s for s in active if s.backlog_rows and ((drafting and s.decoding)
                                                          or s.backlog_rows >= self.backlog_limit)]
        flushed = self._flush_context(flush, failed)
        decoding = [s for s in decoding if s.slot not in failed]
        drafts = None
        if drafting and decoding:
            t0 = time.perf_counter()
            drafts = self._draft(decoding, flushed)
            self._observe_draft_time(time.perf_counter() - t0)
        if drafts is not None:
            failed.update(self._check_drafts(drafts, decoding))
            decoding = [s for s in decoding if s.slot not in failed]
        verify_lens, conf = self._schedule(decoding, drafts)
        segments = [Segment(s.slot, np.concatenate([[s.anchor], drafts["draft_ids"][s.slot, :verify_lens[s.slot]]])
                            if drafts else np.array([s.anchor]), s.start) for s in decoding]
        budget = self.max_tokens - sum(len(seg.token_ids) for seg in segments)
        finishing, prefill = [], {}
        for s in [s for s in active if not s.decoding and s.slot not in failed]:
            n = min(budget, len(s.prompt) - s.prefilled)
            if n <= 0:
                break
            last = s.prefilled + n == len(s.prompt)
            segments.append(Segment(s.slot, s.prompt[s.prefilled:s.prefilled + n], s.prefilled,
                                    "last" if last else "none"))
            prefill[s.slot], budget = s.prefilled + n, budget - n
            finishing += [s] if last else []
        rnd = _Round(active, decoding, finishing, prefill, verify_lens, drafts, conf, failed, flushed=flushed)
        if not segments:
            return rnd
        packed, out = self._target_pass(segments)
        failed.update(self._check_target(packed, out, segments))
        decoding = rnd.decoding = [s for s in decoding if s.slot not in failed]
        finishing = rnd.finishing = [s for s in finishing if s.slot not in failed]
        rows = {s.slot: out["logits"][packed.logit_start[s.slot]:packed.logit_start[s.slot] + verify_lens[s.slot] + 1]
                for s in decoding}
        rows.update({s.slot: out["logits"][packed.logit_start[s.slot]][None] for s in finishing})
        verify_lens.update({s.slot: 0 for s in finishing})
        if decoding or finishing:
            rnd.num_accepted, rnd.next_ids = self._verify(decoding + finishing, rows, drafts, verify_lens, failed)
            failed.update(self._check_verify(rnd, decoding + finishing))
        keep = {seg.slot: len(seg.token_ids) for seg in segments if seg.slot not in failed}  # prefill: every row
        keep.update({s.slot: int(rnd.num_accepted[s.slot]) + 1 for s in decoding if s.slot not in failed})
        if keep:
            rnd.commit = self._commit_rows(packed, out, keep, failed)
        return rnd

    def _skip_drafting(self, decoding: list[_State]) -> bool:
        """dspark-async with a known drafter cost: skip the drafter block when drafting does not pay: the
        capacity K* for the current R requests, each given the running mean survival of earlier
        drafted steps (averaged over their requests; `scheduler.mean_survival_capacity`), is 0, or its
        expected throughput beats not drafting by less than _SKIP_MARGIN (20 %). The drafter block is
        priced at d(S) for the S slots it runs over, not d(R): while a batch fills, most slots are still
        prefilling (R = 1-15 of S = 16), and d(R) priced a 30 ms block at 4.5 ms on SmolLM2.

        Why the margin: the profile underprices a drafted step in the loop (the drafter block ran 1.3-2 ×
        its profiled d(R), plus the context flush and output checks), and on the serving prompts the
        calibrated confidences overrate position 1 (predicted survival 0.36, observed 0.29, fixed:7 at
        C = 2, 313 rounds; calibration was fitted on the training distribution). Both push a marginal
        decision toward drafting. Measured (one process, interleaved, 2C requests × 48 tokens,
        whole-workload throughput / `ar`'s, median): C = 1 0.99 → 1.05 (4 repeats), C = 2 0.94 → 0.98
        and C = 4 0.94 → 0.96 (3 repeats each) for margin 0 → 0.2; 0.05 and 0.1 fell in between.

        Why a running mean: one step's survivals are noisy (at R = 1 they swing from ~0 to ~1 between
        tokens), and a rule on them switched a drafter that pays on average off for whole probe
        intervals. Why averaged over requests rather than per request: a per-request mean rests on a
        few noisy drafted steps, and the best of R such estimates overrates its request. Per-request
        means were tried: on SmolLM2 (serving benchmark, 24 requests, throughput / `ar`'s in the same
        run at 2, 4, 8 clients) they gave 0.91, 0.86, 0.90 against 1.07, 0.86, 0.90 for the averaged
        mean. The cost: one request worth drafting for among many that are not is not drafted for. (Which positions a drafted step verifies is still §5.2's lagged
        capacity, per request.)

        Skipping gives no new confidences, so after `probe_interval` skipped steps the drafter runs
        for a probe of 2 steps (Algorithm 1 on fresh confidences, the lag history cleared) and the
        mean restarts from them. The interval doubles after each probe that ends in another skip
        (4, 8, ..., 64 steps) and drops back to 4 when drafting pays again; it is never shorter than
        `_probe_floor(R, S)`, which keeps the probes' drafter time within 5 % of the skipped steps'.
        Why: at 8 or more requests on SmolLM2 a probe's two drafter blocks cost ~1.5-2 target steps,
        and probes at 4, 12, 28, 60 steps were ~5 % of a closed-loop run's time. Measured (one process,
        policies interleaved, 3 repeats, 2C requests × 48 tokens, total-workload throughput / `ar`'s,
        median): C = 4 0.94 with the floor vs 0.89 without; C = 8 1.02 vs 1.03; C = 16 0.92 vs 0.96, the
        last two within this CPU's ±10 % drift. A skipped step runs no
        drafter block, and no drafter context unless a backlog reaches the largest context bucket:
        its committed rows wait in the request's backlog, which the next draft flushes first
        (`_flush_context`), so the drafter never works from a stale context (failure case SD-20).
        This is scheduling bookkeeping, not request state: a step retried after an engine error may
        count a skip twice, which only moves the next probe earlier.
        """
        if self.policy.name != "dspark-async" or self.profile is None or not self.profile.has_draft_cost:
            return False
        if self._probe_left > 0:
            self._probe_left -= 1
            return False
        R = len(decoding)
        if self._skipped >= max(self._probe_interval, self._probe_floor(R, self.num_slots)):
            self._history, self._skipped, self._survival_n = [], 0, 0
            self._probe_interval = min(2 * self._probe_interval, _MAX_PROBE_INTERVAL)
            self._probe_left = _PROBE_STEPS - 1
            return False
        if self._survival_mean is None:
            return False
        if mean_survival_capacity(np.broadcast_to(self._survival_mean, (R, self.block_size)), R,
                                  self._step_profile(), _SKIP_MARGIN, draft_slots=self.num_slots) > 0:
            self._probe_interval = _MIN_PROBE_INTERVAL
            return False
        self._skipped += 1
        self.drafts_skipped += 1
        return True

    def _step_profile(self) -> ThroughputProfile | None:
        """The profile bound to this step's layout (slot count S, target KV capacity P), so the policies
        price padded attention where the profile measured it (`ThroughputProfile.at`); cached per layout."""
        if self.profile is None:
            return None
        key = (self.num_slots, self.target_kv.capacity)
        if self._bound_profile is None or self._bound_profile[0] != key:
            self._bound_profile = (key, self.profile.at(*key))
        return self._bound_profile[1]

    def _observe_draft_time(self, seconds: float) -> None:
        """Fold one drafter block's wall time at the current slot count into its running mean (weight
        _SURVIVAL_EMA for the newest), for `_probe_floor`."""
        old = self._draft_wall.get(self.num_slots)
        self._draft_wall[self.num_slots] = seconds if old is None else (1 - _SURVIVAL_EMA) * old + _SURVIVAL_EMA * seconds

    def _probe_floor(self, num_requests: int, num_slots: int) -> int:
        """The fewest skipped steps between dspark-async probes for R requests in S slots: enough that a
        probe's drafter blocks cost at most _PROBE_OVERHEAD of the skipped steps' time,
        ⌈_PROBE_STEPS · d(S) · SPS(R) / _PROBE_OVERHEAD⌉ (d(S) the latency in s of the drafter block,
        which runs over every slot, SPS(R) the target's steps/s at B = R rows, both from the profile).
        SmolLM2 on 2 CPU cores, R = S: 9 steps at 1, 23 at 8, 35 at 16. It may exceed the doubling's 64:
        a drafter that costs 10 target steps is probed every 400 skipped steps (at most _FLOOR_CAP, so
        absurd profiles stay finite). d(S) is the larger of the profile's and the drafter block's own
        wall time in this generator's earlier steps at S slots (a running mean, `_observe_draft_time`):
        in the loop the block ran 1.3-2 × its profiled latency (SmolLM2, S = 16: 43-55 ms against 29 ms).
        The probe's context flush is not counted: it pays for rows the skipped steps committed, in
        proportion to the gap, so no gap makes it smaller."""
        d, sps = max(self.profile.draft_seconds(num_slots), self._draft_wall.get(num_slots, 0.0)), \
            self.profile.sps(num_requests)
        if not sps > 0:
            return _MAX_PROBE_INTERVAL
        return int(np.ceil(min(_PROBE_STEPS * d * sps / _PROBE_OVERHEAD, _FLOOR_CAP)))

    def _apply(self, rnd: "_Round") -> None:
        """Commit a computed step: caches, prefill progress, tokens, failures."""
        for s in rnd.active:
            if s.slot in rnd.prefill and s.slot not in rnd.failed:
                s.prefilled = rnd.prefill[s.slot]
        if rnd.conf is not None:
            self._history = (self._history + [rnd.conf])[-2:]
            if self.policy.name == "dspark-async":
                self._observe_survival(rnd)
        for s in rnd.active:                  # the flushed backlog rows, written past lens in _compute
            if s.slot in rnd.flushed and s.slot not in rnd.failed:
                self.draft_kv.lens[s.slot] = rnd.flushed[s.slot]
                s.backlog = []
        if rnd.commit is not None:
            c = rnd.commit
            self.target_kv.append(c.slots, c.target_keys, c.target_values)
            if c.aux is not None:
                for s in rnd.active:
                    rows = np.flatnonzero(c.slots == s.slot)
                    if rows.size:
                        s.backlog.append((c.aux[rows], c.positions[rows]))
        drafts = rnd.drafts
        for s in rnd.decoding:
            if s.slot in rnd.failed:
                continue
            a, n = int(rnd.num_accepted[s.slot]), rnd.verify_lens[s.slot]
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

    def _observe_survival(self, rnd: "_Round") -> None:
        """Fold a drafted step's request-averaged survival [γ] into the running mean (`_skip_drafting`)."""
        m = survival_probs(rnd.conf).mean(axis=0)
        self._survival_n += 1
        w = max(1.0 / self._survival_n, _SURVIVAL_EMA)
        self._survival_mean = m if self._survival_n == 1 else (1 - w) * self._survival_mean + w * m

    def _fail(self, s: _State, reason: str) -> None:
        log.warning("request %d failed: %s", s.index, reason)
        s.result.finish_reason, s.result.error = "error", reason
        self._finish(s)

    # -- output checks (fault isolation) -------------------------------------------------------
    def _check_drafts(self, drafts: dict, decoding: list[_State]) -> dict[int, str]:
        """Slots whose drafter outputs are non-finite or out of range → reason."""
        slots = np.array([s.slot for s in decoding], np.int64)
        ok = np.isfinite(drafts["draft_logits"][slots].sum(axis=(1, 2)))
        conf = drafts["confidence"][slots]
        ok &= np.isfinite(conf).all(axis=1) & (conf >= 0).all(axis=1) & (conf <= 1).all(axis=1)
        ids = drafts["draft_ids"][slots]
        ok &= ((ids >= 0) & (ids < self.vocab_size)).all(axis=1)
        key = self._last_key.get("drafter_block", "drafter_block")
        return {int(slot): f"engine {key} returned non-finite or out-of-range drafts (draft_logits, confidence "
                           f"or draft_ids) for this request" for slot in slots[~ok]}

    def _check_target(self, packed, out: dict, segments: list[Segment]) -> dict[int, str]:
        """Slots whose target rows (logits, aux_hidden, new K/V) hold NaN/Inf → reason. A row is
        finite iff its sum is (a NaN or ±Inf term makes the sum non-finite)."""
        n = out["aux_hidden"].shape[0]
        row_ok = np.isfinite(out["aux_hidden"].sum(axis=1))
        for layer in range(self.target_kv.num_layers):
            for name in (f"new_key.{layer}", f"new_value.{layer}"):
                row_ok &= np.isfinite(out[name].reshape(n, -1).sum(axis=1))
        logit_ok = np.isfinite(out["logits"].sum(axis=1))
        failed = {}
        for seg in segments:
            a, q = packed.row_start[seg.slot], len(seg.token_ids)
            m = q if seg.logits == "all" else int(seg.logits == "last")
            la = packed.logit_start.get(seg.slot, 0)
            if not (row_ok[a:a + q].all() and logit_ok[la:la + m].all()):
                engine = packed.engines.get(seg.slot) or self._last_key.get("target", "target")
                failed[seg.slot] = (f"engine {engine} returned non-finite "
                                    f"outputs (logits, aux_hidden or K/V) for this request's rows at positions "
                                    f"{seg.start_position}..{seg.start_position + q - 1}")
        return failed

    def _check_verify(self, rnd: "_Round", states: list[_State]) -> dict[int, str]:
        failed = {}
        for s in states:
            a, t = int(rnd.num_accepted[s.slot]), int(rnd.next_ids[s.slot])
            if not (0 <= a <= rnd.verify_lens[s.slot] and 0 <= t < self.vocab_size):
                failed[s.slot] = (f"engine {self._last_key.get('verify', 'verify')} returned out-of-range values "
                                  f"for this request (num_accepted {a} of {rnd.verify_lens[s.slot]} drafts, "
                                  f"next id {t}, vocab {self.vocab_size})")
        return failed

    def _schedule(self, decoding: list[_State], drafts) -> tuple[dict[int, int], np.ndarray | None]:
        """Verify lengths ℓ per decoding slot, capped so a round never passes max_new_tokens or capacity,
        and the confidences [R, γ] the policy saw (None without drafts)."""
        if not decoding:
            return {}, None
        slots = np.array([s.slot for s in decoding], np.int64)
        caps = np.array([max(0, min(self.block_size,
                                    self.max_context - s.start - 1,                     # cache rows after the anchor
                                    s.params.max_new_tokens - len(s.result.token_ids) - 1))  # drafts past max are waste
                         for s in decoding], np.int64)
        if drafts is None:
            return {int(slot): 0 for slot in slots}, None
        conf = drafts["confidence"][slots]
        lag = self._history[0] if len(self._history) == 2 else None
        lens = self.policy.verify_lengths(conf, self.block_size, self._step_profile(), lag, caps)
        return {int(slot): int(n) for slot, n in zip(slots, np.minimum(lens, caps))}, conf

    def _emit(self, s: _State, tokens: list[int], rounds: int) -> None:
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
            self._finish(s, kept)
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

    # -- engine calls ------------------------------------------------------------------------
    def _infer(self, runner, feed: dict) -> dict[str, np.ndarray]:
        """runner.infer, turning any failure into EngineRunError naming the engine."""
        self._last_key[runner.key.graph] = runner.key.path
        try:
            return runner.infer(feed)
        except Exception as e:  # ORT raises its own Fail/RuntimeException/... types
            raise EngineRunError(f"engine {runner.key.path} failed ({type(e).__name__}: {e})") from e

    def _target_pass(self, segments: list[Segment]) -> tuple[PackedBatch, dict[str, np.ndarray]]:
        """Run the step's segments through the target; returns (where each slot's rows and logits
        landed, the outputs), as one packed pass would.

        When at most max(1, S // 4) segments are longer than a verification block (prefill chunks),
        each of them runs in a pass of its own over its slot alone and the rest share one pass. That
        slot's cache is trimmed to its valid entries rounded up to 64 (`KVCache.feed(trim=True)`, a
        copy of one slot), because attention runs over every entry of the buffer: a 170-token chunk at
        position 0 took 552 ms over capacity 512 and 392 ms over 192 entries. Why split: the graph's
        attention pads every slot's query to the longest one ([S, Q], `pad_index`), so a 200-token
        chunk next to S decode rows costs S × 200 query rows of attention over the whole cache.
        SmolLM2, this CPU, 200-token chunk at cache capacity 512 (one measurement each): alone 482 ms;
        in one pass with 7 decode rows at S = 8 1,616 ms, at S = 16 2,906 ms; the decode rows on their
        own 55 ms. Each split costs one more weight read of the target, so when many slots prefill
        together (most of the S rows are long anyway) they stay in one pass: 8 chunks of 30 tokens at
        S = 8 took 425 ms in one pass against 562 ms split (4 × 12 tokens at S = 4: 125 vs 175 ms).
        Each slot's rows are reported with the engine that computed them (`PackedBatch.engines`).
        """
        for seg in segments:
            self.target_kv.reserve(int(self.target_kv.lens[seg.slot]) + len(seg.token_ids))
        long = [len(seg.token_ids) > self.block_size + 1 for seg in segments]
        split = sum(long) <= max(1, self.num_slots // 4)
        alone = [seg for seg, is_long in zip(segments, long) if split and is_long]
        shared = [seg for seg, is_long in zip(segments, long) if not (split and is_long)]
        passes = [self._target_run(shared, None)] if shared else []
        passes += [self._target_run([seg], seg.slot) for seg in alone]
        if len(passes) == 1:
            return passes[0]
        row_start, logit_start, engines, outs, rows, logits = {}, {}, {}, [], 0, 0
        for packed, out in passes:
            row_start.update({slot: a + rows for slot, a in packed.row_start.items()})
            logit_start.update({slot: a + logits for slot, a in packed.logit_start.items()})
            engines.update(packed.engines)
            rows, logits = rows + out["aux_hidden"].shape[0], logits + out["logits"].shape[0]
            outs.append(out)
        merged = {name: np.concatenate([out[name] for out in outs]) for name in outs[0]}
        return PackedBatch({}, row_start, logit_start, sum(p.num_real_tokens for p, _ in passes),
                           engines=engines), merged

    def _target_run(self, segments: list[Segment], slot: int | None) -> tuple[PackedBatch, dict[str, np.ndarray]]:
        """One target pass: over every slot of the cache (slot None), or over `slot` alone (one segment;
        the pass sees that slot's cache trimmed to its valid entries, [1, kvH, P, D], and its rows are
        reported under `slot`)."""
        runner = self.engines.runner("target", sum(len(seg.token_ids) for seg in segments))
        kv = self.target_kv
        if slot is None:
            packed = pack_segments(segments, self.num_slots, kv.lens, runner.key.bucket)
            packed.engines = {seg.slot: str(runner.key.path) for seg in segments}
            return packed, self._infer(runner, {**packed.feed, **kv.feed("past_key", "past_value")})
        seg = segments[0]
        packed = pack_segments([Segment(0, seg.token_ids, seg.start_position, seg.logits)], 1,
                               kv.lens[slot:slot + 1], runner.key.bucket)
        out = self._infer(runner, {**packed.feed, **kv.feed("past_key", "past_value", slot, trim=True)})
        return PackedBatch({}, {slot: packed.row_start[0]},
                           {slot: packed.logit_start[0]} if 0 in packed.logit_start else {},
                           packed.num_real_tokens, engines={slot: str(runner.key.path)}), out

    def _commit_rows(self, packed, out: dict, keep: dict[int, int], failed: dict[int, str]) -> "_Commit":
        """The first keep[slot] rows of each slot's segment: their target K/V, and (when the policy
        drafts) their tapped features and positions for the drafter-context backlog (features of
        committed rows only; DeepSpec spec §5.2 pitfall 2). Rows of `failed` slots are dropped."""
        order = sorted(keep.items())
        slots = np.concatenate([np.full(n, slot, np.int64) for slot, n in order])
        rows = np.concatenate([packed.row_start[slot] + np.arange(n) for slot, n in order])
        L = self.target_kv.num_layers
        c = _Commit(slots, [out[f"new_key.{i}"][rows] for i in range(L)], [out[f"new_value.{i}"][rows] for i in range(L)])
        if self.policy.drafts:
            c.aux = out["aux_hidden"][rows]
            c.positions = self.target_kv.lens[slots] + np.concatenate([np.arange(n) for _, n in order])
        bad = np.isin(slots, np.array(sorted(failed), np.int64))
        if bad.any():
            c.keep_rows(~bad)
        return c

    def _flush_context(self, states: list[_State], failed: dict[int, str]) -> dict[int, int]:
        """Run the backlog of `states` through the drafter context engine and write the K/V rows into
        the drafter cache PAST each slot's valid length (`KVCache.write`); `_apply` makes them valid.
        A failed step therefore leaves the cache as it was. Slots whose context rows come back
        non-finite are added to `failed` (their rows stay invalid).

        Returns:
            {slot: drafter context length once the step commits} for the flushed slots that did not fail
            (the `context_lens` the drafter block reads this step).
        """
        if not states:
            return {}
        aux = np.concatenate([a for s in states for a, _ in s.backlog])
        positions = np.concatenate([p for s in states for _, p in s.backlog])
        slots = np.concatenate([np.full(s.backlog_rows, s.slot, np.int64) for s in states])
        keys, values = self._context_rows(aux, positions)
        n = len(slots)
        ok = np.ones(n, bool)
        for x in keys + values:
            ok &= np.isfinite(x.reshape(n, -1).sum(axis=1))
        for slot in np.unique(slots[~ok]):
            failed[int(slot)] = (f"engine {self._last_key.get('drafter_context', 'drafter_context')} returned "
                                 "non-finite drafter context rows for this request")
        good = ~np.isin(slots, np.array(sorted(failed), np.int64))
        self.draft_kv.write(slots[good], [k[good] for k in keys], [v[good] for v in values])
        return {s.slot: int(self.draft_kv.lens[s.slot]) + s.backlog_rows for s in states if s.slot not in failed}

    def _context_rows(self, aux: np.ndarray, positions: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Drafter context K/V [n, kvH, D] per drafter layer for committed rows aux [n, F] at `positions`."""
        step = self.engines.buckets("drafter_context")[-1]
        L = self.draft_kv.num_layers
        keys, values = [[] for _ in range(L)], [[] for _ in range(L)]
        for a in range(0, len(aux), step):
            n = min(step, len(aux) - a)
            runner = self.engines.runner("drafter_context", n)
            b = runner.key.bucket
            feed_aux = np.zeros((b, aux.shape[1]), np.float32)
            feed_aux[:n] = aux[a:a + n]
            feed_pos = np.zeros(b, np.int64)
            feed_pos[:n] = positions[a:a + n]
            out = self._infer(runner, {"aux_hidden": feed_aux, "position_ids": feed_pos})
            for i in range(L):
                keys[i].append(out[f"context_key.{i}"][:n])
                values[i].append(out[f"context_value.{i}"][:n])
        return [np.concatenate(k) for k in keys], [np.concatenate(v) for v in values]

    def _sampling_feed(self, states: list[_State]) -> dict[str, np.ndarray]:
        temp = np.zeros(self.num_slots, np.float32)
        top_k = np.zeros(self.num_slots, np.int64)
        top_p = np.ones(self.num_slots, np.float32)
        for s in states:
            t = s.params.temperature
            temp[s.slot] = t if t >= GREEDY_BELOW else 0.0     # l / 1e-39 overflows: such a T is greedy
            top_k[s.slot], top_p[s.slot] = s.params.top_k, s.params.top_p
        return {"temperature": temp, "top_k": top_k, "top_p": top_p}

    def _draft(self, active: list[_State], flushed: dict[int, int]) -> dict[str, np.ndarray]:
        """Drafts for every slot: {"draft_ids" [S, γ] int64, "draft_logits" [S, γ, V] float32,
        "confidence" [S, γ] float32}; rows of slots not in `active` are ignored. `flushed`: the
        drafter context lengths this step's flush reaches (`_flush_context`); every active request's
        backlog has been flushed, so its context covers every position before its anchor."""
        if self.drafter is not None:
            return self.drafter(self, active)
        anchors = np.zeros(self.num_slots, np.int64)
        starts = np.zeros(self.num_slots, np.int64)
        uniforms = np.zeros((self.num_slots, self.block_size), np.float32)
        for s in active:
            anchors[s.slot], starts[s.slot] = s.anchor, s.start
            uniforms[s.slot] = s.rng.random(self.block_size, dtype=np.float32)
        context_lens = self.draft_kv.lens.copy()
        for slot, n in flushed.items():
            context_lens[slot] = n
        feed = {"anchor_ids": anchors, "start_positions": starts, "context_lens": context_lens,
                **self.draft_kv.feed("context_key", "context_value"), **self._sampling_feed(active),
                "uniforms": uniforms, "confidence_temperature": self.sts}
        out = self._infer(self.engines.runner("drafter_block", self.num_slots), feed)
        if self.confidence_bias.any():
            c = np.clip(np.asarray(out["confidence"], np.float64), 1e-7, 1 - 1e-7)   # NaN stays NaN (fault check)
            z = np.log(c) - np.log1p(-c) + self.confidence_bias
            out = {**out, "confidence": (1.0 / (1.0 + np.exp(-z))).astype(np.float32)}
        return out

    def _verify(self, states: list[_State], rows: dict[int, np.ndarray], drafts, verify_lens: dict[int, int],
                failed: dict[int, str]):
        """SpeculativeVerify over all slots (slots without rows get one inert zero row)."""
        V, g = self.vocab_size, self.block_size
        blocks = [rows.get(slot, np.zeros((1, V), np.float32)) for slot in range(self.num_slots)]
        lens = np.array([verify_lens.get(slot, 0) if slot in rows else 0 for slot in range(self.num_slots)], np.int64)
        uniforms = np.zeros((self.num_slots, g + 1), np.float32)
        for s in states:
            uniforms[s.slot] = s.rng.random(g + 1, dtype=np.float32)
        draft_logits = drafts["draft_logits"] if drafts else self._zero_draft_logits()
        if drafts and failed:   # a failed slot's (maybe NaN) drafts must not reach the op at all
            draft_logits = draft_logits.copy()
            draft_logits[sorted(failed)] = 0.0
        feed = {"target_logits": np.concatenate(blocks).astype(np.float32, copy=False),
                "query_start": np.concatenate([[0], np.cumsum(lens + 1)]).astype(np.int64),
                "draft_ids": np.clip(drafts["draft_ids"], 0, V - 1) if drafts else np.zeros((self.num_slots, g), np.int64),
                "draft_logits": draft_logits,
                "verify_lens": lens, **self._sampling_feed(states), "uniforms": uniforms}
        out = self._infer(self.engines.runner("verify", self.num_slots), feed)
        return out["num_accepted"], out["next_ids"]

    def _zero_draft_logits(self) -> np.ndarray:
        if getattr(self, "_zeros", None) is None or self._zeros.shape[0] != self.num_slots:
            self._zeros = np.zeros((self.num_slots, self.block_size, self.vocab_size), np.float32)
        return self._zeros


@dataclass
class _Commit:
    """Rows one step commits: slot of each row [n] int64 (a slot's rows in position order), per layer
    the target's new K/V [n, kvH, D], and for the drafter-context backlog the rows' tapped features
    aux [n, F] float32 and positions [n] int64 (None when the policy never drafts)."""

    slots: np.ndarray
    target_keys: list[np.ndarray]
    target_values: list[np.ndarray]
    aux: np.ndarray | None = None
    positions: np.ndarray | None = None

    def keep_rows(self, mask: np.ndarray) -> None:
        self.slots = self.slots[mask]
        self.target_keys = [x[mask] for x in self.target_keys]
        self.target_values = [x[mask] for x in self.target_values]
        if self.aux is not None:
            self.aux, self.positions = self.aux[mask], self.positions[mask]


@dataclass
class _Round:
    """One step's computed outcome, before it is committed (`Generator._apply`)."""

    active: list[_State]
    decoding: list[_State]
    finishing: list[_State]            # requests whose prefill ends this step (first token)
    prefill: dict[int, int]            # slot -> prompt tokens prefilled after this step
    verify_lens: dict[int, int]
    drafts: dict | None
    conf: np.ndarray | None            # confidences the policy saw (dspark-async history)
    failed: dict[int, str]             # slot -> reason
    num_accepted: np.ndarray | None = None
    next_ids: np.ndarray | None = None
    commit: _Commit | None = None
    flushed: dict[int, int] = field(default_factory=dict)  # slot -> drafter context length after the flush
