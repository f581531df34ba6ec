"""One test (or more) per row of ../shared/reference/failure_cases.md (SD-01 … SD-35), on a tiny
random Llama (tests/conftest.py) unless the row needs real text (then `real_model`, in
test_real_model_cases.py). Rows already covered elsewhere are listed in tests/reliability/README.md.

"Self-draft" (drafter := target) is `tests/runtime/self_draft.py: TargetDrafter`: the target engine drafts
for itself with single-token passes, so in fp32 every greedy draft must be accepted.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from dspark_export.engines.packing import Segment, pack_segments
from dspark_export.plugins.common.sampling import sample_from_probs, warp_probs
from dspark_export.runtime.request import SamplingParams
from ..runtime.self_draft import TargetDrafter

from .conftest import ar_tokens, generator, random_prompt, run_steps
from .helpers import (EditedDrafter, RecordingRunner, ScriptedPolicy, byte_detokenizer, check_caches_equal_fresh,
                      check_lengths, chi_square_p, live_states, wrap_runners)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40], [100] * 30, [7, 3, 9, 200, 17], random_prompt(1, 60)]


def _spec(rt, policy, prompts, n, drafter=None, on_step=None, **params):
    gen = generator(rt, policy, drafter=drafter)
    ids = [gen.submit(list(p), SamplingParams(max_new_tokens=n, **params)) for p in prompts]
    run_steps(gen, on_step)
    return gen, [gen.result(i) for i in ids]


# -- SD-01 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["self", "always-wrong"])
def test_sd01_one_token_prompt_positions_advance_by_committed_tokens(rel_runtime, drafter):
    """SD-01: a 1-token prompt, greedy, 20 tokens, k=4; whole blocks accepted (self-draft) or every
    draft rejected: output == greedy; each round moves the cache by exactly the tokens it commits."""
    rt = rel_runtime
    prompt = [42]
    ref = ar_tokens(rt, prompt, 20)
    wrong = EditedDrafter(lambda step, s, ids: (ids + 1) % 256)
    gen = generator(rt, "fixed:4", drafter=TargetDrafter() if drafter == "self" else wrong)
    rounds = []

    def on_token(rid, tokens, result):
        rounds.append(list(tokens))

    rid = gen.submit(prompt, SamplingParams(max_new_tokens=20), on_token)
    lens = []
    run_steps(gen, lambda g: (check_lengths(g), check_caches_equal_fresh(g), lens.append(int(g.target_kv.lens[0]))))
    r = gen.result(rid)
    assert r.token_ids == ref and r.finish_reason == "length"
    assert rounds[0] == ref[:1]                       # the prefill step's first token
    if drafter == "self":
        assert r.stats.accepted_tokens == r.stats.draft_tokens > 0
        assert [len(t) for t in rounds[1:]] == [5, 5, 5, 4]      # accepted 4 + bonus; last capped by max
    else:
        assert r.stats.accepted_tokens == 0 and r.stats.draft_tokens > 0
        assert all(len(t) == 1 for t in rounds[1:])              # only the correction
    # next position = previous length + accepted + 1, every round
    committed = np.cumsum([len(t) for t in rounds])
    assert lens[:-1] == [len(prompt) + int(c) - 1 for c in committed[:-1]]


# -- SD-02 -----------------------------------------------------------------------------------
def test_sd02_onnx_spec_equals_onnx_ar_equals_pytorch_greedy(rel_runtime, tiny_target_dir):
    """SD-02: exported target + drafter, ~7-token prompt, greedy, 20 tokens, k=4: spec == ORT ar ==
    transformers greedy (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    for prompt in (PROMPTS[0], random_prompt(7, 7)):
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
        ar = ar_tokens(rel_runtime, prompt, 20, stop_token_ids=())
        _, [spec] = _spec(rel_runtime, "fixed:4", [prompt], 20)
        _, [self_spec] = _spec(rel_runtime, "fixed:4", [prompt], 20, drafter=TargetDrafter())
        # the engine's EOS ids also stop ar/spec; transformers ran without EOS, so compare up to it
        n = len(ar)
        assert ar == hf[:n] and spec.token_ids == ar and self_spec.token_ids == ar


# -- SD-03 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bos", [True, False], ids=["llama-bos", "qwen3-no-bos"])
def test_sd03_special_tokens_and_bos_reach_drafter_and_target_alike(rel_runtime, bos):
    """SD-03: a chat-template prompt with special tokens, with a template that adds BOS (Llama) and
    one that does not (Qwen3): the special tokens are parsed to their ids, BOS appears once or never,
    and spec output == non-spec output (one token-id list feeds drafter and target)."""
    from tests.conftest import make_tiny_tokenizer

    rt = rel_runtime
    tok = make_tiny_tokenizer()
    if bos:
        tok.chat_template = "{{ bos_token }}" + tok.chat_template
    original = rt.tokenizer
    rt.tokenizer = tok
    try:
        ids = rt.encode("Hi", chat=True)
        raw = rt.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", chat=False)
    finally:
        rt.tokenizer = original
    assert ids[:1] == ([1] if bos else [3]) and ids.count(1) == (1 if bos else 0)
    assert raw == ids[1:] if bos else raw == ids          # special tokens parsed, not spelled out
    assert ids.count(3) == 2 and ids.count(2) == 1
    ref = ar_tokens(rt, ids, 24)
    for policy, drafter in (("fixed:4", None), ("dspark", None), ("fixed:8", TargetDrafter())):
        _, [r] = _spec(rt, policy, [ids], 24, drafter=drafter)
        assert r.token_ids == ref, policy


# -- SD-04 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 4])
def test_sd04_self_draft_accepts_everything_in_fp32(rel_runtime, k):
    """SD-04 (fp32 ORT part): self-draft, greedy, k ∈ {1, 4}: acceptance is 100 %."""
    gen, results = _spec(rel_runtime, f"fixed:{k}", PROMPTS, 40, drafter=TargetDrafter())
    for p, r in zip(PROMPTS, results):
        assert r.token_ids == ar_tokens(rel_runtime, p, 40)
        assert r.stats.accepted_tokens == r.stats.draft_tokens
    assert sum(r.stats.draft_tokens for r in results) > 50


@pytest.mark.parametrize("k", [1, 4, 8])
def test_sd04_verify_rows_match_single_token_decode_logits(rel_runtime, k):
    """SD-04: logits of row i of a (k+1)-row verification pass == logits of a 1-row decode at the
    same position (fp32: |Δ| ≤ 1e-5 relative to the logit scale), and the argmax agrees."""
    engines = rel_runtime.engines
    seq = random_prompt(3, 41 + k)
    past = 40
    from .helpers import fresh_caches

    keys, values, _, _, _ = fresh_caches(engines, seq)
    L = len(keys)
    P = len(seq) + 1

    def cache(n):
        k_, v_ = [], []
        for layer in range(L):
            kk = np.zeros((1, keys[layer].shape[0], P, keys[layer].shape[2]), np.float32)
            vv = np.zeros_like(kk)
            kk[0, :, :n], vv[0, :, :n] = keys[layer][:, :n], values[layer][:, :n]
            k_.append(kk)
            v_.append(vv)
        return {**{f"past_key.{i}": k_[i] for i in range(L)}, **{f"past_value.{i}": v_[i] for i in range(L)}}

    runner = engines.runner("target", k + 1)
    packed = pack_segments([Segment(0, np.array(seq[past:past + k + 1]), past)], 1, np.array([past]),
                           runner.key.bucket)
    verify = runner.infer({**packed.feed, **cache(past)})["logits"][:k + 1]
    for i in range(k + 1):
        r1 = engines.runner("target", 1)
        p1 = pack_segments([Segment(0, np.array([seq[past + i]]), past + i)], 1, np.array([past + i]), r1.key.bucket)
        single = r1.infer({**p1.feed, **cache(past + i)})["logits"][0]
        scale = np.abs(single).max()
        assert np.abs(verify[i] - single).max() <= 1e-5 * max(1.0, scale), i
        assert verify[i].argmax() == single.argmax()


@pytest.mark.skip(reason="SD-04/SD-05 fp16 TensorRT part: the exporter emits fp32 graphs only and TensorRT is "
                         "not installed on this machine; no fp16 engine exists to compare")
def test_sd04_sd05_fp16_tensorrt_near_tie_policy():
    raise AssertionError("unreachable")


# -- SD-05 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", ["dspark", "self"])
def test_sd05_output_identical_for_every_length_schedule(rel_runtime, drafter):
    """SD-05: the same greedy requests with verification lengths forced to 1, 2, 5 and a per-round
    mix (0..8) give identical output (fp32)."""
    rt = rel_runtime
    refs = [ar_tokens(rt, p, 30) for p in PROMPTS]
    schedules = {"1": lambda step, R: 1, "2": lambda step, R: 2, "5": lambda step, R: 5,
                 "mix": lambda step, R: [3, 0, 8, 1, 5, 2, 7][step % 7]}
    for name, fn in schedules.items():
        _, results = _spec(rt, ScriptedPolicy(fn), PROMPTS, 30, drafter=TargetDrafter() if drafter == "self" else None)
        assert [r.token_ids for r in results] == refs, name
        if drafter == "self":
            assert all(r.stats.accepted_tokens == r.stats.draft_tokens for r in results)


# -- SD-06 … SD-09 (sampling) ------------------------------------------------------------------
def _exact_two_token_distribution(rt, prompt, temperature, top_k, top_p):
    """Exact joint distribution of the first two tokens of target-only sampling: p1 from the prompt's
    last row, p2(· | t) from the row after each t with p1(t) > 0 (one batched target pass)."""
    engines = rt.engines
    warp = lambda logits: warp_probs(logits, np.full(len(logits), temperature, np.float32),  # noqa: E731
                                     np.full(len(logits), top_k, np.int64), np.full(len(logits), top_p, np.float32))
    V = rt.generator.vocab_size
    first = _last_logits(engines, [prompt])[0]
    p1 = warp(first[None])[0]
    support = np.flatnonzero(p1 > 0)
    rows = _last_logits(engines, [prompt + [int(t)] for t in support])
    joint = np.zeros((V, V))
    joint[support] = p1[support, None] * warp(rows)
    return joint


def _last_logits(engines, seqs):
    """Logits of the last position of each sequence (fresh prefill, one request per slot)."""
    out_rows = []
    for seq in seqs:
        runner = engines.runner("target", len(seq))
        packed = pack_segments([Segment(0, np.array(seq), 0, "last")], 1, np.zeros(1, np.int64), runner.key.bucket)
        spec = engines.manifest.data["graphs"]["target"]["spec"]
        past = {f"past_{kv}.{i}": np.zeros((1, spec["num_kv_heads"], 1, spec["head_dim"]), np.float32)
                for i in range(spec["num_layers"]) for kv in ("key", "value")}
        out_rows.append(runner.infer({**packed.feed, **past})["logits"][0])
    return np.stack(out_rows)


@pytest.mark.slow
def test_sd06_sd08_spec_sampling_preserves_the_target_distribution(rel_runtime):
    """SD-06/SD-08 through the whole runtime: T=0.7, top-p 0.9, top-k 50, k=4, one prompt, 3000 seeded
    requests with the DSpark drafter (most drafts rejected: the residual path). The first two output
    tokens are compared with the EXACT target-only distribution (computed from the target's rows,
    not sampled): χ² goodness of fit p > 1e-3 for the joint and for each position, TV of each
    position below the 99.9th percentile of the TV of n exact target-only samples. 3000 (not 20 000) requests because each costs ~3 engine calls on a shared
    2-core CPU; the 40 000-row op-level tests below check the same rule at the tolerance of the note."""
    rt = rel_runtime
    prompt, T, top_k, top_p, n = [5, 6, 7, 8], 0.7, 50, 0.9, 3000
    joint = _exact_two_token_distribution(rt, prompt, T, top_k, top_p)
    gen = generator(rt, "fixed:4")
    params = [SamplingParams(max_new_tokens=6, temperature=T, top_k=top_k, top_p=top_p, seed=i) for i in range(n)]
    results = gen.generate([prompt] * n, params)
    pairs = np.array([r.token_ids[:2] for r in results if len(r.token_ids) >= 2])
    assert len(pairs) == n and sum(r.stats.draft_tokens for r in results) >= 3 * n
    V = joint.shape[0]
    counts = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).astype(float)
    assert chi_square_p(counts, joint.ravel()) > 1e-3
    sim = np.random.default_rng(0)
    for pos, marginal in ((0, joint.sum(1)), (1, joint.sum(0))):
        c = np.bincount(pairs[:, pos], minlength=V).astype(float)
        p, tv = chi_square_p(c, marginal), 0.5 * np.abs(c / n - marginal).sum()
        # TV tolerance: the 99.9th percentile of the TV that n exact target-only samples show by chance
        # (with V = 256 and n = 3000 a fixed 0.05 is below the sampling noise of a correct sampler)
        null = [0.5 * np.abs(sim.multinomial(n, marginal / marginal.sum()) / n - marginal).sum() for _ in range(1000)]
        assert p > 1e-3 and tv < np.quantile(null, 0.999), (pos, p, tv, np.quantile(null, 0.999))
    # the second token went through speculative rounds: some drafts were accepted, some rejected
    first_round = [r.stats.accepted_per_position[0] if r.stats.accepted_per_position else 0 for r in results]
    assert 0 < sum(first_round) < n


