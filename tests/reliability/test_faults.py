"""Faults (issue 7, item 3): an engine call that raises or returns NaN fails only the requests it
affects, with a reason, and the runtime keeps serving; cancelling mid-stream frees the slot; an
interrupted build leaves no directory that loads as complete.

Faults are injected by wrapping the engine runners (`FaultyRunner`): the wrapped call raises, or its
real outputs are returned with NaN written into chosen rows.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dspark_export.errors import EngineDirError
from dspark_export.runtime.request import SamplingParams
from ..runtime.self_draft import TargetDrafter

from .conftest import ar_tokens, generator, random_prompt, run_steps
from .helpers import check_caches_equal_fresh, check_lengths, wrap_runners

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41], [100] * 30, random_prompt(1, 20)]
N = 24


class FaultyRunner:
    """An engine runner whose call number `n` (counted over all buckets of the graph) goes through
    fault(runner, feed, n) instead of runner.infer(feed)."""

    def __init__(self, runner, fault, counter):
        self.runner, self.key, self.fault, self.counter = runner, runner.key, fault, counter

    def padded_rows(self, rows):
        return self.runner.padded_rows(rows)

    def infer(self, feed):
        self.counter[0] += 1
        return self.fault(self.runner, feed, self.counter[0])


def inject(monkeypatch, rt, graph, fault):
    counter = [0]
    wrap_runners(monkeypatch, rt.engines, graph, lambda r: FaultyRunner(r, fault, counter))
    return counter


def _submit_all(gen, prompts, n=N, **params):
    return [gen.submit(list(p), SamplingParams(max_new_tokens=n, **params)) for p in prompts]


def _solo(rt, prompts, n=N):
    return [ar_tokens(rt, p, n) for p in prompts]


def _slot_rows(feed, slot):
    qs = feed["query_start"]
    return np.arange(qs[slot], qs[slot + 1])


@pytest.mark.parametrize("graph", ["target", "drafter_block", "verify", "drafter_context"])
def test_an_engine_raising_once_fails_nobody(rel_runtime, graph, caplog):
    """A one-off exception in a packed step: the step is undone and its requests are retried one at a
    time; every request finishes normally with output == its run without the fault (greedy: its solo run;
    the verify engine runs for sampled requests only, so its case samples, seeded)."""
    rt = rel_runtime
    params = dict(temperature=0.8, seed=11) if graph == "verify" else {}

    def fault(runner, feed, n):
        if n == 4:
            raise RuntimeError("injected: device lost")
        return runner.infer(feed)

    if params:
        clean = generator(rt, "fixed:4")
        clean_ids = _submit_all(clean, PROMPTS, **params)
        run_steps(clean, check_lengths)
        refs = [clean.result(i).token_ids for i in clean_ids]
    else:
        refs = _solo(rt, PROMPTS)
    with pytest.MonkeyPatch.context() as m:
        counter = inject(m, rt, graph, fault)
        gen = generator(rt, "fixed:4")
        ids = _submit_all(gen, PROMPTS, **params)
        with caplog.at_level(logging.WARNING):
            run_steps(gen, check_lengths)
    assert counter[0] > 4
    assert "retrying the step's" in caplog.text and "injected: device lost" in caplog.text
    for rid, ref in zip(ids, refs):
        r = gen.result(rid)
        assert r.finish_reason in ("length", "stop") and r.token_ids == ref


def test_a_poisoned_request_fails_alone_and_the_runtime_keeps_serving(rel_runtime):
    """A target fault that hits every pass carrying one request's token (a persistent, request-bound
    fault): that request fails with the engine's message; the others equal their solo runs; requests
    submitted afterwards are served."""
    rt = rel_runtime
    refs = _solo(rt, PROMPTS)
    used = {t for p, r in zip(PROMPTS, refs) for t in p + r}
    poison = next(t for t in range(255, 3, -1) if t not in used)
    bad_prompt = [7, 8, poison, 9]

    def fault(runner, feed, n):
        if poison in feed["input_ids"][:int(feed["query_start"][-1])]:
            raise RuntimeError(f"injected: cannot run token {poison}")
        return runner.infer(feed)

    with pytest.MonkeyPatch.context() as m:
        inject(m, rt, "target", fault)
        for policy in ("fixed:4", "dspark-async", "ar"):
            gen = generator(rt, policy)
            ids = _submit_all(gen, PROMPTS[:2] + [bad_prompt] + PROMPTS[2:])
            run_steps(gen, check_lengths)
            bad = gen.result(ids[2])
            assert bad.finish_reason == "error" and bad.token_ids == []
            assert "target" in bad.error and f"cannot run token {poison}" in bad.error
            good = [gen.result(i).token_ids for i in ids[:2] + ids[3:]]
            assert good == refs, policy
            later = gen.submit(PROMPTS[0], SamplingParams(max_new_tokens=N))
            run_steps(gen)
            assert gen.result(later).token_ids == refs[0]


@pytest.mark.parametrize("where", ["logits", "new_key.1", "aux_hidden"])
def test_nan_rows_of_one_request_fail_only_that_request(rel_runtime, where):
    """The target returns NaN in one request's rows for one step (logits, a layer's keys, or the
    features): only that request fails ("non-finite"), with the tokens it had committed before the
    fault (a prefix of its solo output, nothing corrupt committed); the others equal their solo runs."""
    rt = rel_runtime
    victim = {}

    def fault(runner, feed, n):
        out = runner.infer(feed)
        # from call 6 on, the first pass over every slot in which slot 1 has real rows (ones with logits;
        # a prefill chunk may run in a pass over its own slot, and a slot may hold padding rows only)
        if n >= 6 and not victim and len(feed["cache_lens"]) > 1:
            slot = 1
            rows = _slot_rows(feed, slot)
            logit_rows = feed["logit_rows"]
            hit = np.flatnonzero((logit_rows >= rows[0]) & (logit_rows <= rows[-1])) if len(rows) else []
            if not len(hit):
                return out
            victim["slot"] = slot
            out = dict(out)
            if where == "logits":
                out["logits"] = out["logits"].copy()
                out["logits"][hit] = np.nan
            else:
                out[where] = out[where].copy()
                out[where][rows] = np.nan
        return out

    with pytest.MonkeyPatch.context() as m:
        inject(m, rt, "target", fault)
        gen = generator(rt, "fixed:4")
        ids = _submit_all(gen, PROMPTS)
        slot_of = {}
        while gen.has_work():
            slot_of.update({s.index: s.slot for s in gen.batch.slots if s is not None})
            gen.step()
            check_lengths(gen)
            check_caches_equal_fresh(gen)
    refs = _solo(rt, PROMPTS)
    failed = [i for i in ids if gen.result(i).finish_reason == "error"]
    assert len(failed) == 1 and slot_of[failed[0]] == victim["slot"]
    r = gen.result(failed[0])
    assert "non-finite" in r.error and "target" in r.error
    assert r.token_ids == refs[ids.index(failed[0])][:len(r.token_ids)]
    for i, ref in zip(ids, refs):
        if i not in failed:
            assert gen.result(i).token_ids == ref


@pytest.mark.parametrize("graph, output", [("drafter_block", "draft_logits"), ("drafter_block", "confidence"),
                                           ("drafter_context", "context_key.0")])
def test_nan_drafter_outputs_fail_only_the_affected_request(rel_runtime, graph, output):
    """The drafter block (NaN draft logits or confidence) or the drafter context (NaN context rows)
    fails one request's rows for one step: that request fails, the others are untouched."""
    rt = rel_runtime

    def fault(runner, feed, n):
        out = runner.infer(feed)
        if n == 5:
            out = dict(out)
            out[output] = out[output].copy()
            if graph == "drafter_block":
                out[output][2] = np.nan                 # slot 2
            else:
                out[output][:1] = np.nan                # the first committed row (one slot)
        return out

    with pytest.MonkeyPatch.context() as m:
        inject(m, rt, graph, fault)
        gen = generator(rt, "fixed:4")
        ids = _submit_all(gen, PROMPTS)
        run_steps(gen, check_lengths)
    refs = _solo(rt, PROMPTS)
    failed = [i for i in ids if gen.result(i).finish_reason == "error"]
    assert len(failed) == 1
    assert graph in gen.result(failed[0]).error and "non-finite" in gen.result(failed[0]).error
    for i, ref in zip(ids, refs):
        r = gen.result(i)
        assert r.token_ids == (ref if i not in failed else ref[:len(r.token_ids)])


