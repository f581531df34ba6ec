"""`serve --replicas N`: N runtime replicas on Ray Serve, each running the same FastAPI app, behind a
retrying router.

Two deployments form one Ray Serve application:

- `dspark-engine` (N replicas): each builds `create_app(config)` and loads the engines in its
  constructor (a replica is routed to only once it can serve), then answers one HTTP request per
  `handle` call by driving the app over ASGI in-process and streaming back its ASGI messages;
- `dspark` (the HTTP ingress, one replica, no CPU reserved): a small ASGI router that forwards each
  request through a Ray Serve deployment handle (Ray's power-of-two-choices routing over the engine
  replicas) and streams the answer back.

Replica death: Ray Serve's controller replaces the replica. The router retries a request on another
replica while the failed attempt had sent no body bytes (nothing streamed: a request still queued
or prefilling, or any non-streaming request, whose JSON comes in one piece at the end); a stream that
had already sent text ends with an OpenAI error event (`data: {"error": ...}`) and `data: [DONE]`.
Nothing hangs: every attempt ends in a result or an error. Every response names its engine replica in
`x-dspark-replica` ("dspark-engine#<replica id>").
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import threading
from typing import Callable

from ..errors import ConfigError
from .app import ServeConfig

log = logging.getLogger(__name__)

__all__ = ["deployment", "start_on_ray", "serve_on_ray", "RayDeployment", "DEPLOYMENT_NAME", "ENGINE_NAME"]

DEPLOYMENT_NAME = "dspark"          # the Ray Serve application and its HTTP ingress
ENGINE_NAME = "dspark-engine"       # the runtime replicas
#: attempts per request when replicas fail before sending anything (one per replica, at most this many)
MAX_ATTEMPTS = 3


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise ConfigError("--replicas > 1 needs Ray Serve: pip install 'dspark-export[ray]' "
                          f"(ray[serve]); found no ray ({e})") from e
    return ray, serve


def deployment(config: ServeConfig, replicas: int, replica_cpus: float = 1.0):
    """The bound Ray Serve application: the router in front of `replicas` engine replicas.

    Args:
        config: what each replica serves (its engines load in the replica's constructor).
        replicas: engine replicas (Ray Serve's num_replicas).
        replica_cpus: CPUs Ray reserves for each engine replica.
    """
    ray, serve = _ray()
    config = dataclasses.replace(config, load_in_background=False)
    per_replica = max(8, config.max_queue + (config.max_slots or 16))

    @serve.deployment(name=ENGINE_NAME, num_replicas=replicas, ray_actor_options={"num_cpus": replica_cpus},
                      max_ongoing_requests=per_replica, health_check_period_s=2, health_check_timeout_s=30,
                      graceful_shutdown_timeout_s=30)
    class DsparkEngine:
        async def __init__(self, cfg: ServeConfig):
            from dspark_export.engines.ort.runner import use_shared_thread_pool
            from dspark_export.serve.app import create_app

            use_shared_thread_pool(cfg.threads)     # the replica's actor process is its alone, as the command's is
            self.app = create_app(cfg)
            await self.app.state.dspark.start()      # loads the engines, names the replica

        async def handle(self, scope: dict, body: bytes):
            """Serve one HTTP request through the app; yields its ASGI send messages."""
            from dspark_export.serve.ray_deploy import drive_asgi

            async for message in drive_asgi(self.app, scope, body):
                yield message

        def check_health(self):
            state = self.app.state.dspark
            if state.load_error is not None or state.engine is None:
                raise RuntimeError(f"replica not serving: {state.load_error or 'no engine'}")

    @serve.deployment(name=DEPLOYMENT_NAME, num_replicas=1, ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=replicas * per_replica + 16)
    @serve.ingress()
    class DsparkRouter:
        def __init__(self, engine, max_body_bytes: int):
            self.engine, self.max_body_bytes = engine, max_body_bytes

        def __serve_build_asgi_app__(self):
            from dspark_export.serve.ray_deploy import Router

            return Router(self.engine, self.max_body_bytes)

    return DsparkRouter.bind(DsparkEngine.bind(config), config.max_body_bytes)


async def drive_asgi(app, scope: dict, body: bytes):
    """Run `app` on one HTTP request (`scope`, complete `body`) and yield the messages it sends. Closing
    this generator early (the caller went away) disconnects the request, so the app cancels it."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await messages.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            yield message
        if task.exception() is not None:
            raise task.exception()
    finally:
        if not task.done():
            gone.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), 5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the request is abandoned either way
                task.cancel()


_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path",
               "headers", "client", "server")


