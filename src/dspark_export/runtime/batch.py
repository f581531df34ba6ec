"""The batch a `Generator` decodes: the request queue, the KV slots with their caches, and the per-slot
sampling arrays the engines read.

Requests wait in a queue until a slot frees up (`admit`); the slot count follows the request-count
buckets of the drafter block engine, growing and compacting at bucket boundaries (`resize`), so a lone
request runs the R = 1 engines. A finished request's slot is released at the end of the step that
finished it (`release_finished`), and the caches shrink to their longest live slot (the slot count at the
start of the next step, after the caller could submit more). Dimension letters:
S slots, P KV capacity per slot.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..engines.engine_set import EngineSet
from .kv_cache import KVArenaPool, KVCache, check_count
from .request import GREEDY_BELOW, GenerationResult, SamplingParams

__all__ = ["RequestState", "Batch", "finish"]

# one arena pool per engine set: a new Generator on the same engines reuses the KV memory a dead one touched
_ARENAS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class RequestState:
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
    # not yet run through `drafter_context` (draft_kv.lens + backlog_rows == target_kv.lens without a drafter
    # context window; with one, draft_kv.lens counts only the rows its flushes kept)
    backlog: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    backlog_rows: int = 0     # rows in `backlog`, kept by `add_backlog` / `clear_backlog` (read every step)
    drafted_at: int = 0       # the generator's draft clock when a step last drafted for it (0: never)

    def add_backlog(self, aux: np.ndarray, positions: np.ndarray) -> None:
        """Queue committed rows' features aux [n, F] and positions [n] for the drafter context."""
        self.backlog.append((aux, positions))
        self.backlog_rows += len(positions)

    def clear_backlog(self) -> None:
        self.backlog, self.backlog_rows = [], 0

    @property
    def start(self) -> int:
        """Absolute position of the anchor (= committed target KV length)."""
        return len(self.prompt) + len(self.result.token_ids) - 1

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)


def finish(s: RequestState, tokens: list[int] | None = None) -> None:
    """Mark a request finished (its result's finish_reason is already set) and tell its `on_token`."""
    s.done = True
    s.clear_backlog()                       # never needed again; free the features now
    s.result.stats.wall_s = time.perf_counter() - s.t0
    if s.on_token:
        s.on_token(s.index, tokens or [], s.result)


