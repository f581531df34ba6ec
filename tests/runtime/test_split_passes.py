"""Prefill chunks in one-slot target passes next to a shared pass (`EngineStages.split_passes`): greedy identity
under every policy, faults and retries confined to their request, error messages naming the right engine."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_export.errors import EngineRunError
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from .self_draft import TargetDrafter
from ..reliability.helpers import check_caches_equal_fresh, check_lengths
from ..test_pipeline import engine_dir, runtime  # noqa: F401  (module fixtures)

rng = np.random.default_rng(0)
P = {
    "b+1": rng.integers(4, 256, 5).tolist(),     # block_size 4 -> γ+1 = 5: stays in the shared pass
    "b+2": rng.integers(4, 256, 6).tolist(),     # split
    "long": rng.integers(4, 256, 70).tolist(),   # > largest bucket 64: 2 chunks
    "long2": rng.integers(4, 256, 40).tolist(),
    "cap": rng.integers(4, 256, 93).tolist(),    # max_context 96: hits capacity
    "short": [40, 41],
    "short2": [5, 6, 7, 8, 9, 10],
}
N = {"b+1": 12, "b+2": 12, "long": 10, "long2": 14, "cap": 20, "short": 20, "short2": 16}

_solo_cache = {}


def solo(rt, name, n=None):
    n = n or N[name]
    key = (name, n)
    if key not in _solo_cache:
        g = Generator(rt.engines, parse_policy("ar"))
        _solo_cache[key] = g.generate([P[name]], [SamplingParams(max_new_tokens=n)])[0].token_ids
    return _solo_cache[key]


def mk(rt, policy, **kw):
    if policy == "self:fixed:4":
        return Generator(rt.engines, parse_policy("fixed:4"), drafter=TargetDrafter(), **kw)
    return Generator(rt.engines, parse_policy(policy), **kw)


def _one_slot_pass(gen, runner, feed) -> bool:
    """Whether this engine call is a target pass over one slot of a several-slot cache (a split prefill)."""
    return runner.key.graph == "target" and gen.num_slots > 1 and len(feed["cache_lens"]) == 1


def _run_long(gen, infer, check: bool = True) -> int:
    """Route the generator's engine calls through `infer`, submit the long prompt and run every request to
    the end (checking the cache lengths after each step with `check`); returns the long request's id."""
    gen.stages.infer = infer
    c = gen.submit(P["long"], SamplingParams(max_new_tokens=N["long"]))
    while gen.has_work():
        gen.step()
        if check:
            check_lengths(gen)
    return c


def _short_decoding(rt, policy):
    """A 4-slot generator whose "short" request has taken its first step; returns (generator, its id)."""
    gen = mk(rt, policy, max_slots=4)
    rid = gen.submit(P["short"], SamplingParams(max_new_tokens=N["short"]))
    gen.step()
    return gen, rid


def _on_first_one_slot_pass(gen, change):
    """An `_infer` for `gen` that calls change(real_infer, runner, feed) in place of the engine on the first
    one-slot target pass only; returns (infer, hit), hit["n"] counting those calls."""
    real, hit = gen.stages.infer, {"n": 0}

    def infer(runner, feed):
        if _one_slot_pass(gen, runner, feed) and not hit["n"]:
            hit["n"] += 1
            return change(real, runner, feed)
        return real(runner, feed)
    return infer, hit


def count_passes(gen, log):
    real = gen.stages.infer

    def infer(runner, feed):
        if runner.key.graph == "target":
            log.append((gen.num_slots, len(feed["cache_lens"]), int(feed["input_ids"].shape[0])))
        return real(runner, feed)
    gen.stages.infer = infer


