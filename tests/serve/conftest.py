"""Servers on tiny engine directories, on free loopback ports, always stopped.

`start_server(app)` runs a FastAPI app under uvicorn in a thread on a socket bound to 127.0.0.1:0
(the kernel picks a free port) and stops it when the test ends; every wait is bounded.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx2 as httpx  # the HTTP client the openai package depends on
import pytest


API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def serve_engine_dir(tiny_engine_dir):
    return tiny_engine_dir


@pytest.fixture(scope="session")
def serve_runtime(serve_engine_dir):
    from dspark_export.runtime.api import Runtime

    return Runtime.open(serve_engine_dir, policy="dspark")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def free_loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def start_server(app, ready: bool = True):
    """Serve `app` on a free loopback port; yields its base URL; stops the server (bounded) at exit."""
    import uvicorn

    sock = free_loopback_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: server.started, 60, "uvicorn to start")
        if ready:
            wait_until(lambda: _health(base) == 200, 120, "/health 200")
        yield base
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the test server did not stop"


def _health(base: str) -> int:
    try:
        return httpx.get(base + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def metric(base: str, name: str, **labels) -> float:
    """The value of one sample on /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
