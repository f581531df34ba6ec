"""Run the app under uvicorn (one replica), with a draining shutdown.

SIGTERM or SIGINT: the app starts answering 503 (/health says "draining"), uvicorn stops accepting
connections and waits up to `drain_s` seconds for the requests in flight (streams included) to
finish, then the lifespan stops the driver thread and the process exits.
"""

from __future__ import annotations

import logging
import signal
import sys

import uvicorn

from .app import ServeConfig, create_app

log = logging.getLogger(__name__)

__all__ = ["serve_forever", "DrainingServer"]


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose exit signal first marks the app as draining (new requests get 503)."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.dspark_state = state

    def handle_exit(self, sig, frame) -> None:
        self.dspark_state.draining = True
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:       # a drained SIGTERM is the expected end: exit 0, not re-raised
            self._captured_signals.remove(sig)


def serve_forever(config: ServeConfig, host: str = "127.0.0.1", port: int = 8000, drain_s: float = 30.0,
                  log_level: str = "warning", ready_message=None) -> int:
    """Serve until SIGTERM/SIGINT (drained) or a failed load (exit code 2). Returns the exit code."""
    app = create_app(config)
    state = app.state.dspark
    server = DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                           timeout_graceful_shutdown=drain_s, access_log=False), state)
    failed: list[str] = []

    def load_failed(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    state.on_load_error = load_failed
    if ready_message is not None:
        print(ready_message, file=sys.stderr, flush=True)
    server.run()
    if failed:
        raise_error = failed[0]
        print(f"dspark-export serve: error: could not load {config.engine_dir}: {raise_error}", file=sys.stderr)
        return 2
    return 0