def _verify_first_token_stats(temperature, top_k, top_p, draft_mode, trials=40_000, vocab=8, seed=5):
    """Run SpeculativeVerify (ORT) on `trials` rows with one draft each; returns the emitted-token
    frequencies, the exact target distribution p, the acceptance rate and Σ min(p, q)."""
    from tests.plugins.plugin_cases import run_ort

    rng = np.random.default_rng(seed)
    F32, I64 = np.float32, np.int64
    target_row, bonus_row, draft_row = (rng.normal(0, 1.5, (1, vocab)).astype(F32) for _ in range(3))
    params = (np.full(1, temperature, F32), np.full(1, top_k, I64), np.full(1, top_p, F32))
    p = warp_probs(target_row, *params)[0]
    if draft_mode == "argmax":          # deterministic draft: q is one-hot at the drafter's argmax
        x0 = np.full(trials, int(draft_row.argmax()))
        draft_logits = np.full((1, vocab), -200.0, F32)
        draft_logits[0, x0[0]] = 0.0
        q = np.eye(vocab)[x0[0]]
    else:
        q = warp_probs(draft_row, *params)[0]
        x0 = sample_from_probs(np.broadcast_to(q, (trials, vocab)), rng.random(trials, dtype=F32))
        draft_logits = draft_row
    feeds = dict(target_logits=np.tile(np.concatenate([target_row, bonus_row]), (trials, 1)),
                 query_start=np.arange(0, 2 * trials + 1, 2, dtype=I64), draft_ids=x0[:, None].astype(I64),
                 draft_logits=np.broadcast_to(draft_logits, (trials, 1, vocab)).copy(),
                 verify_lens=np.ones(trials, I64), temperature=np.full(trials, temperature, F32),
                 top_k=np.full(trials, top_k, I64), top_p=np.full(trials, top_p, F32),
                 uniforms=rng.random((trials, 2), dtype=F32))
    snapshot = {k: v.copy() for k, v in feeds.items()}
    out = run_ort("SpeculativeVerify", {}, feeds)
    for k in feeds:                               # SD-07: inputs unchanged, bit for bit
        np.testing.assert_array_equal(feeds[k], snapshot[k])
    emitted = np.where(out["num_accepted"] == 1, x0, out["next_ids"])
    freq = np.bincount(emitted, minlength=vocab) / trials
    return freq, p, float(out["num_accepted"].mean()), float(np.minimum(p, q).sum())


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 5, 0.9), (1.0, 0, 1.0), (0.8, 0, 1.0)])
@pytest.mark.parametrize("draft_mode", ["sampled", "argmax"])
def test_sd06_sd09_accept_rule_and_output_distribution(temperature, top_k, top_p, draft_mode):
    """SD-06 (same warping for p and q), SD-09 (argmax drafts → one-hot q): the first emitted token is
    distributed as the warped target p (TV < 0.015 over 40 000 rows), and the acceptance rate equals
    Σ min(p, q) (the standard rule; an equality-based rule would give Σ p·q)."""
    freq, p, accept, expected_accept = _verify_first_token_stats(temperature, top_k, top_p, draft_mode)
    assert 0.5 * np.abs(freq - p).sum() < 0.015
    assert abs(accept - expected_accept) < 0.01, (accept, expected_accept)