@pytest.mark.parametrize("policy", ["ar", "fixed:4", "fixed:2", "dspark", "dspark-async", "self:fixed:4"])
def test_greedy_mixed_prefill_decode_equals_solo(runtime, policy):  # noqa: F811
    gen = mk(runtime, policy, max_slots=4)
    log = []
    count_passes(gen, log)
    order = [("short", 0), ("short2", 0), ("long", 2), ("b+2", 0), ("b+1", 1), ("cap", 0), ("long2", 0)]
    ids = {}
    for name, steps in order:
        ids[name] = gen.submit(P[name], SamplingParams(max_new_tokens=N[name]))
        for _ in range(steps):
            gen.step()
            check_lengths(gen)
    k = 0
    while gen.has_work():
        gen.step()
        check_lengths(gen)
        k += 1
        if k % 3 == 0:
            check_caches_equal_fresh(gen)
    split = [x for x in log if x[0] > 1 and x[1] == 1]
    assert split, "no one-slot pass happened"
    bad = {}
    for name, rid in ids.items():
        r = gen.result(rid)
        if r.token_ids != solo(runtime, name):
            bad[name] = (r.finish_reason, r.error, r.token_ids, solo(runtime, name))
    assert not bad, bad


@pytest.mark.parametrize("policy", ["ar", "fixed:4"])
def test_several_long_prefills_same_step(runtime, policy):  # noqa: F811
    gen = mk(runtime, policy, max_slots=4)
    log = []
    count_passes(gen, log)
    ids = {n: gen.submit(P[n], SamplingParams(max_new_tokens=N[n])) for n in ["short", "long2", "b+2", "long"]}
    while gen.has_work():
        gen.step()
        check_lengths(gen)
    check = {n: (gen.result(r).token_ids, solo(runtime, n)) for n, r in ids.items()}
    assert all(a == b for a, b in check.values()), check


@pytest.mark.parametrize("where", ["logits", "new_key.0", "aux_hidden", "raise-always"])
@pytest.mark.parametrize("policy", ["ar", "fixed:4"])
def test_fault_in_one_slot_pass_fails_only_that_request(runtime, policy, where):  # noqa: F811
    gen = mk(runtime, policy, max_slots=4)
    a = gen.submit(P["short"], SamplingParams(max_new_tokens=N["short"]))
    b = gen.submit(P["short2"], SamplingParams(max_new_tokens=N["short2"]))
    for _ in range(2):
        gen.step()
    real = gen.stages.infer
    hit = {"n": 0}

    def infer(runner, feed):
        out = real(runner, feed)
        if _one_slot_pass(gen, runner, feed):
            hit["seen"] = hit.get("seen", 0) + 1
            if where == "raise-always":
                hit["n"] = 1
                raise EngineRunError("injected")
            if hit["seen"] != (2 if where == "logits" else 1):   # logits: the last chunk (70 = 64 + 6)
                return out
            hit["n"] += 1
            if where == "raise":
                raise EngineRunError("injected")
            out = dict(out)
            out[where] = out[where].copy()
            out[where][:] = np.nan
        return out
    c = _run_long(gen, infer)
    assert hit["n"] == 1
    rc = gen.result(c)
    assert rc.finish_reason == "error", (rc.finish_reason, rc.token_ids)
    assert gen.result(a).token_ids == solo(runtime, "short")
    assert gen.result(b).token_ids == solo(runtime, "short2")


@pytest.mark.parametrize("policy", ["ar", "fixed:4"])
def test_nan_only_in_dummy_logit_row_of_none_chunk_is_ignored(runtime, policy):  # noqa: F811
    """A non-final prefill chunk (logits='none') returns one dummy logit row; NaN there must not fail it."""
    def nan_logits(real, runner, feed):
        out = dict(real(runner, feed))
        out["logits"] = np.full_like(out["logits"], np.nan)
        return out
    gen, a = _short_decoding(runtime, policy)
    infer, hit = _on_first_one_slot_pass(gen, nan_logits)
    c = _run_long(gen, infer, check=False)
    assert hit["n"] == 1
    assert gen.result(c).token_ids == solo(runtime, "long"), gen.result(c).error
    assert gen.result(a).token_ids == solo(runtime, "short")