class Router:
    """The ingress ASGI app (module docstring): forwards each request to an engine replica, retrying
    while nothing was sent; a client that leaves cancels the replica's request."""

    def __init__(self, engine, max_body_bytes: int):
        self.engine, self.max_body_bytes = engine, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        chunks, size, more = [], 0, True
        while more:                             # up to limit + 1 bytes: the replica answers 413 beyond it
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            if size <= self.max_body_bytes:
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
            more = message.get("more_body", False)
        body = b"".join(chunks)[:self.max_body_bytes + 1]
        plain = {k: scope[k] for k in _SCOPE_KEYS if k in scope}
        plain["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
        plain["state"] = {}
        for attempt in range(1, MAX_ATTEMPTS + 1):
            sent = await self._attempt(plain, body, receive, send, last=attempt == MAX_ATTEMPTS)
            if sent:
                return
            log.warning("request %s %s: replica failed before sending anything; retry %d", scope.get("method"),
                        scope.get("path"), attempt)

    async def _attempt(self, scope, body, receive, send, last: bool) -> bool:
        """One try on some replica; False when it failed before any body byte (so it may be retried)."""
        stream = self.engine.options(stream=True).handle.remote(scope, body)
        start, streamed, sse = None, False, False
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            async for message in _until(stream, watcher):
                if message["type"] == "http.response.start":
                    start = message
                    sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                              for k, v in message.get("headers", []))
                    continue
                if not streamed:
                    await send(start)
                    streamed = True
                await send(message)
            return True
        except _Disconnected:
            stream.cancel()
            return True
        except Exception as e:  # noqa: BLE001 - a dead replica raises Ray's actor errors
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if not streamed and not last:
                return False
            if not streamed:
                payload = json.dumps({"error": {"message": f"no replica could serve the request ({reason})",
                                                "type": "service_unavailable", "param": None,
                                                "code": "replica_failed"}}).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"x-dspark-replica", DEPLOYMENT_NAME.encode())]})
                await send({"type": "http.response.body", "body": payload})
            elif sse:
                event = {"error": {"message": f"the replica serving this stream failed ({reason})",
                                   "type": "server_error", "param": None, "code": "replica_failed"}}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(),
                            "more_body": True})
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            else:
                await send({"type": "http.response.body", "body": b""})
            return True
        finally:
            watcher.cancel()


class _Disconnected(Exception):
    pass


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until(stream, watcher):
    """Items of the replica's stream; raises _Disconnected as soon as the client leaves."""
    iterator = stream.__aiter__()
    while True:
        step = asyncio.ensure_future(iterator.__anext__())
        done, _ = await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if step not in done:
            step.cancel()
            raise _Disconnected()
        try:
            yield step.result()
        except StopAsyncIteration:
            return


class RayDeployment:
    """A running deployment: `start_on_ray` returns it, `stop()` deletes it (and stops the Ray instance and
    Serve if they were started here)."""

    def __init__(self, started_here: bool):
        self.started_here = started_here

    def stop(self) -> None:
        ray, serve = _ray()
        try:
            serve.delete(DEPLOYMENT_NAME)
            if self.started_here:
                serve.shutdown()
        finally:
            if self.started_here:
                ray.shutdown()


def start_on_ray(config: ServeConfig, replicas: int, host: str = "127.0.0.1", port: int = 8000,
                 ray_address: str | None = None, replica_cpus: float = 1.0, num_cpus: int | None = None,
                 progress: Callable[[str], None] = print) -> RayDeployment:
    """Deploy on a local Ray instance (started here: `num_cpus` CPUs, default this machine's, no
    dashboard) or the cluster at `ray_address`; returns once every replica has loaded its engines.

    Raises:
        ConfigError: no Ray installed.
    """
    ray, serve = _ray()
    started_here = not ray_address
    if started_here:
        cpus = num_cpus or max(os.cpu_count() or 1, int(replicas * replica_cpus + 0.999))
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=ray_address, log_to_driver=False)
    handle = RayDeployment(started_here)
    try:
        serve.start(http_options={"host": host, "port": port})
        progress(f"deploying {replicas} replicas of {config.served_model} on Ray "
                 f"({'a local instance' if started_here else ray_address}), http://{host}:{port}/v1")
        serve.run(deployment(config, replicas, replica_cpus), name=DEPLOYMENT_NAME, route_prefix="/", blocking=False)
    except BaseException:
        handle.stop()
        raise
    progress("all replicas ready")
    return handle


def serve_on_ray(config: ServeConfig, replicas: int, host: str = "127.0.0.1", port: int = 8000,
                 ray_address: str | None = None, replica_cpus: float = 1.0,
                 progress: Callable[[str], None] = print) -> int:
    """`start_on_ray`, then serve until SIGTERM/SIGINT and stop (Ray Serve drains each replica for up
    to graceful_shutdown_timeout_s). Returns the exit code."""
    running = start_on_ray(config, replicas, host, port, ray_address, replica_cpus, progress=progress)
    stop = threading.Event()
    # after ray.init, which installs its own SIGTERM handler (a SIGTERM during startup exits through it)
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(1.0):
            pass
        progress("shutting down (draining the replicas)")
        return 0
    finally:
        try:
            running.stop()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