def test_sd07_rejection_leaves_shared_target_rows_untouched():
    """SD-07: T=1, the drafter supplies no probabilities (q one-hot), the first draft is rejected, and
    2 requests share one target-logits buffer: the inputs are bitwise unchanged afterwards, and
    request 1 (sharing request 0's rows) gets the same outputs as when run alone."""
    from dspark_export.plugins.common.sampling import SamplingBatch
    from dspark_export.plugins.speculative_verify.reference import speculative_verify
    from tests.plugins.plugin_cases import run_ort

    F32, I64 = np.float32, np.int64
    vocab = 6
    rows = np.log(np.array([[0.05, 0.4, 0.3, 0.15, 0.05, 0.05], [0.1, 0.1, 0.5, 0.1, 0.1, 0.1]], F32))
    shared = np.concatenate([rows, rows])               # request 1's rows are request 0's values
    one_hot = np.full((2, 1, vocab), -200.0, F32)
    one_hot[:, 0, 0] = 0.0                              # draft token 0, q one-hot at it (p(0) = 0.05)
    feeds = dict(target_logits=shared, query_start=np.array([0, 2, 4], I64), draft_ids=np.zeros((2, 1), I64),
                 draft_logits=one_hot, verify_lens=np.ones(2, I64), temperature=np.ones(2, F32),
                 top_k=np.zeros(2, I64), top_p=np.ones(2, F32), uniforms=np.array([[0.9, 0.5], [0.9, 0.5]], F32))
    snapshot = {k: v.copy() for k, v in feeds.items()}
    both = run_ort("SpeculativeVerify", {}, feeds)
    ref = speculative_verify(feeds["target_logits"], feeds["query_start"], feeds["draft_ids"], feeds["draft_logits"],
                             feeds["verify_lens"], SamplingBatch(feeds["temperature"], feeds["top_k"], feeds["top_p"]),
                             feeds["uniforms"])
    for k in feeds:
        np.testing.assert_array_equal(feeds[k], snapshot[k])
    assert both["num_accepted"].tolist() == [0, 0] == ref.num_accepted.tolist()
    assert both["next_ids"][0] == both["next_ids"][1] == ref.next_ids[0] != 0   # residual excludes the draft
    alone = run_ort("SpeculativeVerify", {}, {k: (v[2:] if k == "target_logits" else
                                                   np.array([0, 2], I64) if k == "query_start" else v[1:])
                                              for k, v in feeds.items()})
    assert alone["next_ids"][0] == both["next_ids"][1]