def test_cancel_during_multistep_prefill(runtime):  # noqa: F811
    gen = mk(runtime, "fixed:4", max_slots=4)
    a = gen.submit(P["short"], SamplingParams(max_new_tokens=N["short"]))
    gen.step()
    c = gen.submit(P["long"], SamplingParams(max_new_tokens=N["long"]))
    gen.step()   # first chunk of long
    gen.cancel(c)
    d = gen.submit(P["long2"], SamplingParams(max_new_tokens=N["long2"]))
    while gen.has_work():
        gen.step()
        check_lengths(gen)
    assert gen.result(c).finish_reason == "cancelled"
    assert gen.result(a).token_ids == solo(runtime, "short")
    assert gen.result(d).token_ids == solo(runtime, "long2")


@pytest.mark.parametrize("policy", ["ar", "fixed:4"])
def test_seeded_sampling_batch_equals_solo(runtime, policy):  # noqa: F811
    sp = lambda n, s: SamplingParams(max_new_tokens=n, temperature=0.8, seed=s)
    outs = []
    for batch in (True, False):
        res = {}
        if batch:
            gen = mk(runtime, policy, max_slots=4)
            ids = {}
            ids["short"] = gen.submit(P["short"], sp(16, 1))
            gen.step()
            ids["long"] = gen.submit(P["long"], sp(10, 2))
            ids["b+2"] = gen.submit(P["b+2"], sp(10, 3))
            while gen.has_work():
                gen.step()
            res = {n: gen.result(r).token_ids for n, r in ids.items()}
        else:
            for n, (m, s) in {"short": (16, 1), "long": (10, 2), "b+2": (10, 3)}.items():
                g = mk(runtime, policy)
                res[n] = g.generate([P[n]], [sp(m, s)])[0].token_ids
        outs.append(res)
    assert outs[0] == outs[1], outs


@pytest.mark.parametrize("policy", ["ar", "fixed:4"])
def test_transient_raise_in_one_slot_pass_is_retried(runtime, policy):  # noqa: F811
    def raise_once(real, runner, feed):
        raise EngineRunError("injected")
    gen, a = _short_decoding(runtime, policy)
    infer, hit = _on_first_one_slot_pass(gen, raise_once)
    c = _run_long(gen, infer)
    assert hit["n"] == 1
    assert gen.result(c).token_ids == solo(runtime, "long")
    assert gen.result(a).token_ids == solo(runtime, "short")


def test_nan_in_shared_pass_error_names_the_shared_engine(runtime):  # noqa: F811
    """NaN in a decode request's rows of the shared pass, in a step that also runs a one-slot prefill pass:
    only that request fails, and its error should name the engine that produced the NaN."""
    gen = mk(runtime, "ar", max_slots=4)
    a = gen.submit(P["short"], SamplingParams(max_new_tokens=N["short"]))
    b = gen.submit(P["short2"], SamplingParams(max_new_tokens=N["short2"]))
    for _ in range(2):
        gen.step()
    real = gen.stages.infer
    keys = []

    def infer(runner, feed):
        out = real(runner, feed)
        if runner.key.graph == "target":
            keys.append((len(feed["cache_lens"]), str(runner.key.path)))
            if len(feed["cache_lens"]) > 1 and len(keys) == 1:
                out = dict(out)
                out["logits"] = out["logits"].copy()
                out["logits"][0] = np.nan          # first logit row: slot 0's decode row
        return out
    gen.stages.infer = infer
    c = gen.submit(P["long"], SamplingParams(max_new_tokens=N["long"]))
    gen.step()
    gen.stages.infer = real
    while gen.has_work():
        gen.step()
    assert len(keys) == 2 and keys[0][0] > 1 and keys[1][0] == 1, keys
    ra = gen.result(a)
    assert ra.finish_reason == "error"
    assert gen.result(b).token_ids == solo(runtime, "short2")
    assert gen.result(c).token_ids == solo(runtime, "long")
    shared_key, alone_key = keys[0][1], keys[1][1]
    assert shared_key in ra.error and alone_key not in ra.error, (ra.error, keys)