def test_verify_returning_out_of_range_ids_fails_that_request(rel_runtime):
    rt = rel_runtime

    def fault(runner, feed, n):
        out = runner.infer(feed)
        if n == 5:
            out = dict(out)
            out["next_ids"] = out["next_ids"].copy()
            out["next_ids"][0] = 10_000
        return out

    with pytest.MonkeyPatch.context() as m:
        inject(m, rt, "verify", fault)
        gen = generator(rt, "fixed:4")
        ids = _submit_all(gen, PROMPTS, temperature=0.8, seed=3)   # sampled: greedy steps verify in numpy
        run_steps(gen, check_lengths)
    errors = [gen.result(i).error for i in ids if gen.result(i).finish_reason == "error"]
    assert len(errors) == 1 and "out-of-range" in errors[0] and "next id 10000" in errors[0]


def test_an_engine_down_for_a_while_fails_its_requests_then_serving_resumes(rel_runtime):
    """verify raises on every call for a while (the whole batch and every solo retry fail): those
    requests fail with the engine's message, requests still waiting for a slot are not lost, and once
    the engine recovers the queue is served normally."""
    rt = rel_runtime
    down = {"on": False}

    def fault(runner, feed, n):
        if down["on"]:
            raise RuntimeError("injected: engine down")
        return runner.infer(feed)

    prompts = PROMPTS + [[11, 12, 13], [60] * 10]
    params = dict(temperature=0.8, seed=3)   # sampled: greedy steps verify in numpy, without the engine
    clean = generator(rt, "fixed:4", max_slots=2)
    clean_ids = _submit_all(clean, prompts, **params)
    run_steps(clean, check_lengths)
    refs = [clean.result(i).token_ids for i in clean_ids]
    with pytest.MonkeyPatch.context() as m:
        inject(m, rt, "verify", fault)
        gen = generator(rt, "fixed:4", max_slots=2)
        ids = _submit_all(gen, prompts, **params)
        gen.step()
        down["on"] = True
        gen.step()              # the two admitted requests fail (batch, then each alone)
        down["on"] = False
        run_steps(gen, check_lengths)
    results = [gen.result(i) for i in ids]
    assert [r.finish_reason for r in results[:2]] == ["error", "error"]
    assert all("injected: engine down" in r.error and "verify" in r.error for r in results[:2])
    assert all(r.token_ids == ref for r, ref in zip(results[2:], refs[2:]))


