"""The embedding front end (runtime/service.py): requests from many threads, events out, per-request
policies, synchronous errors for bad requests, and engine faults confined to the affected requests."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dspark_export.errors import RequestError
from dspark_export.runtime.service import Service, sampling_params_from

from ..test_pipeline import BUCKETS, PROMPTS  # noqa: F401  (same tiny engine directory)
from ..test_pipeline import engine_dir, runtime  # noqa: F401  (module fixtures)


@pytest.fixture()
def service(runtime):  # noqa: F811
    return Service(runtime, policy="dspark")


def _drain(svc: Service) -> dict[int, list]:
    events: dict[int, list] = {}
    while svc.has_work():
        svc.step()
        for ev in svc.take_events():
            events.setdefault(ev.request_id, []).append(ev)
    for ev in svc.take_events():
        events.setdefault(ev.request_id, []).append(ev)
    return events


def _expected(runtime, n=12):  # noqa: F811
    runtime.set_policy("ar")
    from dspark_export.runtime.request import SamplingParams
    return [r.token_ids for r in runtime.generate_ids(PROMPTS, [SamplingParams(max_new_tokens=n)] * len(PROMPTS))]


def test_threads_submit_mixed_policies_and_get_solo_outputs(service, runtime):  # noqa: F811
    expected = _expected(runtime)
    ids: dict[int, int] = {}
    lock = threading.Lock()
    policies = ["dspark", "ar", "fixed:2", "dspark-async", "threshold:0.5"]

    def client(t):
        for i in range(3):
            which = (t + i) % len(PROMPTS)
            rid = service.submit(PROMPTS[which], {"max_new_tokens": 12}, policy=policies[(t * 3 + i) % 5],
                                 decode_text=False)
            with lock:
                ids[rid] = which

    threads = [threading.Thread(target=client, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    events = _drain(service)
    assert sorted(events) == sorted(ids)
    for rid, which in ids.items():
        evs = events[rid]
        assert [e.finished for e in evs].count(True) == 1 and evs[-1].finished
        assert sum((e.token_ids for e in evs), []) == expected[which]
        assert evs[-1].stats["completion_tokens"] == len(expected[which])
    stats = service.stats()
    assert stats["submitted"] == stats["finished"] == 18 and stats["running"] == 0 and stats["failed"] == 0


def test_text_deltas_concatenate_to_the_decoded_text(service, runtime):  # noqa: F811
    rid = service.submit("Hi there", {"max_new_tokens": 10}, chat=True)
    events = _drain(service)[rid]
    ids = sum((e.token_ids for e in events), [])
    assert "".join(e.text_delta for e in events) == runtime.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("params, field", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": 1 << 40}, "max_new_tokens"),
    ({"temprature": 0.5}, "unknown fields"), ({"top_p": "high"}, "top_p"),
])
def test_bad_parameters_raise_and_queue_nothing(service, params, field):
    with pytest.raises(RequestError, match=field):
        service.submit([5, 6], params)
    assert service.stats()["submitted"] == 0 and not service.has_work()


def test_bad_prompts_and_policies_raise(service, runtime):  # noqa: F811
    cases = [([], {}, None, "at least one token"), ([5, 99999], {}, None, "token ids"),
             ([7] * 200, {}, None, "capacity"), ([5], {}, "fastest", "policy"), ([5], {}, "fixed:99", "block size"),
             ("", {}, None, "at least one token")]
    for prompt, params, policy, match in cases:
        with pytest.raises(RequestError, match=match):
            service.submit(prompt, params, policy=policy)
    with pytest.raises(RequestError, match="chat"):
        service.submit([5, 6], chat=True)
    assert service.stats()["submitted"] == 0


def test_cancel_mid_stream(service):
    a = service.submit([5, 6, 7], {"max_new_tokens": 60}, decode_text=False)
    b = service.submit([40, 41], {"max_new_tokens": 8}, decode_text=False)
    service.step()
    service.step()
    assert service.cancel(a) and not service.cancel(12345)
    events = _drain(service)
    assert events[a][-1].finish_reason == "cancelled"
    assert sum(len(e.token_ids) for e in events[a]) < 60
    assert sum(len(e.token_ids) for e in events[b]) == 8 and events[b][-1].finish_reason == "length"
    assert not service.cancel(a)
    assert service.stats()["cancelled"] == 1


def test_an_engine_fault_fails_only_that_policys_requests(service, runtime, monkeypatch):  # noqa: F811
    expected = _expected(runtime)
    ok = service.submit(PROMPTS[0], {"max_new_tokens": 12}, policy="ar", decode_text=False)
    bad = service.submit(PROMPTS[1], {"max_new_tokens": 12}, policy="fixed:2", decode_text=False)
    victim = service._generators["fixed:2"]

    def broken_step():
        raise RuntimeError("injected engine failure")
    monkeypatch.setattr(victim, "step", broken_step)
    events = _drain(service)
    assert events[bad][-1].finish_reason == "error" and "injected engine failure" in events[bad][-1].error
    assert sum((e.token_ids for e in events[ok]), []) == expected[0]
    # a later request with that policy gets a fresh generator and runs normally
    again = service.submit(PROMPTS[1], {"max_new_tokens": 12}, policy="fixed:2", decode_text=False)
    assert sum((e.token_ids for e in _drain(service)[again]), []) == expected[1]
    assert service.stats()["failed"] == 1


def test_sampling_params_from_mapping():
    p = sampling_params_from({"temperature": 1, "top_k": 5, "seed": -1, "stop_token_ids": [2, 3]})
    assert p.temperature == 1.0 and p.seed is None and p.stop_token_ids == (2, 3)
    assert sampling_params_from(None).max_new_tokens == 128
    with pytest.raises(RequestError, match="mapping"):
        sampling_params_from(np.zeros(3))


def test_the_final_event_flushes_held_back_text(service, runtime, monkeypatch):  # noqa: F811
    """A multi-byte character split across tokens is held back while streaming, but not lost at the end."""
    real = runtime.tokenizer.decode
    monkeypatch.setattr(runtime.tokenizer, "decode", lambda ids, **kw: real(ids, **kw) + "\ufffd")
    rid = service.submit([5, 6, 7], {"max_new_tokens": 3})
    events = _drain(service)[rid]
    assert all(e.text_delta == "" for e in events[:-1])
    assert "".join(e.text_delta for e in events).endswith("\ufffd")


def test_seeded_requests_reproduce_in_any_batch(service):
    params = {"max_new_tokens": 10, "temperature": 1.0, "seed": 11}
    alone = service.submit([5, 6, 7], params, policy="fixed:2", decode_text=False)
    first = sum((e.token_ids for e in _drain(service)[alone]), [])
    others = [service.submit(p, {"max_new_tokens": 10, "temperature": 1.0}, policy="fixed:2", decode_text=False)
              for p in PROMPTS]
    again = service.submit([5, 6, 7], params, policy="fixed:2", decode_text=False)
    events = _drain(service)
    assert sum((e.token_ids for e in events[again]), []) == first and len(events) == len(others) + 1


def test_tiny_temperatures_decode_greedily_and_stop_ids_are_checked(service, runtime):  # noqa: F811
    expected = _expected(runtime)
    rid = service.submit(PROMPTS[0], {"max_new_tokens": 12, "temperature": 1e-39}, decode_text=False)
    assert sum((e.token_ids for e in _drain(service)[rid]), []) == expected[0]
    with pytest.raises(RequestError, match="stop_token_ids"):
        service.submit([5, 6], {"stop_token_ids": [100000]})
    with pytest.raises(RequestError, match="seed"):
        service.submit([5, 6], {"seed": -5})


def test_runtime_open_checks_threads_and_damaged_files(engine_dir, tmp_path):  # noqa: F811
    import json
    import shutil

    from dspark_export.engines.manifest import Manifest
    from dspark_export.errors import ConfigError, EngineDirError
    from dspark_export.runtime.api import Runtime

    for bad in (-1, 100000, 1.5):
        with pytest.raises(ConfigError, match="threads"):
            Runtime.open(engine_dir, threads=bad)
    copy = tmp_path / "copy"
    shutil.copytree(engine_dir, copy)
    m = Manifest.load(copy)
    spec = next(k.path for k in m.engine_keys() if k.graph == "verify")
    m.replace_file(spec, b"{ garbage")
    with pytest.raises(EngineDirError, match="unreadable engine file"):
        Runtime.open(copy)
    shutil.rmtree(copy)
    shutil.copytree(engine_dir, copy)
    m = Manifest.load(copy)
    tok = next(rel for rel in m.data["files"] if rel.endswith("tokenizer.json"))
    m.replace_file(tok, json.dumps({"version": "1.0"}).encode())
    with pytest.raises(EngineDirError, match="could not load the tokenizer"):
        Runtime.open(copy)


def test_prefault_kv_lays_out_the_slot_bucket_and_the_service_does_it_at_start(engine_dir):  # noqa: F811
    """3 requests run in the 4-slot bucket: prefault_kv(n, 3) makes room for 4 slots × n entries in both caches, so
    growing to that layout stays in the same arenas; Service(kv_prefault_tokens=n) does it for max_slots."""
    from dspark_export.exporter.quantize import aligned
    from dspark_export.runtime.generator import Generator
    from dspark_export.runtime.policies import parse_policy

    from dspark_export.runtime.api import Runtime

    rt = Runtime.open(engine_dir)                      # a fresh EngineSet: an empty arena pool
    gen = Generator(rt.engines, parse_policy("ar"))
    gen.batch.prefault_kv(60, requests=3)
    slots = rt.engines.bucket_for("drafter_block", 3)
    assert slots == 4
    for kv in (gen.batch.target_kv, gen.batch.draft_kv):
        arena = kv._holder[0]
        assert kv.arena_bytes == 2 * kv.num_layers * slots * kv.num_kv_heads * aligned(60) * kv.head_dim * 4
        kv.remap(slots, {})
        kv.reserve(60)
        assert kv._holder[0] is arena
    with pytest.raises(ValueError, match="requests"):
        gen.batch.prefault_kv(60, requests=-1)
    svc = Service(Runtime.open(engine_dir), "ar", max_slots=2, kv_prefault_tokens=60)
    gen = svc._generator(parse_policy("ar"))
    assert gen.batch.target_kv.arena_bytes >= 2 * gen.batch.target_kv.num_layers * 2 * \
        gen.batch.target_kv.num_kv_heads * aligned(60) * gen.batch.target_kv.head_dim * 4