def test_verification_never_mutates_its_inputs_in_the_runtime(rel_runtime, monkeypatch):
    """SD-07 at runtime level: every verify and drafter call of a sampled, batched run leaves its feed
    bitwise unchanged (compared right after the call: the KV inputs are the live cache buffers, which
    the commit then advances)."""
    calls = []
    for graph in ("verify", "drafter_block"):
        wrap_runners(monkeypatch, rel_runtime.engines, graph, lambda r: RecordingRunner(r, calls))
    _spec(rel_runtime, "fixed:4", PROMPTS, 12, temperature=1.0, seed=3)
    assert {key.graph for key, *_ in calls} == {"verify", "drafter_block"}
    assert all(changed == [] for _, _, changed, _ in calls)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, 0, 1.0), (0.8, 0, 1.0), (0.7, 50, 0.9), (1.3, 3, 0.5)])
def test_sd08_drafts_are_drawn_from_the_logits_verification_uses(rel_runtime, monkeypatch, temperature, top_k, top_p):
    """SD-08: the q the verifier uses (warp of draft_logits with the request's own params) is exactly
    the distribution each draft was drawn from: re-sampling warp(draft_logits) with the drafter's own
    uniforms reproduces every draft id (all fp32; the graphs have no lower-precision path)."""
    calls = []
    wrap_runners(monkeypatch, rel_runtime.engines, "drafter_block", lambda r: RecordingRunner(r, calls))
    _spec(rel_runtime, "fixed:8", PROMPTS[:3], 10, temperature=temperature, top_k=top_k, top_p=top_p, seed=1)
    assert calls
    for _, feed, _, out in calls:
        assert out["draft_logits"].dtype == np.float32
        S, g, V = out["draft_logits"].shape
        for slot in range(S):
            if feed["temperature"][slot] != temperature or feed["uniforms"][slot].max() == 0:
                continue   # an idle slot
            for j in range(g):
                probs = warp_probs(out["draft_logits"][slot, j][None], feed["temperature"][slot:slot + 1],
                                   feed["top_k"][slot:slot + 1], feed["top_p"][slot:slot + 1])
                assert sample_from_probs(probs, feed["uniforms"][slot, j:j + 1])[0] == out["draft_ids"][slot, j]


# -- SD-10 -----------------------------------------------------------------------------------
def test_sd10_forced_rejection_at_draft_1_commits_prefix_plus_one_residual(rel_runtime):
    """SD-10: T>0 (top-k 20), fixed seed, k=4, a rejection forced at draft position 1 (a token outside
    the top-k, p = 0) every round: each round commits draft 0 (when accepted) and one residual sample
    — never the forced token, nothing skipped or duplicated; caches track the committed length; the
    result is reproducible with the same seed and differs with another."""
    rt = rel_runtime

    def run(seed):
        drafter = _ForceLeastLikely(position=1)
        gen = generator(rt, "fixed:4", drafter=drafter)
        rounds = []
        rid = gen.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=30, temperature=0.9, top_k=20, seed=seed),
                         lambda rid, toks, res: rounds.append(list(toks)))
        run_steps(gen, check_lengths)
        return gen.result(rid), rounds, drafter.forced

    r1, rounds, forced = run(11)
    r2, _, _ = run(11)
    r3, _, _ = run(12)
    assert r1.token_ids == r2.token_ids and r1.token_ids != r3.token_ids
    assert r1.stats.accepted_tokens <= r1.stats.rounds          # never past the forced rejection at position 1
    assert sum(len(t) for t in rounds) == len(r1.token_ids) == 30
    for toks, bad in zip(rounds[1:], forced):
        assert 1 <= len(toks) <= 2 and (len(toks) < 2 or toks[1] != bad)
    assert any(len(t) == 2 for t in rounds[1:])                 # draft 0 accepted in some rounds


class _ForceLeastLikely:
    """Self-draft with draft `position` replaced by the least likely token of its own row (outside any
    top-k < V, so p = 0 there and the verifier must reject it); q is one-hot at the forced token."""

    def __init__(self, position):
        self.position, self.base, self.forced = position, TargetDrafter(), []

    def __call__(self, gen, active):
        out = self.base(gen, active)
        ids, logits = out["draft_ids"].copy(), out["draft_logits"].copy()
        j = self.position
        for s in active:
            bad = int(logits[s.slot, j].argmin())
            ids[s.slot, j] = bad
            logits[s.slot, j] = -30.0
            logits[s.slot, j, bad] = 30.0
            self.forced.append(bad)
        return {**out, "draft_ids": ids, "draft_logits": logits}