def test_a_sampled_step_retried_after_a_fault_keeps_the_seeded_stream(rel_runtime):
    """A retried step restores each request's random stream: a seeded sampled request gives the same
    tokens with and without a one-off fault in the batch."""
    rt = rel_runtime
    params = dict(temperature=0.9, top_k=40, seed=5)
    clean = generator(rt, "fixed:4")
    ids = _submit_all(clean, PROMPTS, **params)
    run_steps(clean)

    def fault(runner, feed, n):
        if n == 7:
            raise RuntimeError("injected")
        return runner.infer(feed)

    with pytest.MonkeyPatch.context() as m:
        inject(m, rt, "verify", fault)
        faulty = generator(rt, "fixed:4")
        fids = _submit_all(faulty, PROMPTS, **params)
        run_steps(faulty)
    # a retried step runs each request alone: the same uniforms, so the same tokens
    for a, b in zip(ids, fids):
        assert clean.result(a).token_ids == faulty.result(b).token_ids


def test_cancel_from_the_stream_frees_the_slot_for_a_waiting_request(rel_runtime):
    """A client that disconnects mid-stream (cancel from inside on_token): the request ends
    "cancelled" with the tokens streamed so far, its slot (and KV) is freed at the next step and
    given to the waiting request, and the others are unaffected."""
    rt = rel_runtime
    gen = generator(rt, "fixed:4", max_slots=2, drafter=TargetDrafter())
    streamed = {}

    def on_token(rid, tokens, result):
        streamed.setdefault(rid, []).extend(tokens)
        if rid == a and len(streamed[rid]) >= 6 and result.finish_reason is None:
            assert gen.cancel(rid)

    a = gen.submit(PROMPTS[0], SamplingParams(max_new_tokens=40), on_token)
    b = gen.submit(PROMPTS[1], SamplingParams(max_new_tokens=N), on_token)
    c = gen.submit(PROMPTS[2], SamplingParams(max_new_tokens=N), on_token)
    admitted_c_at = None
    steps = 0
    while gen.has_work():
        gen.step()
        steps += 1
        check_lengths(gen)
        if admitted_c_at is None and any(s is not None and s.index == c for s in gen.batch.slots):
            admitted_c_at = steps
            assert gen.result(a).finish_reason == "cancelled"
            assert gen.num_slots == 2
    ra = gen.result(a)
    assert ra.finish_reason == "cancelled" and ra.token_ids == streamed[a] and 6 <= len(ra.token_ids) < 40
    assert ra.token_ids == ar_tokens(rt, PROMPTS[0], 40)[:len(ra.token_ids)]
    assert gen.result(b).token_ids == ar_tokens(rt, PROMPTS[1], N)
    assert gen.result(c).token_ids == ar_tokens(rt, PROMPTS[2], N)
    assert admitted_c_at is not None and not gen.cancel(a)


