"""A thread-safe request front end over one engine directory, for services that embed the runtime.

`Service` is what the C++ library (`cpp/`, `include/dspark/runtime.h`) hosts in-process, and what a
Python service (an RPC handler, a web server) uses directly: requests are submitted from any thread,
one driver thread advances them (`step`), and every step's committed tokens come back as `Event`s
(`take_events`), so the driver never calls back into foreign code while it holds the interpreter.

    svc = Service.open("engines/smollm2", policy="dspark-async")
    rid = svc.submit("What is 2+3?", {"max_new_tokens": 64}, chat=True)
    while svc.has_work():
        svc.step()
        for ev in svc.take_events():
            print(ev.text_delta, end="")

Policies: each request may name its own verification policy. Requests with the same policy are
batched together by one `Generator` (continuous batching, one packed target pass per step); requests
with different policies run in separate generators that share the engines and take turns, one step
each, in `step` (a policy decides verify lengths from the confidences of every request in its batch,
so one batch has one policy).

Thread rules: `submit`, `cancel`, `stats` and `take_events` may be called from any thread; `step` from
one thread at a time (the driver).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from . import DEFAULT_POLICY
from ..errors import RequestError
from .api import Runtime
from .generator import Generator
from .policies import Policy, parse_policy
from .request import GenerationResult, SamplingParams

__all__ = ["Service", "Event", "sampling_params_from"]

_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}

#: generators (one per distinct policy) a Service keeps at once. A policy is request input (threshold:C
#: takes any real C) and each generator holds its own buffers and is visited every step, so beyond this
#: idle ones other than the default's are dropped, and a new policy while all are busy is refused.
MAX_POLICIES = 8


def sampling_params_from(value: SamplingParams | Mapping | None) -> SamplingParams:
    """SamplingParams from a SamplingParams or a mapping of its fields (unknown keys refused), validated.

    Raises:
        RequestError: an unknown field, a value of the wrong type, or a value out of range (names the field).
    """
    if value is None:
        params = SamplingParams()
    elif isinstance(value, SamplingParams):
        params = value
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - _PARAM_FIELDS)
        if unknown:
            raise RequestError(f"sampling params: unknown fields {unknown}; expected some of {sorted(_PARAM_FIELDS)}")
        kw = dict(value)
        if kw.get("seed", None) == -1:  # the C++ API's "no seed"; other negatives are refused by validate
            kw["seed"] = None
        params = SamplingParams(**kw)
    else:
        raise RequestError(f"sampling params: expected SamplingParams or a mapping, found {type(value).__name__}")
    if isinstance(params.temperature, int):
        params = SamplingParams(**{**params.__dict__, "temperature": float(params.temperature)})
    if not isinstance(params.temperature, float) or not isinstance(params.top_p, (float, int)):
        raise RequestError(f"sampling params: temperature and top_p must be numbers, found "
                           f"{params.temperature!r}, {params.top_p!r}")
    params.validate()
    return params


@dataclass
class Event:
    """Tokens committed for one request by one step (or its end).

    Attributes:
        request_id: the id `Service.submit` returned.
        token_ids: generated token ids committed by this step (may be empty on the final event).
        text_delta: newly decodable text (a multi-byte character split across tokens is held back
            until complete); "" when nothing new decodes.
        finished: whether the request ended with this event.
        finish_reason: None while running; "stop", "length", "capacity", "error" or "cancelled".
        error: the reason of a failed request, else None.
        stats: on the final event, the request's counters (`RequestStats.to_dict()`); else {}.
    """

    request_id: int
    token_ids: list[int]
    text_delta: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    stats: dict = field(default_factory=dict)


@dataclass
class _Tracked:
    generator: Generator
    local_id: int
    decode_text: bool
    tokens: list[int] = field(default_factory=list)
    text: str = ""


class Service:
    """Requests in, events out, over one engine directory (see the module docstring).

    Args:
        runtime (Runtime): the opened engine directory (engines + tokenizer).
        policy (str | Policy): the default verification policy.
        max_slots (int | None): requests decoded at once per policy (`Generator`'s max_slots); None = the
            largest drafter bucket.
        max_policies (int): distinct policies (generators) kept at once (`MAX_POLICIES`).
        kv_prefault_tokens (int): when > 0, the default policy's generator is made now and its KV caches
            written once for max_slots requests of this many tokens (`Batch.prefault_kv`), so no request
            pays first-touch page faults while the caches grow to that size; 0 = grow on demand.
    """

    def __init__(self, runtime: Runtime, policy: str | Policy = DEFAULT_POLICY, max_slots: int | None = None,
                 max_policies: int = MAX_POLICIES, kv_prefault_tokens: int = 0):
        self.runtime = runtime
        self.max_slots = max_slots
        self.max_policies = max(1, max_policies)
        self.default_policy = policy if isinstance(policy, Policy) else parse_policy(policy)
        self._lock = threading.RLock()
        self._generators: dict[str, Generator] = {}
        self._tracked: dict[int, _Tracked] = {}
        self._by_local: dict[tuple[int, int], int] = {}
        self._events: list[Event] = []
        self._next_id = 1
        self._counts = dict(submitted=0, finished=0, failed=0, cancelled=0, steps=0, generated_tokens=0)
        gen = self._generator(self.default_policy)   # fail early: a dspark policy without a profile
        if kv_prefault_tokens:
            gen.batch.prefault_kv(kv_prefault_tokens)

    @classmethod
    def open(cls, engine_dir: str | Path, policy: str | Policy = DEFAULT_POLICY, verify: bool = True,
             threads: int = 0) -> "Service":
        """Load and check an engine directory (see `Runtime.open`).

        Raises:
            EngineDirError: missing directory, missing/altered files, bad manifest or profile.
            RequestError: unknown policy.
        """
        return cls(Runtime.open(engine_dir, policy=policy, verify=verify, threads=threads), policy)

    # -- requests ----------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | Mapping | None = None,
               policy: str | None = None, chat: bool = False, decode_text: bool = True) -> int:
        """Queue one request; returns its id (≥ 1).

        Args:
            prompt: text (encoded with the engine directory's tokenizer; `chat` applies its chat
                template as one user turn) or token ids.
            params: SamplingParams or a mapping of its fields; None = defaults (greedy, 128 tokens).
            policy: "ar", "fixed:K", "threshold:C", "dspark", "dspark-async"; None = the default.
            chat: apply the chat template (text prompts only).
            decode_text: fill `Event.text_delta` (needs the tokenizer; off for id-only clients).
        Raises:
            RequestError: invalid parameters, unknown policy, empty prompt, ids outside the
                vocabulary, or a prompt longer than the engine's capacity. Nothing is queued then.
        """
        params = sampling_params_from(params)
        parsed = parse_policy(policy) if policy else self.default_policy
        if isinstance(prompt, str):
            ids = self.runtime.encode(prompt, chat)
        else:
            if chat:
                raise RequestError("chat: the chat template applies to text prompts; found token ids")
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError) as e:
                raise RequestError(f"prompt: expected text or a list of token ids ({e})") from e
        with self._lock:    # held from lookup to submit: an idle generator is never dropped in between
            gen = self._generator(parsed)
            gen.check_request(ids, params)          # raise here, synchronously, instead of an error result
            rid, self._next_id = self._next_id, self._next_id + 1
            self._counts["submitted"] += 1
            # The generator's id is assigned inside submit; map it under the same lock so the driver
            # never sees an event of an unmapped request.
            local = gen.submit(ids, params, on_token=functools.partial(self._on_token, gen))
            self._tracked[rid] = _Tracked(gen, local, decode_text)
            self._by_local[(id(gen), local)] = rid
        return rid

    def cancel(self, request_id: int) -> bool:
        """Stop a request at the next step (final event with finish_reason "cancelled"); its slot is
        freed. Returns False if the id is unknown or the request already finished."""
        with self._lock:
            t = self._tracked.get(request_id)
        return bool(t and t.generator.cancel(t.local_id))

    def has_work(self) -> bool:
        """Whether any request is queued or running."""
        with self._lock:
            gens = list(self._generators.values())
        return any(g.has_work() for g in gens)

    def step(self) -> bool:
        """Advance every generator with work by one step (driver thread only); returns `has_work()`."""
        with self._lock:
            gens = list(self._generators.values())
        for g in gens:
            if g.has_work():
                try:
                    g.step()
                except Exception as e:  # noqa: BLE001 - an engine failure the generator could not isolate
                    self._fail_generator(g, e)
                with self._lock:
                    self._counts["steps"] += 1
        return self.has_work()

    def take_events(self) -> list[Event]:
        """The events produced since the last call, in commit order."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def load(self) -> dict:
        """Requests waiting for a KV-cache slot ("waiting") and holding one ("running"), over every
        policy's generator, and the slots each generator may hold ("slots", the largest)."""
        with self._lock:
            gens = list(self._generators.values())
        return {"waiting": sum(len(g.batch.waiting) for g in gens),
                "running": sum(s is not None for g in gens for s in g.batch.slots),
                "slots": max((g.max_slots for g in gens), default=0)}

    def stats(self) -> dict:
        """Counters: submitted, finished (all reasons), failed ("error"), cancelled, steps,
        generated_tokens, running (submitted and not finished)."""
        with self._lock:
            counts = dict(self._counts)
        counts["running"] = counts["submitted"] - counts["finished"]
        return counts

    # -- internals ---------------------------------------------------------------------------
    def _generator(self, policy: Policy) -> Generator:
        key = str(policy)
        with self._lock:
            gen = self._generators.get(key)
        if gen is None:
            # may raise: no profile, fixed:K > γ. detokenize: stop strings, matched as `Runtime` does
            gen = Generator(self.runtime.engines, policy, max_slots=self.max_slots, detokenize=self.runtime.decode)
            with self._lock:
                if key not in self._generators and len(self._generators) >= self.max_policies:
                    default = str(self.default_policy)
                    for k, g in list(self._generators.items()):
                        if k != default and not g.has_work():
                            del self._generators[k]
                    if len(self._generators) >= self.max_policies:
                        raise RequestError(f"policy: {len(self._generators)} policies have requests running, the "
                                           f"limit of this service; found a new one {key!r}, use one of "
                                           f"{sorted(self._generators)} or retry later")
                gen = self._generators.setdefault(key, gen)
        return gen

    def _fail_generator(self, gen: Generator, error: Exception) -> None:
        """End every request of `gen` with finish_reason "error" and retire `gen` (its KV state may be
        half-written); later requests with that policy get a fresh generator. Other policies' requests
        are not touched."""
        reason = f"engine step failed ({type(error).__name__}: {error})"
        with self._lock:
            for key, g in list(self._generators.items()):
                if g is gen:
                    del self._generators[key]
            mine = [(local, rid) for (gid, local), rid in self._by_local.items() if gid == id(gen)]
        for local, _ in mine:
            state = gen.batch.requests.get(local)
            if state is not None:
                state.result.finish_reason, state.result.error = "error", reason
                self._on_token(gen, local, [], state.result)

    def _on_token(self, gen: Generator, local_id: int, tokens: list[int], result: GenerationResult) -> None:
        """Generator callback (driver thread): turn committed tokens into an Event."""
        with self._lock:
            rid = self._by_local.get((id(gen), local_id))
            t = self._tracked.get(rid) if rid is not None else None
        if t is None:
            return
        t.tokens += tokens
        delta = ""
        done = result.finish_reason is not None
        if t.decode_text and (tokens or done):
            text = self.runtime.tokenizer.decode(t.tokens, skip_special_tokens=True) if t.tokens else ""
            if done or not text.endswith("\ufffd"):  # hold back a split multi-byte character until the end
                delta = text[len(t.text):] if text.startswith(t.text) else text
                t.text = text
        event = Event(rid, list(tokens), delta, done, result.finish_reason, result.error,
                      result.stats.to_dict() if done else {})
        with self._lock:
            self._events.append(event)
            self._counts["generated_tokens"] += len(tokens)
            if done:
                self._counts["finished"] += 1
                self._counts["failed"] += result.finish_reason == "error"
                self._counts["cancelled"] += result.finish_reason == "cancelled"
                del self._by_local[(id(gen), local_id)]
                del self._tracked[rid]
                gen.batch.requests.pop(local_id, None)    # the generator keeps results until asked; we deliver them