# -- SD-12 -----------------------------------------------------------------------------------
def _find(rt, want_positions, n=20):
    """(prompt, ar output) pairs where output[i] does not occur in output[:i] for each i wanted."""
    found = {}
    for seed in range(40):
        prompt = random_prompt(100 + seed, 6)
        out = ar_tokens(rt, prompt, n, stop_token_ids=())
        if len(out) < n:
            continue
        for i in want_positions:
            if i not in found and out[i] not in out[:i]:
                found[i] = (prompt, out)
        if len(found) == len(want_positions):
            return found
    raise AssertionError(f"no prompt found for positions {want_positions}")


@pytest.mark.parametrize("policy", ["fixed:4", "fixed:8", "dspark"])
def test_sd12_stop_id_inside_an_accepted_block_ends_the_request_there(rel_runtime, policy):
    """SD-12: a stop id as the 1st draft, the 2nd draft (interior) and the bonus of a fully accepted
    self-draft block: the output ends at it and equals non-spec greedy; later accepted tokens and the
    bonus are dropped and never streamed; usage counts only the kept tokens."""
    rt = rel_runtime
    k = 8 if policy == "fixed:8" else 4
    positions = {"first-draft": 1, "second-draft": 2, "bonus": k + 1}
    found = _find(rt, list(positions.values()))
    for where, i in positions.items():
        prompt, out = found[i]
        stop = (out[i],)
        ref = ar_tokens(rt, prompt, 20, stop_token_ids=stop)
        assert ref == out[:i + 1]
        gen = generator(rt, policy, drafter=TargetDrafter())
        streamed = []
        rid = gen.submit(prompt, SamplingParams(max_new_tokens=20, stop_token_ids=stop),
                         lambda rid, toks, res: streamed.extend(toks))
        run_steps(gen, check_lengths)
        r = gen.result(rid)
        assert r.token_ids == ref and streamed == ref, where
        assert r.finish_reason == "stop" and r.stop_reason == out[i]
        assert r.stats.completion_tokens == len(ref) == i + 1
        assert gen.num_slots <= 1 and int(gen.target_kv.lens.sum()) == 0     # slot released, KV rolled back


# -- SD-14 -----------------------------------------------------------------------------------
STOPS = {"e-acute": "é", "emoji": "\U0001F642", "ascii-tag": "</a>"}


@pytest.mark.parametrize("name", list(STOPS))
def test_sd14_stop_string_completed_early_in_an_accepted_block(rel_runtime, name):
    """SD-14: k=8 self-draft, a stop string (multi-byte: 'é' over 2 byte tokens, '🙂' over 4; ASCII
    '</a>' over 4) completes at the 2nd..4th accepted token of an 8-token block: the request stops at
    the completing token, the rest of the block is dropped, the text ends before the stop string, and
    everything equals non-spec generation with the same stop string."""
    rt = rel_runtime
    stop = STOPS[name]
    raw = stop.encode()
    found = None
    for seed in range(60):
        prompt = random_prompt(300 + seed, 5)
        out = ar_tokens(rt, prompt, 20, stop_token_ids=())
        span = out[1:1 + len(raw)]
        if len(out) == 20 and len(set(span)) == len(span) and out[0] not in span:
            found = prompt, out
            break
    assert found, "no prompt with distinct tokens at the stop string's positions"
    prompt, out = found
    detok = byte_detokenizer({t: b for t, b in zip(out[1:1 + len(raw)], raw)})
    full = detok(out)
    assert stop in full and not detok(out[:len(raw)]).count(stop)      # completes exactly at token len(raw)
    params = SamplingParams(max_new_tokens=20, stop=(stop,), stop_token_ids=())
    results = {}
    for policy, drafter in (("ar", None), ("fixed:8", TargetDrafter()), ("fixed:8", None)):
        gen = generator(rt, policy, drafter=drafter, detokenize=detok)
        rid = gen.submit(prompt, params)
        run_steps(gen)
        results[(policy, drafter is not None)] = gen.result(rid)
    ref = results[("ar", False)]
    assert ref.token_ids == out[:1 + len(raw)] and ref.finish_reason == "stop" and ref.stop_reason == stop
    for r in results.values():
        assert r.token_ids == ref.token_ids and r.stop_reason == stop
    self_draft = results[("fixed:8", True)]
    # one round, its whole 8-token block accepted, stopped at the block's token len(raw)
    assert self_draft.stats.rounds == 1 and self_draft.stats.accepted_tokens == 8
    assert self_draft.stats.completion_tokens == len(self_draft.token_ids) == 1 + len(raw)
    text = detok(self_draft.token_ids)
    assert text[:text.index(stop)] == detok(out[:1])


def test_sd14_stop_strings_through_the_text_api(rel_runtime):
    """Runtime.generate_text applies stop strings with the engine's tokenizer; the text ends before it."""
    rt = rel_runtime
    [plain] = rt.generate_text(["ab"], SamplingParams(max_new_tokens=16))
    text = plain.text
    assert len(text) >= 6, text       # the fixed tiny model and prompt give 16 printable characters
    stop = text[3:5]
    first = text.index(stop)
    for policy in ("ar", "fixed:4"):
        rt.set_policy(policy)
        [r] = rt.generate_text(["ab"], SamplingParams(max_new_tokens=16, stop=(stop,)))
        assert r.finish_reason == "stop" and r.stop_reason == stop and r.text == text[:first], policy
    rt.set_policy("ar")