class Batch:
    """Requests (`requests`, by id), the queue (`waiting`), the slots (`slots`, a state or None per KV
    slot), the target and drafter KV caches, and per slot the sampling parameters as dense arrays.

    Args:
        engines: the loaded engines (their drafter block buckets are the slot counts).
        max_slots: requests decoded at once.
        max_context: KV capacity per slot at most (tokens).
    Thread safety: `new_id`, `enqueue` and `mark_cancelled` may run on any thread (under `lock`); the
    rest runs on the stepping thread.
    """

    def __init__(self, engines: EngineSet, max_slots: int, max_context: int):
        self.engines, self.max_slots = engines, max_slots
        self.lock = threading.Lock()
        self.waiting: deque[RequestState] = deque()
        self.cancel_marked: list[RequestState] = []
        self.slots: list[RequestState | None] = []
        self.requests: dict[int, RequestState] = {}
        self.next_id = 0
        self.on_resize: Callable[[], None] | None = None  # rows of per-slot history no longer line up
        m = engines.manifest.data
        tg, dg = m["graphs"]["target"]["spec"], m["graphs"]["drafter_block"]["spec"]
        pool = _ARENAS.setdefault(engines, KVArenaPool())    # arenas of earlier batches on these engines
        self.target_kv = KVCache(tg["num_layers"], 0, tg["num_kv_heads"], tg["head_dim"], max_context, 256, pool)
        self.draft_kv = KVCache(dg["num_layers"], 0, dg["num_kv_heads"], dg["head_dim"], max_context, 256, pool)
        # [S] the sampling parameters of each slot's request (greedy defaults where a slot is free)
        self.temperature = np.zeros(0, np.float32)
        self.top_k = np.zeros(0, np.int64)
        self.top_p = np.ones(0, np.float32)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def new_id(self) -> int:
        with self.lock:
            index, self.next_id = self.next_id, self.next_id + 1
        return index

    def enqueue(self, state: RequestState) -> None:
        with self.lock:
            self.waiting.append(state)

    def mark_cancelled(self, state: RequestState) -> None:
        with self.lock:
            state.cancelled = True
            self.cancel_marked.append(state)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def active(self) -> list[RequestState]:
        """The admitted requests, in slot order."""
        return [s for s in self.slots if s is not None]

    def admit(self) -> None:
        """Move waiting requests into free slots (growing the slot count by bucket) up to `max_slots`."""
        with self.lock:
            while self.waiting and sum(s is not None for s in self.slots) < self.max_slots:
                state = self.waiting.popleft()
                if None not in self.slots:
                    self.resize(len(self.slots) + 1)
                state.slot = self.slots.index(None)
                self.slots[state.slot] = state
                self._set_sampling(state.slot, state.params)
                state.t0 = time.perf_counter()

    def resize(self, needed: int) -> None:
        """Move live requests into the smallest slot bucket ≥ `needed` (compacting them in order)."""
        size = self.engines.bucket_for("drafter_block", max(1, needed))
        live = [s for s in self.slots if s is not None]
        moves = {s.slot: new for new, s in enumerate(live)}
        self.target_kv.remap(size, moves)
        self.draft_kv.remap(size, moves)
        self.slots = live + [None] * (size - len(live))
        for new, s in enumerate(live):
            s.slot = new
        self.temperature = np.zeros(size, np.float32)
        self.top_k = np.zeros(size, np.int64)
        self.top_p = np.ones(size, np.float32)
        for s in live:
            self._set_sampling(s.slot, s.params)
        if self.on_resize is not None:
            self.on_resize()

    def prefault_kv(self, entries: int, requests: int | None = None) -> None:
        """Write both KV caches' arenas once at the layout `requests` requests (default max_slots) of `entries`
        tokens reach: their slot bucket × `entries` (`KVCache.prefault`). Why: a step that grows a cache into
        fresh pages stalls (first touch runs at ~150 MB/s on some VMs: up to ~0.7 s at 4 slots); servers call
        this at startup, as vLLM allocates its KV cache up front, and benchmarks in their warm-up.

        Raises:
            ValueError: `entries` or `requests` is not an integer ≥ 0."""
        wanted = self.max_slots if requests is None else \
            min(check_count("prefault_kv: requests", requests), self.max_slots)
        slots = self.engines.bucket_for("drafter_block", max(1, wanted))
        self.target_kv.prefault(slots, entries)
        self.draft_kv.prefault(slots, entries)

    def drop_cancelled(self) -> None:
        """Finish the requests `mark_cancelled` marked (O(cancelled), not O(queue): the queue may be long)."""
        with self.lock:
            marked, self.cancel_marked = self.cancel_marked, []
        dropped = False
        for s in marked:
            if not s.done:
                dropped |= s.slot < 0
                s.result.finish_reason = "cancelled"
                finish(s)
        if dropped:
            with self.lock:
                self.waiting = deque(s for s in self.waiting if not s.done)

    def release_finished(self, resize: bool = True) -> None:
        """Free the slots of finished requests; then shrink the caches' capacity to their longest live
        slot (`KVCache.shrink`) and, with `resize`, the slot count to the live requests' bucket (unless requests
        wait). Capacity first, so a release that does both copies the caches at the smaller capacity.

        The generator releases at the end of a step without `resize` and at the start of the next with it. Why: a
        server submits the next requests between steps, so a slot count shrunk at the end of a step was often
        grown back at the next admission, two O(cache) remaps for nothing (19 of 24 target-cache relayouts
        in a C = 4 closed loop: reports/runtime_split/s38)."""
        released = False
        for i, s in enumerate(self.slots):
            if s is not None and s.done:
                self.slots[i] = None
                self.target_kv.reset(i)
                self.draft_kv.reset(i)
                self._set_sampling(i, None)
                released = True
        if released:
            self.target_kv.shrink()
            self.draft_kv.shrink()
        live = sum(s is not None for s in self.slots)
        if resize and self.slots and self.engines.bucket_for("drafter_block", max(1, live)) < len(self.slots) \
                and not self.waiting:
            self.resize(live)

    def sampling(self, states: list[RequestState]) -> dict[str, np.ndarray]:
        """The ops' sampling inputs over all S slots: {"temperature" [S] float32, "top_k" [S] int64,
        "top_p" [S] float32}, each request of `states` at its slot, greedy defaults (0, 0, 1) elsewhere."""
        mask = np.zeros(self.num_slots, bool)
        mask[[s.slot for s in states]] = True
        return {"temperature": np.where(mask, self.temperature, np.float32(0)),
                "top_k": np.where(mask, self.top_k, np.int64(0)),
                "top_p": np.where(mask, self.top_p, np.float32(1))}

    def _set_sampling(self, slot: int, params: SamplingParams | None) -> None:
        """Write one slot's sampling arrays (a temperature below GREEDY_BELOW is greedy: l / 1e-39 overflows)."""
        if params is None:
            self.temperature[slot], self.top_k[slot], self.top_p[slot] = 0.0, 0, 1.0
            return
        t = params.temperature
        self.temperature[slot] = t if t >= GREEDY_BELOW else 0.0
        self.top_k[slot], self.top_p[slot] = params.top_k, params.top_p
