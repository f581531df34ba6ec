"""The OpenAI-compatible server (serve/) with the real `openai` client, on a tiny engine directory.

Each server runs on a free loopback port and is stopped by its fixture; every wait is bounded."""

from __future__ import annotations

import json
import threading

import httpx2 as httpx  # the HTTP client the openai package depends on
import openai
import pytest

from dspark_export.errors import RequestError
from dspark_export.runtime.request import SamplingParams
from dspark_export.runtime.service import Service
from dspark_export.serve.app import ServeConfig, create_app
from dspark_export.serve.engine import TextStream
from dspark_export.serve.openai_protocol import MAX_STOP_STRINGS

from .conftest import API_KEY, metric, start_server, wait_until

MODEL = "tiny"      # the engine directory's folder name (build_tiny_engine_dir makes <tmp>/<name>/tiny)
PROMPTS = ["Hello there", "What is 2+3?", "abc", "The quick brown fox", "x", "Tell me a story about a cat",
           "1 2 3 4", "zzz", "Why?", "ok ok ok", "Name three colors", "hi", "say something", "{json}",
           "tab\tchar", "last one"]


@pytest.fixture(scope="module")
def server(serve_engine_dir, serve_runtime):
    config = ServeConfig(engine_dir=serve_engine_dir, policy="dspark", api_key=API_KEY, max_body_bytes=8192,
                         max_queue=32)
    with start_server(create_app(config, service=Service(serve_runtime, "dspark"))) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def _expected(runtime, prompt, chat=True, policy="dspark", **params):
    runtime.set_policy(policy)
    [r] = runtime.generate_text([prompt], SamplingParams(**params), chat=chat)
    return r


def _chat(client, prompt, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kw)


def _stream_text(client, prompt, kind="chat", **kw):
    """Concatenated deltas, the finish reason, the usage chunk and the chunk count of a streamed request."""
    if kind == "chat":
        stream = _chat(client, prompt, stream=True, stream_options={"include_usage": True}, **kw)
    else:
        stream = client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **kw)
    parts, finish, usage, n = [], None, None, 0
    for chunk in stream:
        n += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text = c.delta.content if kind == "chat" else c.text
            assert "\ufffd" not in (text or "")
            parts.append(text or "")
            finish = c.finish_reason or finish
    return "".join(parts), finish, usage, n


@pytest.mark.parametrize("params", [dict(max_tokens=20, temperature=0.0),
                                    dict(max_tokens=24, temperature=0.9, top_p=0.9, seed=7),
                                    dict(max_tokens=16, temperature=0.7, seed=3, extra_body={"top_k": 5})])
def test_non_streaming_text_equals_generate_text_and_stream_concatenates(client, serve_runtime, params):
    prompt = "What is 2+3?"
    extra = params.pop("extra_body", {})
    want = _expected(serve_runtime, prompt, max_new_tokens=params["max_tokens"], temperature=params["temperature"],
                     top_p=params.get("top_p", 1.0), seed=params.get("seed"), top_k=extra.get("top_k", 0))
    got = _chat(client, prompt, extra_body=extra, **params)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.prompt_tokens == want.stats.prompt_tokens
    text, finish, usage, _ = _stream_text(client, prompt, extra_body=extra, **params)
    assert text == want.text and finish == want.finish_reason
    assert usage.completion_tokens == len(want.token_ids) and usage.total_tokens == usage.prompt_tokens + len(want.token_ids)


def test_completions_endpoint_text_and_token_ids(client, serve_runtime):
    want = _expected(serve_runtime, "The quick", chat=False, max_new_tokens=18)
    got = client.completions.create(model=MODEL, prompt="The quick", max_tokens=18, temperature=0)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)
    ids = serve_runtime.encode("The quick", False)
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=18, temperature=0).choices[0].text == want.text
    text, finish, usage, _ = _stream_text(client, "The quick", kind="completion", max_tokens=18, temperature=0)
    assert text == want.text and usage.completion_tokens == len(want.token_ids)


def test_stop_strings_end_the_text_before_them_and_are_never_streamed(client, serve_runtime):
    prompt = "Tell me a story about a cat"
    full = _expected(serve_runtime, prompt, max_new_tokens=40).text
    assert len(full) >= 12, full
    stop = full[8:11]                       # a string the greedy output contains
    want = _expected(serve_runtime, prompt, max_new_tokens=40, stop=(stop, "never-there"))
    assert want.finish_reason == "stop" and want.text == full[:full.index(stop)]
    got = _chat(client, prompt, max_tokens=40, temperature=0, stop=[stop, "never-there"])
    assert got.choices[0].message.content == want.text and got.choices[0].finish_reason == "stop"
    text, finish, _, _ = _stream_text(client, prompt, max_tokens=40, temperature=0, stop=[stop, "never-there"])
    assert text == want.text and finish == "stop"