# -- SD-17 … SD-20 (KV and drafter-context invariants) -------------------------------------
def test_sd17_stale_rows_of_a_rejected_round_are_masked_then_overwritten(rel_runtime):
    """SD-17: preallocated KV buffers; round 1 rejects at draft position 2 (self-draft with a wrong
    draft 2): valid length == committed length, the drafted rows past it stay in the buffer (stale),
    are never attended (output == greedy) and are overwritten by round 2's commit."""
    rt = rel_runtime
    prompt = PROMPTS[0]
    wrong = EditedDrafter(lambda step, s, ids: np.where(np.arange(len(ids)) == 2, (ids + 1) % 256, ids)
                          if step == 0 else ids)
    gen = generator(rt, "fixed:4", drafter=wrong)
    rid = gen.submit(prompt, SamplingParams(max_new_tokens=16))
    gen.step()                       # prefill: first token
    gen.step()                       # round 1: drafts 0, 1 accepted, draft 2 rejected
    r = gen.result(rid)
    assert r.stats.accepted_tokens == 2 and len(r.token_ids) == 4
    n = int(gen.target_kv.lens[0])
    assert n == len(prompt) + len(r.token_ids) - 1
    stale = gen.target_kv.keys[0][0, :, n:n + 3].copy()
    assert np.abs(stale).sum() > 0                          # the self-drafter's rows are still there
    check_caches_equal_fresh(gen)
    # Poison the stale rows with a large finite sentinel in every layer: were they attended, the output
    # would change; round 2's commit must overwrite the rows it commits. (Comparing with the old stale
    # values is not a test: the same token at the same position may legitimately recompute to equal values.)
    for layer in range(gen.target_kv.num_layers):
        gen.target_kv.keys[layer][0, :, n:n + 3] = 1e4
        gen.target_kv.values[layer][0, :, n:n + 3] = 1e4
    before = len(gen.result(rid).token_ids)
    gen.step()                       # round 2 writes over the stale rows it commits
    committed = len(gen.result(rid).token_ids) - before
    assert committed >= 1
    check_caches_equal_fresh(gen)
    written = min(committed, 3)
    assert not np.any(gen.target_kv.keys[0][0, :, n:n + written] == 1e4)
    run_steps(gen)
    assert gen.result(rid).token_ids == ar_tokens(rt, prompt, 16)


@pytest.mark.parametrize("k", [3])
def test_sd18_self_draft_long_generation_and_a_one_token_round(rel_runtime, k):
    """SD-18: self-draft, greedy, k=3, 200 new tokens: 100 % acceptance, identical output; caches
    equal a fresh prefill of the committed tokens after every round, including a round where exactly
    1 draft is accepted (draft 1 made wrong in one round)."""
    rt = rel_runtime
    prompt = PROMPTS[3]
    ref = ar_tokens(rt, prompt, 200, stop_token_ids=())
    _, [full] = _spec(rt, f"fixed:{k}", [prompt], 200, drafter=TargetDrafter(), on_step=check_lengths,
                      stop_token_ids=())
    assert full.token_ids == ref and len(ref) == 200
    assert full.stats.accepted_tokens == full.stats.draft_tokens
    one = EditedDrafter(lambda step, s, ids: np.where(np.arange(len(ids)) == 1, (ids + 1) % 256, ids)
                        if step == 5 else ids)
    steps = []
    _, [r] = _spec(rt, f"fixed:{k}", [prompt], 40, drafter=one, stop_token_ids=(),
                   on_step=lambda g: (check_lengths(g), check_caches_equal_fresh(g), steps.append(1)))
    assert r.token_ids == ref[:40]
    assert r.stats.draft_tokens - r.stats.accepted_tokens == k - 1      # only that round lost drafts


@pytest.mark.parametrize("k", [2, 4])
def test_sd19_full_accept_rounds_leave_only_the_bonus_pending(rel_runtime, k):
    """SD-19: self-draft, greedy, k ∈ {2, 4}, long generation: every round accepts all k drafts; after
    each, the target KV and the drafter context hold every accepted token (they equal a fresh prefill
    of the committed sequence) and only the bonus token is pending."""
    rt = rel_runtime
    prompt = PROMPTS[4]
    per_round = []

    def check(g):
        check_lengths(g)
        check_caches_equal_fresh(g)
        for s in live_states(g):
            per_round.append((s.result.stats.draft_tokens, s.result.stats.accepted_tokens))

    _, [r] = _spec(rt, f"fixed:{k}", [prompt], 60, drafter=TargetDrafter(), on_step=check, stop_token_ids=())
    assert r.token_ids == ar_tokens(rt, prompt, 60, stop_token_ids=())
    assert all(d == a for d, a in per_round) and r.stats.draft_tokens >= 10 * k


def test_sd20_k0_rounds_keep_the_drafter_context_in_step(rel_runtime, monkeypatch):
    """SD-20: 2 requests; the scheduler verifies k=3 with 1 request, k=0 with 2, then k=3 again:
    output == non-spec greedy, the drafter context tracks the committed length in k=0 rounds too, and
    after k returns to 3 request A gets exactly the drafts a run that never used k=0 gets."""
    rt = rel_runtime
    a_prompt, b_prompt = PROMPTS[0], PROMPTS[3]
    drafts = {}

    def recorder(tag):
        def factory(runner):
            class Rec:
                key = runner.key

                def infer(self, feed):
                    out = runner.infer(feed)
                    for slot in range(len(feed["anchor_ids"])):
                        drafts.setdefault(tag, {})[(int(feed["start_positions"][slot]),
                                                   int(feed["anchor_ids"][slot]))] = out["draft_ids"][slot].tolist()
                    return out
            return Rec()
        return factory

    policy = ScriptedPolicy(lambda step, R: 3 if R == 1 else 0)
    gen = generator(rt, policy)
    wrap = wrap_runners
    with monkeypatch.context() as m:
        wrap(m, rt.engines, "drafter_block", recorder("mixed"))
        a = gen.submit(a_prompt, SamplingParams(max_new_tokens=40))
        for _ in range(4):
            gen.step()
            check_lengths(gen)
        b = gen.submit(b_prompt, SamplingParams(max_new_tokens=6))
        run_steps(gen, check_lengths)
    with monkeypatch.context() as m:
        wrap(m, rt.engines, "drafter_block", recorder("solo"))
        solo = generator(rt, ScriptedPolicy(lambda step, R: 3))
        sa = solo.submit(a_prompt, SamplingParams(max_new_tokens=40))
        run_steps(solo)
    assert gen.result(a).token_ids == ar_tokens(rt, a_prompt, 40) == solo.result(sa).token_ids
    assert gen.result(b).token_ids == ar_tokens(rt, b_prompt, 6)
    shared = [key for key in drafts["mixed"] if key in drafts["solo"] and key[0] > len(a_prompt) + 8]
    assert len(shared) >= 3
    assert all(drafts["mixed"][key] == drafts["solo"][key] for key in shared)