@pytest.mark.parametrize("stage", ["export_target", "export_drafter", "engine_spec", "measure_profile",
                                   "manifest_save"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_a_build_interrupted_at_any_stage_leaves_nothing_that_loads(tiny_target_dir, tmp_path, monkeypatch,
                                                                   stage, exc):
    """Ctrl-C (KeyboardInterrupt) or an error at each stage of `build`: no directory at `out`, no
    partial folder left behind, and `out` does not load as an engine directory. A build killed
    outright (SIGKILL: the partial folder stays) is not `out` either, and the next build sweeps it."""
    import dspark_export.pipeline as pipeline
    from dspark_export.engines.manifest import Manifest
    from dspark_export.pipeline import BuildConfig, build_engine_dir

    from .conftest import REL_BUILD

    def boom(*a, **k):
        raise exc(f"interrupted at {stage}")

    if stage == "manifest_save":
        monkeypatch.setattr(Manifest, "save", boom)
    else:
        monkeypatch.setattr(pipeline, stage, boom)
    out = tmp_path / "eng"
    with pytest.raises(exc, match=f"interrupted at {stage}"):
        build_engine_dir(BuildConfig(out=out, target=str(tiny_target_dir), drafter="untrained", **REL_BUILD))
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(EngineDirError, match="no such directory"):
        Manifest.load(out)


def test_a_killed_build_is_not_an_engine_directory(tiny_target_dir, tmp_path, monkeypatch):
    """SIGKILL between writing the manifest and the final rename (simulated: the rename never
    happens): the complete-looking partial folder is hidden, `out` does not load, and the next build
    of `out` removes the dead process's partial folder."""
    import os

    import dspark_export.pipeline as pipeline
    from dspark_export.engines.manifest import Manifest
    from dspark_export.pipeline import BuildConfig, build_engine_dir

    from .conftest import REL_BUILD

    out = tmp_path / "eng"
    cfg = BuildConfig(out=out, target=str(tiny_target_dir), drafter="untrained", **REL_BUILD)
    real_replace = os.replace

    def killed(src, dst):
        if str(dst) == str(out):
            raise SystemExit("killed")       # stands in for SIGKILL: nothing after this point runs
        return real_replace(src, dst)

    monkeypatch.setattr(pipeline.os, "replace", killed)
    monkeypatch.setattr(pipeline.shutil, "rmtree", lambda *a, **k: None)   # a killed process cleans nothing
    with pytest.raises(SystemExit):
        build_engine_dir(cfg)
    monkeypatch.undo()
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".eng.partial-")]
    assert len(partial) == 1 and (partial[0] / "manifest.json").exists() and not out.exists()
    with pytest.raises(EngineDirError):
        Manifest.load(out)
    dead = partial[0].with_name(".eng.partial-999999999-dead")   # as left by a process that no longer runs
    partial[0].rename(dead)
    build_engine_dir(cfg)
    assert Manifest.load(out).runtime["block_size"] == 8 and not dead.exists()