def test_text_stream_holds_back_possible_stop_prefixes_and_half_characters():
    ts = TextStream(("END",))
    assert ts.feed("abcE", False) == "abc"         # "E" could start "END"
    assert ts.feed("N", False) == ""               # "EN" still could
    assert ts.feed("x", False) == "ENx"            # decided: not a stop
    assert ts.feed("yEN", False) == "y"
    assert ts.feed("D and more", True) == ""       # the stop string and what follows are never sent
    assert ts.text == "abcENxy"
    ts = TextStream(())
    assert ts.feed("caf\ufffd", False) == "caf"   # half a UTF-8 character waits ...
    assert ts.feed("", False) == ""
    assert ts.feed("!", False) == "\ufffd!"      # followed by text it is a real replacement character
    assert TextStream(()).feed("a\ufffd", True) == "a\ufffd"   # ... unless the request ended on it


def test_sixteen_concurrent_greedy_requests_each_equal_their_solo_run(client, serve_runtime, server):
    want = [_expected(serve_runtime, p, max_new_tokens=24).text for p in PROMPTS]
    got: dict[int, str] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(PROMPTS))

    def one(i):
        try:
            barrier.wait(30)
            if i % 2:
                got[i] = _stream_text(client, PROMPTS[i], max_tokens=24, temperature=0)[0]
            else:
                got[i] = _chat(client, PROMPTS[i], max_tokens=24, temperature=0).choices[0].message.content
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert metric(server, "dspark_running_requests") == 0 or wait_until(
        lambda: metric(server, "dspark_running_requests") == 0, 10, "running requests to drop to 0")


def test_a_failing_request_leaves_the_others_untouched(client, serve_runtime, monkeypatch):
    """An engine fault in the fixed:2 generator ends its stream with an error event; concurrent requests
    with the default policy finish with their solo output."""
    from dspark_export.runtime.generator import Generator

    want = [_expected(serve_runtime, p, max_new_tokens=20).text for p in PROMPTS[:3]]
    original = Generator.speculative_step

    def faulty(self, active):
        if str(self.policy) == "fixed:2":
            raise RuntimeError("injected engine fault")
        return original(self, active)

    monkeypatch.setattr(Generator, "speculative_step", faulty)
    results: dict = {}

    def good(i):
        results[i] = _chat(client, PROMPTS[i], max_tokens=20, temperature=0).choices[0].message.content

    threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    with pytest.raises(openai.APIError, match="injected engine fault"):
        _stream_text(client, "doomed", max_tokens=20, temperature=0, extra_body={"policy": "fixed:2"})
    with pytest.raises(openai.InternalServerError, match="injected engine fault"):
        _chat(client, "doomed too", max_tokens=20, temperature=0, extra_body={"policy": "fixed:2"})
    for t in threads:
        t.join(120)
    assert [results.get(i) for i in range(3)] == want


def _post(base, path, body, key=API_KEY, raw=None, headers=None):
    h = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    return httpx.post(base + path, content=raw if raw is not None else json.dumps(body), headers=h, timeout=30)


def _msg(content="hi"):
    return [{"role": "user", "content": content}]


