"""The OpenAI-compatible HTTP app (FastAPI) over one engine directory's runtime.

    app = create_app(ServeConfig(engine_dir="engines/smollm2"))     # uvicorn.run(app) or Ray Serve ingress

Routes:
    GET  /health                200 when the engines are loaded, 503 while loading, failed or draining
    GET  /v1/models             the one served model (id = the engine directory's name unless model_name)
    POST /v1/chat/completions   chat (the tokenizer's chat template), JSON or SSE (`stream: true`)
    POST /v1/completions        text or token-id prompt, JSON or SSE
    GET  /metrics               Prometheus text format (`serve/metrics.py`)

Every response carries `x-dspark-replica` (this replica's name). Errors are OpenAI's error JSON: 400
bad parameter or over-long prompt, 401 wrong/missing API key (when one is set; compared with
`hmac.compare_digest`), 404 unknown model or route, 413 body over `max_body_bytes`, 429 more than
`max_slots + max_queue` requests in flight, 503 loading/draining, 500 a request the engine failed.

The engines load in a thread started by the app's lifespan, so /health answers (503) while they load;
this works alike under uvicorn (`serve/server.py`) and Ray Serve (`serve/ray_deploy.py`), which both
run the lifespan.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import RequestError
from ..runtime import DEFAULT_POLICY
from .engine import AsyncEngine, TextStream
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .openai_protocol import (FINISH_REASONS, ParsedRequest, ProtocolError, chunk_body, error_body, parse_body,
                              response_body, usage_chunk)

log = logging.getLogger(__name__)

__all__ = ["ServeConfig", "create_app", "API_KEY_ENV"]

#: environment variable read for the API key when `ServeConfig.api_key` is None
API_KEY_ENV = "DSPARK_API_KEY"


@dataclass
class ServeConfig:
    """What one replica serves and its limits.

    Attributes:
        engine_dir: an engine directory made by `build`.
        policy: default verification policy (requests may name their own with the `policy` extra).
        model_name: the model id clients send; None = the engine directory's folder name.
        api_key: bearer key required on /v1/*; None = read `DSPARK_API_KEY`; "" = no key.
        max_body_bytes: request bodies above this get 413.
        max_queue: requests allowed to wait for a KV-cache slot; beyond `max_slots + max_queue` in flight: 429.
        max_slots: requests decoded at once (None = the largest drafter bucket).
        kv_prefault_tokens: write the KV caches once at startup for max_slots requests of this many tokens
            (`Service`'s kv_prefault_tokens); 0 = grow on demand.
        threads: ONNX Runtime intra-op threads (0 = its choice).
        backend: "onnxruntime" or "tensorrt".
        verify: check the engine files' sha256 at load.
        replica_name: the `x-dspark-replica` header; None = Ray's replica id under Ray Serve, else host:pid.
        load_in_background: load the engines in a thread while /health answers 503 (uvicorn); False: the
            app's startup waits for them (Ray Serve, so a replica is routed to only once it can serve).
    """

    engine_dir: str | Path
    policy: str = DEFAULT_POLICY
    model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_queue: int = 64
    max_slots: int | None = None
    kv_prefault_tokens: int = 0
    threads: int = 0
    backend: str = "onnxruntime"
    verify: bool = True
    replica_name: str | None = None
    load_in_background: bool = True
    #: testing only: seconds the driver sleeps before each step, so fault-injection tests (a replica
    #: killed mid-request) can slow a tiny engine down; 0 in production
    debug_step_delay_s: float = 0.0

    @property
    def served_model(self) -> str:
        return self.model_name or Path(self.engine_dir).resolve().name


class _State:
    """Loading status, the engine bridge, metrics and the draining flag of one app."""

    def __init__(self, config: ServeConfig, service=None):
        self.config = config
        self.model = config.served_model
        key = config.api_key if config.api_key is not None else os.environ.get(API_KEY_ENV, "")
        self.api_key = key.encode() if key else None
        self.metrics = ServerMetrics(self.model)
        self.engine: AsyncEngine | None = None
        self.runtime = None
        self.load_error: str | None = None
        self.draining = False
        self.replica = config.replica_name
        self._service = service          # a prebuilt Service (tests, benchmarks): no loading
        self._loader: threading.Thread | None = None
        self.on_load_error = None        # called with the message when loading fails (the CLI exits)

    async def start(self) -> None:
        if self.replica is None:
            self.replica = _replica_name()
        if self._service is not None:
            self._ready(self._service)
        elif self.config.load_in_background:
            self._loader = threading.Thread(target=self._load, name="dspark-load", daemon=True)
            self._loader.start()
        else:
            await asyncio.to_thread(self._load)
            if self.load_error is not None:
                raise RuntimeError(f"could not load {self.config.engine_dir}: {self.load_error}")

    def _load(self) -> None:
        from ..runtime.api import Runtime
        from ..runtime.service import Service

        c = self.config
        try:
            rt = Runtime.open(c.engine_dir, policy=c.policy, verify=c.verify, threads=c.threads, backend=c.backend)
            self._ready(Service(rt, c.policy, max_slots=c.max_slots, kv_prefault_tokens=c.kv_prefault_tokens))
        except Exception as e:  # noqa: BLE001 - reported on /health and by the CLI, never a silent hang
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("loading %s failed: %s", c.engine_dir, self.load_error)
            if self.on_load_error is not None:
                self.on_load_error(self.load_error)

    def _ready(self, service) -> None:
        self.runtime = service.runtime
        self.engine = AsyncEngine(service, self.metrics, step_delay_s=self.config.debug_step_delay_s).start()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    @property
    def capacity(self) -> int:
        """Requests in flight at most: the slots of the default policy's generator plus the queue."""
        slots = self.engine.service.load()["slots"] if self.engine is not None else 0
        return slots + self.config.max_queue


def _replica_name() -> str:
    """Ray Serve's replica id inside a Ray Serve replica (ray.serve is imported there), else host:pid."""
    if "ray.serve" in sys.modules:
        try:
            ctx = sys.modules["ray.serve"].get_replica_context()
            return f"{ctx.deployment}#{ctx.replica_tag}"
        except Exception:  # noqa: BLE001 - ray imported, but this process is no replica
            pass
    return f"{socket.gethostname()}:{os.getpid()}"


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


class _Limits:
    """Pure ASGI middleware: `x-dspark-replica` on every response; request bodies above the limit get 413
    before any handler runs (the body is read here, up to the limit, and replayed to the app)."""

    def __init__(self, app, state: _State):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-dspark-replica", (self.state.replica or _replica_name()).encode()))
                message = {**message, "headers": headers}
            await send(message)

        limit = self.state.config.max_body_bytes
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            self.state.metrics.rejected.labels(self.state.model, "413").inc()
            resp = _error(413, f"body: {int(declared)} bytes exceed the limit of {limit} bytes (--max-body-bytes)",
                          code="request_too_large")
            return await resp(scope, receive, send_tagged)
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    self.state.metrics.rejected.labels(self.state.model, "413").inc()
                    resp = _error(413, f"body: more than {limit} bytes (--max-body-bytes)", code="request_too_large")
                    return await resp(scope, receive, send_tagged)
                chunks.append(chunk)
                more = message.get("more_body", False)
            body, replayed = b"".join(chunks), False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()      # later calls wait for the disconnect, as the server's own would

            return await self.app(scope, replay, send_tagged)
        return await self.app(scope, receive, send_tagged)


def create_app(config: ServeConfig, service=None) -> FastAPI:
    """The FastAPI app of one replica (see the module docstring).

    Args:
        config: what to serve and the limits.
        service: an already opened `runtime.service.Service` to serve instead of loading
            `config.engine_dir` (tests and in-process benchmarks share one runtime this way).
    """
    state = _State(config, service)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            state.close()

    app = FastAPI(title="dspark-export", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dspark = state
    app.add_middleware(_Limits, state=state)

    @app.exception_handler(ProtocolError)
    async def _protocol_error(request: Request, e: ProtocolError):
        state.metrics.rejected.labels(state.model, str(e.status)).inc()
        return _error(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind)

    def check_auth(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # compare_digest on bytes: time independent of where the key and the token differ
        if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), state.api_key)):
            raise ProtocolError("authorization: missing or wrong API key (expected 'Authorization: Bearer KEY')",
                                status=401, type="authentication_error", code="invalid_api_key")

    def check_ready() -> None:
        if state.draining:
            raise ProtocolError("server: shutting down (draining); retry on another replica", status=503,
                                type="service_unavailable")
        if state.engine is None:
            what = f"failed to load ({state.load_error})" if state.load_error else "still loading the engines"
            raise ProtocolError(f"server: {what}", status=503, type="service_unavailable")

    @app.get("/health")
    async def health():
        if state.engine is not None and not state.draining:
            return {"status": "ok", "model": state.model, "replica": state.replica}
        status = "draining" if state.draining else "failed" if state.load_error else "loading"
        return JSONResponse({"status": status, "error": state.load_error, "replica": state.replica}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": state.model, "object": "model", "created": 0,
                                            "owned_by": "dspark-export"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, "completion")

    async def _complete(request: Request, kind: str):
        check_auth(request)
        check_ready()
        arrived = time.perf_counter()
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtocolError(f"body: not valid JSON ({e})") from None
        req = parse_body(kind, body, state.runtime, state.model)
        if state.engine.in_flight() >= state.capacity:
            raise ProtocolError(f"server: {state.engine.in_flight()} requests in flight, the limit is "
                                f"{state.capacity} (slots + --max-queue); retry later", status=429,
                                type="rate_limit_error", code="queue_full")
        try:
            rid, queue = state.engine.submit(req.prompt_ids, req.params, req.policy)
        except RequestError as e:
            field = str(e).split(":", 1)[0]
            raise ProtocolError(str(e), param=field if field.isidentifier() else None) from None
        run = _Run(state, req, rid, queue, arrived)
        if req.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        return await run.collect(request)

    return app


class _Run:
    """One admitted request: reads its events, records its metrics, answers as JSON or SSE."""

    def __init__(self, state: _State, req: ParsedRequest, rid: int, queue: asyncio.Queue, arrived: float):
        self.state, self.req, self.rid, self.queue, self.arrived = state, req, rid, queue, arrived
        self.text = TextStream(req.params.stop)
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.tokens = 0

    def _observe(self, ev) -> None:
        m, model = self.state.metrics, self.state.model
        now = time.perf_counter()
        if ev.token_ids:
            n = len(ev.token_ids)
            self.tokens += n
            if self.first_token is None:
                self.first_token = now
                m.ttft.labels(model).observe(now - self.arrived)
                n -= 1
            elif self.last_token is not None:
                for _ in range(n):
                    m.itl.labels(model).observe((now - self.last_token) / n)
            self.last_token = now
        if ev.finished:
            m.e2e.labels(model).observe(now - self.arrived)

    def _usage(self, ev) -> tuple[int, int]:
        return (ev.stats.get("prompt_tokens", len(self.req.prompt_ids)),
                ev.stats.get("completion_tokens", self.tokens))

    async def collect(self, request: Request):
        """Wait for the end; a client that leaves meanwhile cancels the request (its slot is freed)."""
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(self.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        self.state.engine.cancel(self.rid)
                        return Response(status_code=499)
                    continue
                self._observe(ev)
                self.text.feed(ev.text_delta, ev.finished)
                if ev.finished:
                    break
        except asyncio.CancelledError:
            self.state.engine.cancel(self.rid)
            raise
        if ev.finish_reason == "error":
            return _error(500, f"generation failed: {ev.error}", "server_error", code="generation_failed")
        return JSONResponse(response_body(self.req, self.text.text, FINISH_REASONS[ev.finish_reason],
                                          *self._usage(ev)))

    async def sse(self):
        """SSE chunks: a role chunk (chat), text deltas, the finish chunk, a usage chunk when asked, [DONE].
        An engine failure sends an OpenAI error event before [DONE]. Leaving early cancels the request."""
        finished = role_sent = False
        try:
            while True:
                ev = await self.queue.get()
                if self.req.kind == "chat" and not role_sent:
                    # the role chunk goes with the first event, so a stream that has sent nothing has
                    # generated nothing (the Ray router retries such a request on another replica)
                    role_sent = True
                    yield _sse(chunk_body(self.req, None, None, first=True))
                self._observe(ev)
                piece = self.text.feed(ev.text_delta, ev.finished)
                if ev.finished:
                    finished = True
                    if ev.finish_reason == "error":
                        if piece:
                            yield _sse(chunk_body(self.req, piece, None))
                        yield _sse(error_body(f"generation failed: {ev.error}", "server_error",
                                              code="generation_failed"))
                    else:
                        yield _sse(chunk_body(self.req, piece, FINISH_REASONS[ev.finish_reason]))
                        if self.req.include_usage:
                            yield _sse(usage_chunk(self.req, *self._usage(ev)))
                    yield "data: [DONE]\n\n"
                    return
                if piece:
                    yield _sse(chunk_body(self.req, piece, None))
        finally:
            if not finished:        # the client left (or the server stops): free the slot
                self.state.engine.cancel(self.rid)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
