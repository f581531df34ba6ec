"""`serve --replicas 2` on a local Ray instance started by the test (2 CPUs, no dashboard, shut down at
the end): requests spread over both replicas with their solo outputs, and killing a replica loses no
request silently (each ends complete and correct, or with an explicit error event; a request that had
streamed nothing is retried on the other replica, non-streaming ones included); Ray replaces it."""

from __future__ import annotations

import threading

import httpx2 as httpx
import pytest

from dspark_export.runtime.request import SamplingParams
from dspark_export.serve.app import ServeConfig

from .conftest import free_loopback_socket, wait_until

pytestmark = pytest.mark.slow
MODEL = "tiny"


@pytest.fixture(scope="module")
def ray_server(serve_engine_dir):
    from ray import serve

    from dspark_export.serve.ray_deploy import DEPLOYMENT_NAME, start_on_ray

    sock = free_loopback_socket()
    port = sock.getsockname()[1]
    sock.close()
    config = ServeConfig(engine_dir=serve_engine_dir, api_key="", debug_step_delay_s=0.02)
    running = start_on_ray(config, replicas=2, port=port, replica_cpus=0.5, num_cpus=2, progress=lambda m: None)
    try:
        yield f"http://127.0.0.1:{port}", serve, DEPLOYMENT_NAME
    finally:
        running.stop()


def _body(prompt, stream=False):
    return {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": stream}


def _expected(runtime, prompt):
    runtime.set_policy("dspark")
    return runtime.generate_text([prompt], SamplingParams(max_new_tokens=40))[0].text


def test_requests_spread_over_both_replicas_with_their_solo_outputs(ray_server, serve_runtime):
    base, _, _ = ray_server
    prompts = [f"request {i}" for i in range(12)]
    want = {p: _expected(serve_runtime, p) for p in prompts}
    seen, errors = {}, []

    def one(p):
        try:
            r = httpx.post(base + "/v1/completions", json=_body(p), timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want[p]
            seen[p] = r.headers["x-dspark-replica"]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert len(set(seen.values())) == 2, seen


def _stream(base, prompt, started: threading.Event, out: dict):
    """Read a streamed completion; record ("ok", text), ("error", what) or ("cut", text) (no [DONE])."""
    import json

    try:
        with httpx.stream("POST", base + "/v1/completions", json=_body(prompt, stream=True), timeout=120) as r:
            out["replica"] = r.headers.get("x-dspark-replica")
            if r.status_code != 200:
                out["result"] = ("error", r.status_code)
                return
            parts, done = [], False
            for line in r.iter_lines():
                started.set()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["result"] = ("error", chunk["error"]["message"])
                        return
                    parts.append(chunk["choices"][0]["text"])
            out["result"] = ("ok" if done else "cut", "".join(parts))
    except httpx.HTTPError as e:
        out["result"] = ("error", type(e).__name__)
    finally:
        started.set()


def test_killing_a_replica_loses_no_request_silently_and_ray_replaces_it(ray_server, serve_runtime):
    import ray

    base, serve, name = ray_server
    prompts = [f"story {i}" for i in range(8)]
    want = {p: _expected(serve_runtime, p) for p in prompts}
    outs = [{} for _ in prompts]
    started = [threading.Event() for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(base, p, e, o)) for p, e, o in zip(prompts, started, outs)]
    for t in threads:
        t.start()
    assert started[0].wait(60)
    victim_tag = outs[0]["replica"].split("#", 1)[1]         # the replica streaming the first request
    [actor] = [a for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith("#" + victim_tag)]
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a request hung after its replica died"
    for p, o in zip(prompts, outs):
        kind, value = o["result"]
        if kind == "ok":
            assert value == want[p], (p, o)              # a success is complete and correct
        else:                                            # a failure is an explicit error event, never a cut
            assert kind == "error" and "replica" in str(value), o
    assert outs[0]["result"][0] == "error"              # it was streaming when its replica died

    def replaced():
        dep = serve.status().applications[name].deployments["dspark-engine"]
        return dep.replica_states.get("RUNNING", 0) == 2
    wait_until(replaced, 150, "Ray to replace the killed replica", interval=1)
    r = httpx.post(base + "/v1/completions", json=_body(prompts[0]), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[prompts[0]]
    assert r.headers["x-dspark-replica"].startswith("dspark-engine#")


def test_non_streaming_requests_queued_on_a_killed_replica_are_retried(ray_server, serve_runtime):
    """Non-streaming requests send nothing before their JSON: the router retries every one whose
    replica dies, so all of them succeed with their solo outputs."""
    import ray

    base, serve, name = ray_server
    prompts = [f"retry {i}" for i in range(8)]
    want = {p: _expected(serve_runtime, p) for p in prompts}
    got, errors = {}, []

    def one(p):
        try:
            r = httpx.post(base + "/v1/completions", json=_body(p), timeout=150)
            got[p] = (r.status_code, r.json())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    wait_until(lambda: any(a["name"].startswith("SERVE_REPLICA::") for a in
                           ray.util.list_named_actors(all_namespaces=True)), 10, "replica actors")
    import time
    time.sleep(0.5)                                      # requests are in flight on both replicas
    [actor] = [a for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith(f"SERVE_REPLICA::{name}#dspark-engine#")][:1]
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    for t in threads:
        t.join(170)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    for p in prompts:
        status, body = got[p]
        assert status == 200 and body["choices"][0]["text"] == want[p], (p, status, body)