BAD_INPUTS = [
    ("bad JSON", dict(raw=b'{"model": "tiny", "messages": ['), 400, None),
    ("unknown model", dict(body={"model": "gpt-4", "messages": _msg()}), 404, "model"),
    ("n = 2", dict(body={"model": MODEL, "messages": _msg(), "n": 2}), 400, "n"),
    ("negative max_tokens", dict(body={"model": MODEL, "messages": _msg(), "max_tokens": -1}), 400, "max_tokens"),
    ("temperature < 0", dict(body={"model": MODEL, "messages": _msg(), "temperature": -0.5}), 400, "temperature"),
    ("top_p > 1", dict(body={"model": MODEL, "messages": _msg(), "top_p": 1.5}), 400, "top_p"),
    ("over-long prompt", dict(body={"model": MODEL, "messages": _msg("x" * 200)}), 400, "messages"),
    ("missing messages", dict(body={"model": MODEL}), 400, "messages"),
    ("unknown role", dict(body={"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}), 400,
     "messages[0].role"),
    ("huge body", dict(body={"model": MODEL, "messages": _msg("y" * 20000)}), 413, None),
    ("wrong API key", dict(body={"model": MODEL, "messages": _msg()}, key="wrong"), 401, None),
    ("stop list too long", dict(body={"model": MODEL, "messages": _msg(), "stop": ["s"] * (MAX_STOP_STRINGS + 1)}),
     400, "stop"),
    ("logprobs", dict(body={"model": MODEL, "messages": _msg(), "logprobs": True}), 400, "logprobs"),
    # legacy completions: an integer asks for logprobs, 0 included (the sampled token's own)
    ("completions logprobs 0", dict(path="/v1/completions", body={"model": MODEL, "prompt": "a", "logprobs": 0}),
     400, "logprobs"),
    ("include_usage not a boolean", dict(body={"model": MODEL, "messages": _msg(), "stream": True,
                                               "stream_options": {"include_usage": "yes"}}), 400, "stream_options"),
    ("message without a role", dict(body={"model": MODEL, "messages": [{"content": "hi"}]}), 400,
     "messages[0].role"),
    ("tools", dict(body={"model": MODEL, "messages": _msg(), "tools": [{"type": "function"}]}), 400, "tools"),
    ("penalty", dict(body={"model": MODEL, "messages": _msg(), "presence_penalty": 0.5}), 400, "presence_penalty"),
    ("string max_tokens", dict(body={"model": MODEL, "messages": _msg(), "max_tokens": "9"}), 400, "max_tokens"),
    ("unknown parameter", dict(body={"model": MODEL, "messages": _msg(), "frobnicate": 1}), 400, "frobnicate"),
    ("unknown policy", dict(body={"model": MODEL, "messages": _msg(), "policy": "magic"}), 400, None),
    ("batched prompts", dict(path="/v1/completions", body={"model": MODEL, "prompt": ["a", "b"]}), 400, "prompt"),
    ("ids outside the vocabulary", dict(path="/v1/completions", body={"model": MODEL, "prompt": [5, 99999]}), 400, None),
]


@pytest.mark.parametrize("case, kw, status, param", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_get_their_4xx_in_openai_shape_and_the_server_keeps_serving(server, client, case, kw, status,
                                                                               param):
    kw = dict(kw)
    r = _post(server, kw.pop("path", "/v1/chat/completions"), kw.pop("body", None), **kw)
    assert r.status_code == status, (case, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param and param.split("[")[0] in err["message"]
    assert r.headers["x-dspark-replica"]
    if case == "over-long prompt":     # the message gives both lengths
        assert "exceed" in err["message"] and "96" in err["message"]
    ok = _chat(client, "still there?", max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_openai_client_raises_the_matching_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=_msg())
    with pytest.raises(openai.BadRequestError, match="n: not supported"):
        client.chat.completions.create(model=MODEL, messages=_msg(), n=2)
    with openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_models_health_metrics_and_replica_header(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(server + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.headers["x-dspark-replica"]
    before = metric(server, "dspark_requests_total", finish_reason="length")
    _chat(client, "count me", max_tokens=6, temperature=0)
    r = httpx.get(server + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["x-dspark-replica"]
    assert metric(server, "dspark_requests_total", finish_reason="length") == before + 1
    for name in ("dspark_time_to_first_token_seconds_count", "dspark_e2e_request_latency_seconds_count",
                 "dspark_step_seconds_count", "dspark_acceptance_length_count", "dspark_verification_length_count",
                 "dspark_inter_token_latency_seconds_count", "dspark_completion_tokens_total",
                 "dspark_prompt_tokens_total"):
        assert metric(server, name) > 0, name
    for name in ("dspark_queue_depth", "dspark_running_requests"):
        assert name in r.text
    assert httpx.get(server + "/nowhere", timeout=10).json()["error"]["type"] == "not_found_error"


def test_a_disconnect_mid_stream_cancels_the_request_and_frees_its_slot(serve_engine_dir, serve_runtime,
                                                                       monkeypatch):
    """One slot, no queue: while a stream runs a second request gets 429; the client closing the stream
    cancels it (metrics count it) and the slot serves the next request."""
    import time

    from dspark_export.runtime.generator import Generator

    original = Generator.speculative_step

    def slow(self, active):             # 80 tokens take seconds: the disconnect comes long before the end
        time.sleep(0.05)
        return original(self, active)

    monkeypatch.setattr(Generator, "speculative_step", slow)
    config = ServeConfig(engine_dir=serve_engine_dir, api_key="", max_slots=1, max_queue=0)
    with start_server(create_app(config, service=Service(serve_runtime, "dspark", max_slots=1))) as base:
        body = {"model": MODEL, "messages": _msg("a long one"), "max_tokens": 80, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", base + "/v1/chat/completions", json=body) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: ")
                busy = _post(base, "/v1/chat/completions", {"model": MODEL, "messages": _msg(), "max_tokens": 2},
                             key="")
                assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full"
            # leaving the `with` closes the connection mid-stream
        wait_until(lambda: metric(base, "dspark_requests_total", finish_reason="cancelled") == 1, 30,
                   "the cancelled request to be counted")
        assert metric(base, "dspark_requests_total") == 1 and metric(base, "dspark_completion_tokens_total") < 80
        r = _post(base, "/v1/chat/completions", {"model": MODEL, "messages": _msg(), "max_tokens": 3,
                                                 "temperature": 0}, key="")
        assert r.status_code == 200, r.text
        assert metric(base, "dspark_running_requests") == 0 or wait_until(
            lambda: metric(base, "dspark_running_requests") == 0, 10, "the slot to be free")


def test_health_is_503_while_loading_then_200(serve_engine_dir, monkeypatch):
    from dspark_export.runtime import api

    gate = threading.Event()
    original = api.Runtime.open.__func__

    def slow_open(cls, *a, **kw):
        assert gate.wait(60)
        return original(cls, *a, **kw)

    monkeypatch.setattr(api.Runtime, "open", classmethod(slow_open))
    config = ServeConfig(engine_dir=serve_engine_dir, api_key="")
    with start_server(create_app(config), ready=False) as base:
        h = httpx.get(base + "/health", timeout=10)
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = _post(base, "/v1/chat/completions", {"model": MODEL, "messages": _msg()}, key="")
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        gate.set()
        wait_until(lambda: httpx.get(base + "/health", timeout=10).status_code == 200, 120, "/health 200")
        r = _post(base, "/v1/chat/completions", {"model": MODEL, "messages": _msg(), "max_tokens": 3}, key="")
        assert r.status_code == 200, r.text


def test_parameters_at_their_no_op_values_are_accepted(client, serve_runtime):
    """What ordinary clients send by default: n = 1, logprobs false, zero penalties, user, max_completion_tokens."""
    want = _expected(serve_runtime, "defaults", max_new_tokens=6)
    got = _chat(client, "defaults", max_completion_tokens=6, temperature=0, n=1, logprobs=False, presence_penalty=0,
                frequency_penalty=0.0, user="someone", top_p=1)
    assert got.choices[0].message.content == want.text and got.usage.completion_tokens == len(want.token_ids)


def test_distinct_per_request_policies_are_bounded(serve_engine_dir, serve_runtime):
    """A policy is request input (threshold:C takes any real C) and each one gets its own generator:
    idle ones are dropped past the service's limit, so a client cycling through policies cannot grow
    the server without bound; a new policy while all are busy is a 400 naming `policy`."""
    service = Service(serve_runtime, "dspark", max_policies=3)
    config = ServeConfig(engine_dir=serve_engine_dir, api_key="")
    with start_server(create_app(config, service=service)) as base:
        with openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0, timeout=120) as c:
            expected = _chat(c, "policies", max_tokens=6, temperature=0, extra_body={"policy": "threshold:0.5"})
            for i in range(6):
                got = _chat(c, "policies", max_tokens=6, temperature=0, extra_body={"policy": f"threshold:0.5{i}1"})
                assert got.choices[0].finish_reason in ("length", "stop")
                assert len(service._generators) <= 3
            again = _chat(c, "policies", max_tokens=6, temperature=0, extra_body={"policy": "threshold:0.5"})
            assert again.choices[0].message.content == expected.choices[0].message.content
        assert "dspark" in service._generators       # the default's generator is never dropped
    # all kept generators busy (requests queued, nobody steps): a new policy is refused, naming `policy`
    held = Service(serve_runtime, "dspark", max_policies=2)
    held.submit([5, 6, 7], {"max_new_tokens": 4}, policy="fixed:1")
    with pytest.raises(RequestError, match="policy: 2 policies have requests running"):
        held.submit([5, 6, 7], {"max_new_tokens": 4}, policy="fixed:2")
    held.submit([5, 6, 7], {"max_new_tokens": 4})       # the default and the busy one still take requests
    assert set(held._generators) == {"dspark", "fixed:1"}
