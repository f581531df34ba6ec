"""dspark::SpeculativeVerify: hand cases and losslessness (Leviathan et al. 2023) on the numpy reference
and the ONNX function (ONNX Runtime), parity between the two, input immutability and errors."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_export.errors import PluginError
from dspark_export.plugins.common.sampling import sample_from_probs, warp_probs
from dspark_export.plugins.speculative_verify.onnx_function import make_function, make_node
from dspark_export.plugins.speculative_verify.reference import run
from plugin_cases import SAMPLING_CASES, freeze, run_ort, verify_feeds

F32, I64 = np.float32, np.int64
IMPLS = ["reference", "onnxruntime"]


def _run(impl: str, feeds: dict) -> tuple[list[int], list[int]]:
    outputs = run(feeds) if impl == "reference" else run_ort("SpeculativeVerify", {}, feeds)
    return outputs["num_accepted"].tolist(), outputs["next_ids"].tolist()


def _feeds(target_probs, draft_probs, draft_ids, verify_lens, uniforms, temperature=1.0, top_k=0, top_p=1.0):
    """Feeds from probability rows (logits = log p); query_start packs the requests back to back."""
    verify_lens = np.array(verify_lens, I64)
    num_requests = len(verify_lens)
    with np.errstate(divide="ignore"):
        target_logits = np.log(np.array(target_probs, np.float64)).astype(F32)
        draft_logits = np.log(np.array(draft_probs, np.float64)).astype(F32)
    draft_logits = draft_logits.reshape(num_requests, -1, target_logits.shape[-1])
    return dict(
        target_logits=np.maximum(target_logits, F32(-80)), query_start=np.concatenate([[0], np.cumsum(verify_lens + 1)]),
        draft_ids=np.array(draft_ids, I64), draft_logits=np.maximum(draft_logits, F32(-200)), verify_lens=verify_lens,
        temperature=np.full(num_requests, temperature, F32), top_k=np.full(num_requests, top_k, I64),
        top_p=np.full(num_requests, top_p, F32), uniforms=np.array(uniforms, F32),
    )


BONUS = [0.1, 0.2, 0.3, 0.4]  # u = 0.35: cumsum 0.1, 0.3, 0.6 -> token 2; greedy -> token 3


@pytest.mark.parametrize("impl", IMPLS)
def test_all_accepted_emits_the_bonus_sample_of_the_last_row(impl):
    rows = [[0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]]
    feeds = _feeds(rows + [BONUS], rows, [[1, 2]], [2], [[0.9, 0.9, 0.35]])  # q == p: always accepted
    assert _run(impl, feeds) == ([2], [2])


@pytest.mark.parametrize("impl", IMPLS)
def test_first_rejected_emits_the_residual_sample(impl):
    target = [[0.1, 0.5, 0.3, 0.1], BONUS, BONUS]
    draft = [[0.1, 0.1, 0.1, 0.7], [0.25] * 4]
    # u·q(3) = 0.35 >= p(3) = 0.1: rejected. Residual max(p - q, 0) = [0, .4, .2, 0]; u = .7 -> 2, u = .5 -> 1.
    assert _run(impl, _feeds(target, draft, [[3, 1]], [2], [[0.5, 0.0, 0.7]])) == ([0], [2])
    assert _run(impl, _feeds(target, draft, [[3, 1]], [2], [[0.5, 0.0, 0.5]])) == ([0], [1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("temperature, expected", [(1.0, 2), (0.0, 3)])
def test_empty_draft_samples_row_zero(impl, temperature, expected):
    feeds = _feeds([BONUS], [[0.25] * 4] * 2, [[-1, -1]], [0], [[0.0, 0.0, 0.35]], temperature=temperature)
    assert _run(impl, feeds) == ([0], [expected])


@pytest.mark.parametrize("impl", IMPLS)
def test_ragged_greedy_batch_uses_each_requests_own_rows(impl):
    vocab, gamma = 10, 3
    argmaxes = [5, 6, 7, 8, 1, 2, 3, 4, 0, 0]  # r0 rows 0-2, r1 row 3, r2 rows 4-7, then 2 padding rows
    target = np.eye(vocab)[argmaxes] * 0.9 + 0.01
    feeds = _feeds(target, np.full((3, gamma, vocab), 0.1), [[5, 6, -1], [-1, -1, -1], [1, 9, 3]], [2, 0, 3],
                   np.full((3, gamma + 1), 0.99), temperature=0.0)
    # r0: both accepted, bonus argmax of row 2; r1: no draft, argmax of row 3; r2: stops at the first mismatch.
    assert _run(impl, feeds) == ([2, 0, 1], [7, 8, 2])


@pytest.mark.parametrize("impl", IMPLS)
def test_one_hot_draft_distributions(impl):
    target = [[0.1, 0.6, 0.3], [0.7, 0.2, 0.1]] * 3
    draft = np.full((3, 1, 3), 1e-90)
    draft[:, 0, 1] = 1.0  # logits 0 vs -200: q is exactly one-hot at token 1
    # accept iff u < p(1) = 0.6; residual [0.1, 0, 0.3]: u = .5 -> 2, u = .2 -> 0; bonus row, u = .5 -> 0.
    feeds = _feeds(target, draft, [[1], [1], [1]], [1, 1, 1], [[0.5, 0.5], [0.7, 0.5], [0.7, 0.2]])
    assert _run(impl, feeds) == ([1, 0, 0], [0, 2, 0])


@pytest.mark.parametrize("impl", IMPLS)
def test_all_zero_residual_falls_back_to_the_target(impl):
    # top-1 makes p and q one-hot at token 1; draft 0 has p = q = 0, so it is rejected with a zero residual.
    rows = [[0.2, 0.5, 0.3], [0.2, 0.5, 0.3]]
    assert _run(impl, _feeds(rows, rows[:1], [[0]], [1], [[0.5, 0.9]], top_k=1)) == ([0], [1])


@pytest.mark.parametrize("case", [*SAMPLING_CASES, "ties"])
@pytest.mark.parametrize("gamma, vocab", [(4, 50), (7, 37)], ids=["g4_v50", "g7_v37"])
def test_onnx_matches_reference(gamma, vocab, case):
    has_ties = case == "ties"
    for seed in range(4):
        rng = np.random.default_rng(seed)
        verify_lens = rng.integers(0, gamma + 1, 6)
        verify_lens[:2] = [0, gamma]
        feeds = verify_feeds(rng, "mixed" if has_ties else case, verify_lens, gamma, vocab, has_ties=has_ties)
        expected, actual = run(feeds), run_ort("SpeculativeVerify", {}, feeds)
        np.testing.assert_array_equal(actual["num_accepted"], expected["num_accepted"])
        np.testing.assert_array_equal(actual["next_ids"], expected["next_ids"])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)])
def test_first_emitted_token_follows_the_target_distribution(impl, temperature, top_k, top_p):
    """Losslessness: accepted draft x0 if accepted, else the residual sample, is distributed as p (TV < 0.02)."""
    rng = np.random.default_rng(11)
    trials, vocab = 40_000, 6
    target_row, bonus_row, draft_row = (rng.normal(0, 1.5, (1, vocab)).astype(F32) for _ in range(3))
    params = dict(temperature=np.full(trials, temperature, F32), top_k=np.full(trials, top_k, I64),
                  top_p=np.full(trials, top_p, F32))
    q = warp_probs(draft_row, *(v[:1] for v in params.values()))
    x0 = sample_from_probs(np.broadcast_to(q, (trials, vocab)), rng.random(trials, dtype=F32))
    feeds = dict(
        target_logits=np.tile(np.concatenate([target_row, bonus_row]), (trials, 1)),
        query_start=np.arange(0, 2 * trials + 1, 2, dtype=I64), draft_ids=x0[:, None],
        draft_logits=np.broadcast_to(draft_row, (trials, 1, vocab)).copy(), verify_lens=np.ones(trials, I64),
        **params, uniforms=rng.random((trials, 2), dtype=F32),
    )
    outputs = run(feeds) if impl == "reference" else run_ort("SpeculativeVerify", {}, feeds)
    first = np.where(outputs["num_accepted"] == 1, x0, outputs["next_ids"])
    frequencies = np.bincount(first, minlength=vocab) / trials
    p = warp_probs(target_row, *(v[:1] for v in params.values()))[0]
    assert 0.5 * np.abs(frequencies - p).sum() < 0.02  # sampling noise alone is about 0.005 at 40k trials
    assert 0.5 * np.abs(p - q[0]).sum() > 0.1  # p and q really differ, so rejections happen


@pytest.mark.parametrize("impl", IMPLS)
def test_inputs_are_never_modified(impl):
    feeds = verify_feeds(np.random.default_rng(12), "mixed", [3, 0, 1, 4, 2, 4], 4)
    frozen = freeze(feeds)
    run(frozen) if impl == "reference" else run_ort("SpeculativeVerify", {}, frozen)
    for name, array in feeds.items():
        np.testing.assert_array_equal(frozen[name], array, err_msg=name)


@pytest.mark.parametrize("changes, pattern", [
    (dict(query_start=np.array([0, 3, 5, 8], I64)), r"query_start\[r\+1\] - query_start\[r\] == verify_lens\[r\] \+ 1"),
    (dict(verify_lens=np.array([2, 0, 5], I64)), r"'verify_lens'.*\[0, γ=4\]"),
    (dict(verify_lens=np.array([2, -1, 2], I64)), r"'verify_lens'"),
    (dict(query_start=np.array([0, 3, 4, 9], I64), verify_lens=np.array([2, 0, 4], I64)), r"within target_logits"),
    (dict(uniforms=np.zeros((3, 4), F32)), r"'uniforms'.*\[R, γ\+1\].*γ=4.*\(3, 4\)"),
    (dict(draft_ids=np.zeros((3, 4), np.int32)), r"'draft_ids'.*int64.*int32"),
    (dict(draft_logits=np.zeros((3, 4, 49), F32)), r"'draft_logits'.*V=50.*\(3, 4, 49\)"),
    (dict(draft_ids=np.array([[0, 50, 0, 0]] * 3, I64)), r"'draft_ids'.*\[0, V=50\)"),
    (dict(query_start=np.array([0, 3, 4], I64)), r"'query_start'.*\[R\+1\]"),
])
def test_errors_name_the_input_and_the_shapes(changes, pattern):
    feeds = verify_feeds(np.random.default_rng(13), "t1.3", [2, 0, 2], 4, extra_rows=0)  # M = 8
    with pytest.raises(PluginError, match=pattern):
        run({**feeds, **changes})


def test_zero_draft_slots_are_rejected():
    feeds = verify_feeds(np.random.default_rng(14), "t1.3", [0, 0], 1)
    feeds.update(draft_ids=np.zeros((2, 0), I64), draft_logits=np.zeros((2, 0, 50), F32), uniforms=np.zeros((2, 1), F32))
    with pytest.raises(PluginError, match="γ >= 1"):
        run(feeds)


def test_node_and_function_api():
    node = make_node(list("abcdefghi"), ["num_accepted", "next_ids"], "/verify/SpeculativeVerify")
    assert (node.domain, node.op_type, node.overload) == ("dspark", "SpeculativeVerify", "")
    with pytest.raises(PluginError, match="9 non-empty inputs"):
        make_node(list("abcdefgh") + [""], ["n", "x"], "/v")
    with pytest.raises(PluginError, match="no static configuration"):
        make_function(block_size=4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("temperatures", [[0.0, 0.0], [0.0, 1.0]], ids=["all-greedy", "mixed"])
def test_greedy_drafts_past_verify_lens_are_never_accepted(impl, temperatures):
    """Both function branches (all-greedy fast path, mixed batch): drafts beyond verify_lens that happen to equal
    the target argmax, or sit where the padded row index repeats the last verified row, do not count."""
    vocab, gamma = 6, 3
    argmaxes = [2, 3, 4, 5, 1, 2, 3, 4]  # r0 rows 0-1 (verify 1), r1 rows 2-5 (verify 3), 2 padding rows
    target = np.eye(vocab)[argmaxes] * 0.9 + 0.01
    feeds = _feeds(target, np.full((2, gamma, vocab), 1 / vocab), [[2, 3, 4], [4, 5, 1]], [1, 3],
                   np.full((2, gamma + 1), 0.99), temperature=0.0)
    feeds["temperature"] = np.array(temperatures, F32)
    num, nxt = _run(impl, feeds)
    assert num[0] == 1 and nxt[0] == 3          # draft 3 at slot 1 equals row 1's argmax but is unverified
    if temperatures[1] == 0.0:
        assert (num[1], nxt[1]) == (3, 2)        # all three accepted, bonus = argmax of row 5


def test_a_sampled_rows_token_does_not_depend_on_its_batch_mates_verify_lengths():
    """With V·4 bytes not a multiple of 64, ONNX Runtime's float row sums depend on where a row sits in memory,
    and a request's rows sit further along when a batch mate verifies more drafts; the op pads warped rows to
    16 values, so its next token stays the same. The uniform sits on a sampling boundary where one rounding
    step of the row's sums flips the token (found by search on the unpadded op)."""
    vocab, gamma = 4099, 5
    logits = (np.random.default_rng(1).normal(size=(3, vocab)) * 3).astype(F32)
    uniforms = np.full((3, gamma + 1), 0.5, F32)
    uniforms[2, gamma] = np.uint32(0x3EC12F4D).view(F32)

    def next_ids(lens: list[int]) -> list[int]:
        rows = np.concatenate([np.repeat(logits[r:r + 1], n + 1, axis=0) for r, n in enumerate(lens)])
        feeds = {"target_logits": rows, "query_start": np.concatenate([[0], np.cumsum(np.add(lens, 1))]).astype(I64),
                 "draft_ids": np.zeros((3, gamma), I64), "draft_logits": np.zeros((3, gamma, vocab), F32),
                 "verify_lens": np.array(lens, I64), "temperature": np.ones(3, F32), "top_k": np.zeros(3, I64),
                 "top_p": np.ones(3, F32), "uniforms": uniforms}
        return run_ort("SpeculativeVerify", {}, feeds)["next_ids"].tolist()

    assert next_ids([0, 0, 0])[2] == next_ids([0, gamma, 0])[2] == next_ids([gamma, gamma, 0])[2]
