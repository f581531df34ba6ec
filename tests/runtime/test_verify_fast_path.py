"""A step with only greedy requests verifies without the verify engine (`EngineStages.verify`,
`stages.greedy_verify`): accepted counts and next tokens must be the op's own, ties included."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.stages import Round
from ..test_pipeline import engine_dir, runtime  # noqa: F401  (module fixtures)


def _op_next_ids(rt, S, g, V, rows, draft_ids=None, lens=None):
    """The verify engine on the same rows, every slot greedy (no drafts unless given)."""
    lens = np.zeros(S, np.int64) if lens is None else lens
    blocks = [rows.get(slot, np.zeros((1, V), np.float32)) for slot in range(S)]
    feed = {"target_logits": np.concatenate(blocks),
            "query_start": np.concatenate([[0], np.cumsum(lens + 1)]).astype(np.int64),
            "draft_ids": np.zeros((S, g), np.int64) if draft_ids is None else draft_ids,
            "draft_logits": np.random.default_rng(9).standard_normal((S, g, V)).astype(np.float32),
            "verify_lens": lens, "temperature": np.zeros(S, np.float32),
            "top_k": np.zeros(S, np.int64), "top_p": np.ones(S, np.float32),
            "uniforms": np.zeros((S, g + 1), np.float32)}
    out = rt.engines.runner("verify", S).infer(feed)
    return out["num_accepted"], out["next_ids"]


def test_greedy_steps_without_drafts_give_the_ops_tokens_without_calling_it(runtime):
    gen = Generator(runtime.engines, parse_policy("ar"))
    gen.batch.resize(4)
    S, g, V = gen.batch.num_slots, gen.block_size, gen.vocab_size
    r = np.random.default_rng(3)
    tie = np.zeros((1, V), np.float32)
    tie[0, [V - 2, 7, 3]] = 5.0                        # the first maximum (3) wins, as ArgMax's
    rows = {0: r.standard_normal((1, V)).astype(np.float32), S - 1: tie}
    calls = []
    real = gen.stages.infer
    gen.stages.infer = lambda runner, feed: calls.append(runner.key.graph) or real(runner, feed)
    states = [SimpleNamespace(slot=slot, rng=np.random.default_rng(slot)) for slot in rows]
    accepted, next_ids = gen.stages.verify(Round(active=[], verify_lens=np.zeros(S, np.int64)), states, rows)
    assert calls == []
    op_accepted, op_next = _op_next_ids(runtime, S, g, V, rows)
    assert next_ids[S - 1] == 3
    for slot in rows:
        assert (accepted[slot], next_ids[slot]) == (op_accepted[slot], op_next[slot])
    # each request's random stream moved as the engine path moves it (g + 1 uniforms)
    for s in states:
        ref = np.random.default_rng(s.slot)
        ref.random(g + 1, dtype=np.float32)
        assert s.rng.random() == ref.random()


def test_greedy_steps_with_drafts_accept_what_the_op_accepts_without_calling_it(runtime):
    gen = Generator(runtime.engines, parse_policy("ar"))
    gen.batch.resize(4)
    S, g, V = gen.batch.num_slots, gen.block_size, gen.vocab_size
    r = np.random.default_rng(5)
    lens = np.array([g, 2, 0, g], np.int64)[:S]
    rows = {slot: r.standard_normal((int(lens[slot]) + 1, V)).astype(np.float32) for slot in range(S)}
    draft_ids = r.integers(0, V, (S, g))
    best = {slot: rows[slot].argmax(axis=1) for slot in rows}
    draft_ids[0, :g] = best[0][:g]                     # all accepted: the bonus row's argmax is next
    draft_ids[1, 0] = best[1][0]                       # one accepted, then a miss
    rows[3][1, [V - 1, 11]] = 50.0                     # a tie: the first maximum (11) is the target's choice
    draft_ids[3, :2] = [best[3][0], V - 1]             # ... so V - 1 is rejected at position 1
    calls = []
    real = gen.stages.infer
    gen.stages.infer = lambda runner, feed: calls.append(runner.key.graph) or real(runner, feed)
    states = [SimpleNamespace(slot=slot, rng=np.random.default_rng(slot)) for slot in rows]
    rnd = Round(active=[], verify_lens=lens, drafts={"draft_ids": draft_ids})
    accepted, next_ids = gen.stages.verify(rnd, states, rows)
    assert calls == []
    op_accepted, op_next = _op_next_ids(runtime, S, g, V, rows, draft_ids, lens)
    assert accepted.tolist() == op_accepted.tolist()
    assert next_ids.tolist() == op_next.tolist()
    assert accepted[0] == g and accepted[1] == 1 and accepted[3] == 1 and next_ids[3] == 11


def test_a_sampled_request_still_runs_the_verify_engine(runtime):
    gen = Generator(runtime.engines, parse_policy("ar"))
    gen.batch.resize(2)
    S, V = gen.batch.num_slots, gen.vocab_size
    calls = []
    real = gen.stages.infer
    gen.stages.infer = lambda runner, feed: calls.append(runner.key.graph) or real(runner, feed)
    rows = {0: np.zeros((1, V), np.float32)}
    states = [SimpleNamespace(slot=0, rng=np.random.default_rng(0))]
    gen.batch.temperature[0] = 0.7
    gen.stages.verify(Round(active=[], verify_lens=np.zeros(S, np.int64)), states, rows)
    assert calls == ["verify"]
