"""`dspark-export serve` as a process: loopback by default, the API key from the environment, flag
errors, and SIGTERM draining (the stream in flight finishes, new connections are refused, exit 0)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

from dspark_export.cli import _parser, main
from dspark_export.runtime.request import SamplingParams

from .conftest import free_loopback_socket, wait_until


def test_serve_defaults_to_loopback_and_refuses_bad_flags(tmp_path, capsys):
    args = _parser().parse_args(["serve", "--engine-dir", str(tmp_path)])
    assert args.host == "127.0.0.1" and args.replicas == 1 and args.api_key is None
    assert main(["serve", "--engine-dir", str(tmp_path / "missing")]) == 2
    assert "--engine-dir" in capsys.readouterr().err
    assert main(["serve", "--engine-dir", str(tmp_path), "--max-queue", "-1"]) == 2
    assert "--max-queue" in capsys.readouterr().err
    assert args.kv_prefault_tokens == 0
    assert main(["serve", "--engine-dir", str(tmp_path), "--kv-prefault-tokens", "-5"]) == 2
    assert "--kv-prefault-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--engine-dir", str(tmp_path), "--max-slots", "0"])


def test_sigterm_drains_the_stream_in_flight_then_exits(serve_engine_dir, serve_runtime):
    sock = free_loopback_socket()
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "DSPARK_API_KEY": "env-key", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-m", "dspark_export.cli", "serve", "--engine-dir", str(serve_engine_dir),
                             "--port", str(port), "--debug-step-delay", "0.05", "--drain-seconds", "60"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            try:
                return httpx.get(base + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
                return False
        wait_until(healthy, 180, "the server to load", interval=0.5)
        body = {"model": "tiny", "prompt": "drain me", "max_tokens": 40, "temperature": 0, "stream": True}
        assert httpx.post(base + "/v1/completions", json={**body, "stream": False}, timeout=30).status_code == 401
        headers = {"authorization": "Bearer env-key"}
        serve_runtime.set_policy("dspark")
        want = serve_runtime.generate_text(["drain me"], SamplingParams(max_new_tokens=40))[0].text
        parts, done = [], False
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(lines)
            parts.append(json.loads(first[6:])["choices"][0]["text"])
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            # no new requests while draining: refused, or 503 if the listener has not closed yet
            try:
                late = httpx.post(base + "/v1/completions", json={**body, "stream": False}, headers=headers,
                                  timeout=10).status_code
            except httpx.HTTPError:
                late = "refused"
            assert late in (503, "refused"), late
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    parts.append(json.loads(line[6:])["choices"][0]["text"])
        assert done and "".join(parts) == want
        assert proc.wait(60) == 0
        assert time.monotonic() - t0 < 60
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