# -- SD-21 / SD-23 -----------------------------------------------------------------------------
def test_sd21_sd23_long_prompt_then_slot_reuse_positions_are_contiguous(rel_runtime, monkeypatch):
    """SD-21: a 400-token prompt (the tiny engine's context is 512), then a second request that reuses
    its prefix on the same slot; SD-23: a batch of prompts of 3 and 40 tokens. Every target pass's
    position ids are cache_len + [0..q) per request (prefill chunks, verification rows), every
    request's first position is 0, and outputs equal the non-spec solo runs."""
    rt = rel_runtime
    calls = []
    wrap_runners(monkeypatch, rt.engines, "target", lambda r: RecordingRunner(r, calls))
    long_prompt = random_prompt(21, 400)
    for policy in ("fixed:8", "dspark-async"):
        gen = generator(rt, policy)
        first = gen.submit(long_prompt, SamplingParams(max_new_tokens=30))
        run_steps(gen, check_lengths)
        second = gen.submit(long_prompt[:250] + [9, 9, 9], SamplingParams(max_new_tokens=30))
        run_steps(gen, check_lengths)
        short, mid = gen.submit([11, 12, 13], SamplingParams(max_new_tokens=20)), \
            gen.submit(random_prompt(22, 40), SamplingParams(max_new_tokens=20))
        run_steps(gen, check_lengths)
        assert gen.result(first).token_ids == ar_tokens(rt, long_prompt, 30)
        assert gen.result(second).token_ids == ar_tokens(rt, long_prompt[:250] + [9, 9, 9], 30)
        assert gen.result(short).token_ids == ar_tokens(rt, [11, 12, 13], 20)
        assert gen.result(mid).token_ids == ar_tokens(rt, random_prompt(22, 40), 20)
    assert len(calls) > 20
    starts_at_zero = 0
    for _, feed, _, _ in calls:
        qs, lens, pos = feed["query_start"], feed["cache_lens"], feed["position_ids"]
        for slot in range(len(lens)):
            q = int(qs[slot + 1] - qs[slot])
            rows = pos[qs[slot]:qs[slot + 1]]
            if q == 0:
                continue
            # padding rows (bucket fill) follow a slot's real rows and repeat its last position (a slot
            # with padding only: its next position, cache_len); check the real rows
            n = _real_rows(feed, slot)
            np.testing.assert_array_equal(rows[:n], lens[slot] + np.arange(n))
            starts_at_zero += int(lens[slot] == 0)
    assert starts_at_zero >= 8


def _real_rows(feed, slot):
    """Real rows of a slot's query range: positions grow by 1 until the padding repeats the last."""
    qs, pos = feed["query_start"], feed["position_ids"]
    rows = pos[qs[slot]:qs[slot + 1]]
    steps = np.diff(rows)
    return int(np.argmax(steps != 1)) + 1 if (steps != 1).any() else len(rows)


# -- SD-25 / SD-26 / SD-27 (exporter shape regimes) ---------------------------------------------
@pytest.mark.parametrize("requests", [[(37, 5)], [(0, 30)], [(27, 3)], [(500, 11)], [(0, 7), (37, 5), (27, 3)]],
                         ids=["verify-past37", "prefill", "split-27+3", "positions-to-510", "mixed"])
def test_sd25_sd26_sd27_exported_target_in_every_shape_regime(tiny_llama, requests):
    """SD-25 (k+1=5 rows over past 37; prefill with past 0), SD-26 (a 30-token prompt fed 27 + 3
    equals the full forward), SD-27 (positions up to max_position_embeddings-2, RoPE from position
    ids): logits and tapped features match transformers in fp32 (1e-4)."""
    from tests.exporter.test_export_target import _run_mixed

    err_l, err_f = _run_mixed(tiny_llama, requests)
    assert err_l < 1e-4 and err_f < 1e-4, (err_l, err_f)


def test_sd27_no_table_baked_at_an_export_length(rel_engine_dir):
    """SD-27: no constant in the target graph has a dimension equal to the context capacity or to
    max_position_embeddings (no RoPE or causal-mask table frozen at trace time); cos/sin come from
    position_ids (Cos/Sin nodes in the graph)."""
    from onnx import numpy_helper  # noqa: F401

    model = onnx.load(str(rel_engine_dir / "graphs" / "target.onnx"), load_external_data=False)
    forbidden = {512}
    for init in model.graph.initializer:
        assert not forbidden & set(init.dims), init.name
    for node in model.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                assert not forbidden & set(a.t.dims), node.name
    ops = {n.op_type for n in model.graph.node}
    assert {"Cos", "Sin"} <= ops


