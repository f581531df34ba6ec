"""Continuous batching: arrivals mid-stream, queueing beyond the slot count, streaming, cancellation."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams

from ..test_pipeline import BUCKETS, PROMPTS  # noqa: F401  (same tiny engine directory)
from ..test_pipeline import engine_dir, runtime  # noqa: F401  (module fixtures)

MORE = PROMPTS + [[11, 12, 13], [60] * 30, [200, 201, 202, 203], [9]]


def _solo(rt, policy, prompt, n):
    gen = Generator(rt.engines, parse_policy(policy))
    return gen.generate([prompt], [SamplingParams(max_new_tokens=n)])[0].token_ids


@pytest.mark.parametrize("policy", ["ar", "fixed:4", "dspark-async"])
def test_arrivals_mid_stream_equal_solo_runs(runtime, policy):  # noqa: F811
    gen = Generator(runtime.engines, parse_policy(policy), max_slots=3)  # fewer slots than requests: queueing
    streamed: dict[int, list[int]] = {}
    finished: list[int] = []

    def on_token(rid, tokens, result):
        streamed.setdefault(rid, []).extend(tokens)
        if result.finish_reason is not None:
            finished.append(rid)

    ids, lengths = [], [20, 7, 25, 12, 18, 9, 30, 5]
    for step, (prompt, n) in enumerate(zip(MORE, lengths)):
        ids.append(gen.submit(prompt, SamplingParams(max_new_tokens=n), on_token))
        for _ in range(step % 3):          # new requests arrive while others are mid-generation
            gen.step()
        assert gen.num_slots <= 4
    while gen.has_work():
        gen.step()
    assert gen.num_slots <= 1  # compacted back down once the batch drained
    for rid, prompt, n in zip(ids, MORE, lengths):
        result = gen.result(rid)
        assert result.token_ids == _solo(runtime, "ar", prompt, n), (policy, prompt)
        assert streamed[rid] == result.token_ids
    assert sorted(finished) == sorted(ids) and len(finished) == len(set(finished))


def test_cancel_frees_the_slot_and_spares_the_others(runtime):  # noqa: F811
    gen = Generator(runtime.engines, parse_policy("fixed:4"), max_slots=2)
    a = gen.submit(MORE[0], SamplingParams(max_new_tokens=40))
    b = gen.submit(MORE[1], SamplingParams(max_new_tokens=20))
    c = gen.submit(MORE[2], SamplingParams(max_new_tokens=20))  # waits for a free slot
    for _ in range(3):
        gen.step()
    assert gen.cancel(a) and not gen.cancel(12345)
    partial = list(gen.result(a).token_ids)
    while gen.has_work():
        gen.step()
    assert gen.result(a).finish_reason == "cancelled" and gen.result(a).token_ids == partial
    assert not gen.cancel(a)
    for rid, prompt in ((b, MORE[1]), (c, MORE[2])):
        assert gen.result(rid).token_ids == _solo(runtime, "ar", prompt, 20)


def test_invalid_request_fails_at_submit_without_touching_others(runtime):  # noqa: F811
    gen = Generator(runtime.engines, parse_policy("fixed:4"))
    ok = gen.submit(MORE[0], SamplingParams(max_new_tokens=10))
    bad = gen.submit([], SamplingParams(max_new_tokens=10))
    assert gen.result(bad).finish_reason == "error"
    while gen.has_work():
        gen.step()
    assert gen.result(ok).token_ids == _solo(runtime, "ar", MORE[0], 10)


@pytest.mark.parametrize("policy", ["ar", "fixed:4"])
def test_a_prefill_chunk_next_to_decode_rows_runs_over_its_slot_alone(runtime, policy):  # noqa: F811
    """A prompt arriving while others decode is prefilled in a target pass over its slot of the cache alone
    (its query would otherwise pad every slot's), trimmed to the slot's valid entries; decode and verification rows stay in the shared pass, and
    every request still equals its solo run."""
    gen = Generator(runtime.engines, parse_policy(policy))
    passes = []
    real = gen.stages.infer

    def infer(runner, feed):
        if runner.key.graph == "target":
            passes.append((gen.num_slots, feed["past_key.0"].shape[0], len(feed["cache_lens"]),
                           feed["input_ids"].copy(), feed["past_key.0"]))
        return real(runner, feed)
    gen.stages.infer = infer
    long_prompt = [60 + i % 50 for i in range(30)]            # longer than a verification block (γ + 1 = 5)
    first = gen.submit(PROMPTS[0], SamplingParams(max_new_tokens=16))
    second = gen.submit(PROMPTS[1], SamplingParams(max_new_tokens=16))
    for _ in range(3):
        gen.step()
    passes.clear()
    third = gen.submit(long_prompt, SamplingParams(max_new_tokens=10))
    gen.step()                                                 # decode rows of 2 requests + the 30-token prefill
    slots = gen.num_slots
    assert slots > 1 and len(passes) == 2
    shared, alone = passes
    assert shared[1] == shared[2] == slots and alone[1] == alone[2] == 1
    assert alone[3][:len(long_prompt)].tolist() == long_prompt      # the whole chunk, in the one-slot pass
    cache = gen.target_kv.keys[0]
    assert np.shares_memory(shared[4], cache)                                          # a view, no copy
    # the slot alone ([1, kvH, P, D]), trimmed to its valid entries (0 here) plus its chunk, rounded up to KEY_CHUNK
    assert alone[4].shape[:3] == (1, cache.shape[1], 128) and alone[4].flags.c_contiguous
    while gen.has_work():
        gen.step()
    for rid, prompt, n in ((first, PROMPTS[0], 16), (second, PROMPTS[1], 16), (third, long_prompt, 10)):
        assert gen.result(rid).token_ids == _solo(runtime, policy, prompt, n)


def test_a_lone_request_prefills_in_the_shared_pass(runtime):  # noqa: F811
    gen = Generator(runtime.engines, parse_policy("ar"))
    shapes = []
    real = gen.stages.infer
    gen.stages.infer = lambda runner, feed: (shapes.append(len(feed["cache_lens"])) if runner.key.graph == "target"
                                       else None) or real(runner, feed)
    gen.generate([[60 + i % 50 for i in range(30)]], [SamplingParams(max_new_tokens=4)])
    assert shapes and set(shapes) == {1}                      # one slot: nothing to split, one pass per step
    assert len(shapes) == 4


def test_slots_freed_at_a_step_end_wait_for_the_next_submission(runtime):  # noqa: F811
    """Two of four requests finish in one step: their slots are freed at once, but the slot count shrinks only at
    the next step and only if nothing was submitted in between (a server's next requests arrive between steps),
    so a replaced request costs no cache remap (`Batch.release_finished`)."""
    gen = Generator(runtime.engines, parse_policy("ar"), max_slots=4)
    remaps = []
    for kv in (gen.batch.target_kv, gen.batch.draft_kv):
        real = kv.remap
        kv.remap = lambda num_slots, moves, _real=real: (remaps.append(num_slots), _real(num_slots, moves))[1]
    prompts = [MORE[i] for i in (0, 1, 2, 4)]                          # none stops early on the tiny model
    ids = [gen.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, (3, 3, 12, 12))]
    while not gen.result(ids[0]).finish_reason:
        gen.step()
    running = [i for i in ids if not gen.result(i).finish_reason]
    assert gen.result(ids[1]).finish_reason and len(running) == 2 and gen.num_slots == 4
    assert sum(s is not None for s in gen.batch.slots) == 2           # freed at the end of the step
    remaps.clear()
    late = gen.submit(MORE[6], SamplingParams(max_new_tokens=5))
    gen.step()
    assert remaps == [] and gen.num_slots == 4                         # the new request took a freed slot
    while not gen.result(late).finish_reason:
        gen.step()
    gen.step()                                                          # nothing arrived: compact to 2 slots
    assert gen.num_slots == 2 and remaps == [2, 2]
    while gen.has_work():
        gen.step()
    assert gen.result(running[0]).token_ids == _solo(runtime, "ar", prompts[ids.index(running[0])], 12)


def test_a_backlog_pins_no_pass_for_a_few_rows(runtime):  # noqa: F811
    """The drafter-context backlog keeps a prefill chunk's features as a view of its pass's `aux_hidden` (no copy)
    but copies a decoding request's few rows, so a long-lived request does not keep every pass it shared alive
    (`stages._backlog_rows`)."""
    gen = Generator(runtime.engines, parse_policy("dspark-async"), max_slots=2)
    gen.controller.draft_count = lambda R, S, p: 0          # no drafts: every committed row stays in the backlog
    first = gen.submit(MORE[2], SamplingParams(max_new_tokens=20))
    gen.step()
    gen.step()
    late = gen.submit(MORE[5], SamplingParams(max_new_tokens=5))   # a 30-token prompt beside the decoding one
    gen.step()
    decoding, prefilled = gen.batch.requests[first], gen.batch.requests[late]
    assert decoding.backlog[-1][0].base is None                      # its own copy of its row
    assert prefilled.backlog[-1][0].base is not None and len(prefilled.backlog[-1][0]) == len(MORE[5])
    assert decoding.backlog_rows + int(gen.draft_kv.lens[decoding.slot]) == int(gen.target_kv.lens[decoding.slot])
