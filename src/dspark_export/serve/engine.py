"""The bridge between asyncio request handlers and the runtime's thread-safe `Service`.

One driver thread steps the `Service` (continuous batching: requests from every connection share
each step) and hands every step's events to the asyncio queue of the request they belong to
(`loop.call_soon_threadsafe`), so handlers never block the event loop on an engine pass.

`TextStream` turns a request's text deltas into what may be sent: text that could still be the start
of a stop string is held back until the next tokens decide it, the text ends before the stop string
(as `Runtime.text_of`), and a trailing U+FFFD (half a UTF-8 character) is never sent mid-stream.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from ..runtime.service import Event, Service
from .metrics import ServerMetrics
from .openai_protocol import FINISH_REASONS

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "TextStream"]


class TextStream:
    """Text of one request as it may be streamed (see the module docstring).

    Args:
        stops: the request's stop strings.
    """

    def __init__(self, stops: tuple[str, ...] = ()):
        self.stops = stops
        self.text = ""       # all text so far, cut before a stop string once one appears
        self.sent = 0        # characters of `text` already handed out
        self.stopped = False

    def feed(self, delta: str, finished: bool) -> str:
        """Add a delta; return the text that is now safe to send (all of the rest when `finished`)."""
        if not self.stopped and delta:
            self.text += delta
            hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
            if hits:    # the runtime ends the request at the token completing a stop string
                self.text, self.stopped = self.text[:min(hits)], True
        end = len(self.text) if finished or self.stopped else len(self.text) - self._held()
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def _held(self) -> int:
        """Characters at the end of `text` to hold back: the longest suffix that is a proper prefix of a
        stop string, at least 1 when the text ends in U+FFFD (a character whose bytes are incomplete)."""
        held = 0
        for s in self.stops:
            for j in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:j]):
                    held = j
                    break
        if self.text.endswith("\ufffd"):
            held = max(held, len(self.text) - len(self.text.rstrip("\ufffd")))
        return held


class AsyncEngine:
    """Drive a `Service` from one thread; submit from asyncio and await events.

    Args:
        service (Service): the opened runtime front end.
        metrics (ServerMetrics | None): step time, queue depth and running requests are recorded here.
        step_delay_s (float): testing only, a sleep before each step (`ServeConfig.debug_step_delay_s`).
    """

    def __init__(self, service: Service, metrics: ServerMetrics | None = None, step_delay_s: float = 0.0):
        self.service, self.metrics, self.step_delay_s = service, metrics, step_delay_s
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="dspark-driver", daemon=True)

    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the driver (requests still running get no more events)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._queues)

    def submit(self, prompt_ids: list[int], params, policy: str | None) -> tuple[int, asyncio.Queue]:
        """Queue a request (from the event loop); returns its id and the queue its `Event`s arrive on.

        Raises:
            RequestError: as `Service.submit` (nothing queued).
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:    # registered before the driver can deliver the request's first event
            rid = self.service.submit(prompt_ids, params, policy=policy, decode_text=True)
            self._queues[rid] = (loop, queue)
        self._wake.set()
        return rid, queue

    def cancel(self, request_id: int) -> None:
        """Cancel at the next step (the slot is freed; a final "cancelled" event follows)."""
        if self.service.cancel(request_id):
            self._wake.set()

    def _run(self) -> None:
        svc = self.service
        while not self._stopping:
            if not svc.has_work():
                self._publish_load()
                self._wake.wait(0.1)
                self._wake.clear()
                continue
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            t0 = time.perf_counter()
            try:
                svc.step()
            except Exception:  # noqa: BLE001 - Service.step confines engine faults; anything else is a bug
                log.exception("driver step failed")
            if self.metrics is not None:
                self.metrics.step_seconds.labels(self.metrics.model).observe(time.perf_counter() - t0)
            self._deliver(svc.take_events())
            self._publish_load()

    def _deliver(self, events: list[Event]) -> None:
        """Count every event (here, so a request whose client left is counted too) and hand it to its queue."""
        if self.metrics is not None:
            m = self.metrics
            for ev in events:
                if ev.token_ids:
                    m.completion_tokens.labels(m.model).inc(len(ev.token_ids))
                if ev.finished:
                    label = "cancelled" if ev.finish_reason == "cancelled" else \
                        FINISH_REASONS.get(ev.finish_reason, "error")
                    m.finished(label, ev.stats)
        with self._lock:
            targets = []
            for ev in events:
                target = self._queues.get(ev.request_id)
                if ev.finished:
                    self._queues.pop(ev.request_id, None)
                if target is not None:
                    targets.append((target, ev))
        for (loop, queue), ev in targets:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, ev)
            except RuntimeError:    # the handler's loop closed (server shutting down)
                pass

    def _publish_load(self) -> None:
        if self.metrics is not None:
            load = self.service.load()
            self.metrics.queue_depth.labels(self.metrics.model).set(load["waiting"])
            self.metrics.running.labels(self.metrics.model).set(load["running"])