# -- SD-28 / SD-33 (padding rows, masking) ------------------------------------------------------
def test_sd28_padding_rows_and_empty_slots_are_inert_and_finite(rel_runtime):
    """SD-28: a 4-slot batch with 3 live requests (one slot empty) and padding rows up to the bucket:
    every output is finite, and the real rows are bitwise unchanged when the padding rows' token ids
    change (no real row attends to them)."""
    engines = rel_runtime.engines
    spec = engines.manifest.data["graphs"]["target"]["spec"]
    rng = np.random.default_rng(0)
    P = 24
    lens = np.array([20, 0, 0, 13])
    past = {f"past_{kv}.{i}": rng.normal(size=(4, spec["num_kv_heads"], P, spec["head_dim"])).astype(np.float32)
            for i in range(spec["num_layers"]) for kv in ("key", "value")}
    segs = [Segment(0, rng.integers(0, 256, 5), 20), Segment(2, rng.integers(0, 256, 7), 0),
            Segment(3, rng.integers(0, 256, 1), 13)]
    runner = engines.runner_exact("target", 32)
    packed = pack_segments(segs, 4, lens, 32)
    assert packed.num_real_tokens == 13
    out1 = runner.infer({**packed.feed, **past})
    feed2 = dict(packed.feed)
    feed2["input_ids"] = feed2["input_ids"].copy()
    padding = np.setdiff1d(np.arange(32), packed.real_rows)
    feed2["input_ids"][padding] = rng.integers(0, 256, 32 - 13)
    out2 = runner.infer({**feed2, **past})
    for name, x in out1.items():
        assert np.isfinite(x).all(), name
    real = packed.real_rows
    for name in out1:
        if name.startswith("new_") or name == "aux_hidden":
            np.testing.assert_array_equal(out1[name][real], out2[name][real], err_msg=name)
    nlog = sum(len(s.token_ids) for s in segs)
    np.testing.assert_array_equal(out1["logits"][:nlog], out2["logits"][:nlog])


def test_sd33_masking_is_a_finite_fill_by_replacement(rel_engine_dir):
    """SD-33 (fp32 part): attention masks by Where(keep, score, -1e30) — a replacement with a finite
    fill, never an additive mask that could overflow — into a fp32 Softmax, and every query row keeps
    its own key (causal diagonal), so no row is ever fully masked. (In fp16, -1e30 would round to
    -inf: an fp16 export would need a different fill; there is no fp16 exporter, see the skip below.)"""
    from onnx import numpy_helper

    model = onnx.load(str(rel_engine_dir / "graphs" / "target.onnx"), load_external_data=False)
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if not i.data_location}
    producers = {o: n for n in model.graph.node for o in n.output}
    softmaxes = [n for n in model.graph.node if n.op_type == "Softmax"]
    assert softmaxes
    for sm in softmaxes:
        concat = producers[sm.input[0]]
        assert concat.op_type == "Concat"
        for part in concat.input:
            where = producers[part]
            assert where.op_type == "Where"
            fill = consts[where.input[2]]
            assert fill.dtype == np.float32 and np.isfinite(fill).all() and fill.max() <= -1e29
    assert not any(n.op_type == "Add" and any(i in consts and np.asarray(consts[i]).size == 1
                                               and consts[i] <= -1e29 for i in n.input) for n in model.graph.node)


@pytest.mark.skip(reason="SD-32/SD-33 fp16 part: the exporter writes fp32 graphs only (no fp16 option) and "
                         "TensorRT is not installed here; the fp32 graph checks above cover the mask and norm")
def test_sd32_sd33_fp16_engine_overflow():
    raise AssertionError("unreachable")


def test_sd32_rms_norm_runs_in_fp32(rel_engine_dir):
    """SD-32 (fp32 part): every RMSNorm reduction (Pow → ReduceMean) of the target graph, including
    a Qwen3-style q/k norm where present, takes float32 inputs (shape inference over the graph)."""
    model = onnx.load(str(rel_engine_dir / "graphs" / "target.onnx"), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in list(inferred.graph.value_info) + list(inferred.graph.input)}
    pows = [n for n in inferred.graph.node if n.op_type == "Pow"]
    assert pows
    for n in pows:
        assert types.get(n.input[0]) == onnx.TensorProto.FLOAT, n.name


# -- SD-30 / SD-31 (empty past, engines at the profile extremes) ---------------------------------
def test_sd30_sd31_every_engine_runs_at_empty_and_full_past(rel_runtime):
    """SD-30/SD-31: every target engine (each bucket N) runs with an empty past (cache_lens 0,
    prefill) and with the largest past that fits the context (max_context - N), the inputs
    mutually consistent (cache_lens + query ≤ capacity, one batch dim), outputs finite; a prompt of
    one token (BOS only) generates. TensorRT profiles: no TensorRT here (skipped at SD-04/32)."""
    rt = rel_runtime
    engines = rt.engines
    spec = engines.manifest.data["graphs"]["target"]["spec"]
    C = engines.manifest.runtime["max_context"]
    for N in engines.buckets("target"):
        runner = engines.runner_exact("target", N)
        for past in (0, C - N):
            kv = {f"past_{x}.{i}": np.zeros((1, spec["num_kv_heads"], max(past, 1), spec["head_dim"]), np.float32)
                  for i in range(spec["num_layers"]) for x in ("key", "value")}
            packed = pack_segments([Segment(0, np.arange(N) % 256, past)], 1, np.array([past]), N)
            out = runner.infer({**packed.feed, **kv})
            assert out["logits"].shape == (N, 256) and np.isfinite(out["logits"]).all(), (N, past)
    assert len(ar_tokens(rt, [1], 8)) >= 1


# -- SD-35 ---------------------------------------------------------------------------------------
def test_sd35_prompt_plus_max_new_tokens_equals_capacity(rel_runtime):
    """SD-35 (tiny): a 440-token prompt in a 512-token engine, max_new_tokens so that prompt + output
    fills the capacity exactly: spec output == non-spec output, both end by length at the capacity."""
    rt = rel_runtime
    prompt = random_prompt(35, 440)
    n = 512 - 440
    ref = generator(rt, "ar").generate([prompt], [SamplingParams(max_new_tokens=n, stop_token_ids=())])[0]
    for policy, drafter in (("fixed:8", None), ("dspark", None), ("fixed:8", TargetDrafter())):
        _, [r] = _spec(rt, policy, [prompt], n, drafter=drafter, on_step=check_lengths)
        assert r.token_ids == ref.token_ids, policy
        assert r.finish_reason == ref.finish_reason
    assert ref.finish_reason in ("length", "stop") and (ref.finish_reason == "stop" or len(ref.token_ids) == n)
