"""CE against the target's own argmax (`make_batch(ce_labels="argmax")`, `TrainConfig.ce_labels`): the labels land
where the target's row predicts the slot's token, only CE reads them, and bad input is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_export.errors import ConfigError
from dspark_export.training.objective import (make_batch, response_logsumexp, response_targets,
                                              target_logsumexp)
from dspark_export.training.trainer import TrainConfig, train_drafter

from .test_draft_vocab_loss import _drafter, _loss_and_grads


def _seqs(feature_cache, W, n=3):
    seqs = [feature_cache[i] for i in range(n)]
    for s in seqs:
        s.t_lse, s.t_argmax = response_targets(s, W)
    return seqs


def test_response_targets_are_the_full_vocabulary_argmax_and_logsumexp(train_target, feature_cache):
    W = _drafter(train_target).lm_head.weight.detach()
    s = feature_cache[0]
    lse, top = response_targets(s, W)
    z = torch.from_numpy(np.asarray(s.last)) @ W.float().T
    start = s.prompt_len
    assert top.dtype == np.int64 and (top[:start] == 0).all() and np.isinf(lse[:start]).all()
    np.testing.assert_array_equal(top[start:], z[start:].argmax(-1).numpy())
    np.testing.assert_allclose(lse[start:], target_logsumexp(torch.from_numpy(np.asarray(s.last[start:])), W).numpy())
    np.testing.assert_array_equal(lse, response_logsumexp(s, W))


def test_argmax_labels_sit_at_the_row_that_predicts_each_slot(train_target, feature_cache):
    W = _drafter(train_target).lm_head.weight.detach()
    seqs = _seqs(feature_cache, W)
    tok = make_batch(seqs, 6, 4, np.random.default_rng(2))
    arg = make_batch(seqs, 6, 4, np.random.default_rng(2), ce_labels="argmax")
    assert tok.ce_labels is None and torch.equal(arg.labels, tok.labels) and torch.equal(arg.anchors, tok.anchors)
    for b, s in enumerate(seqs):
        for n in range(arg.anchors.shape[1]):
            for k in range(4):
                if arg.valid[b, n, k] and arg.keep[b, n]:
                    p = int(arg.anchors[b, n])
                    assert int(arg.ce_labels[b, n, k]) == int(s.t_argmax[p + k])   # row p + k predicts p + k + 1
                    assert int(arg.labels[b, n, k]) == int(s.tokens[p + k + 1])
    assert bool((arg.ce_labels != arg.labels)[arg.valid].any())   # a random target disagrees with the records


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("d2t", [None, "all"])
def test_labels_equal_to_the_tokens_train_as_before(train_target, feature_cache, fused, d2t):
    drafter = _drafter(train_target)
    seqs = _seqs(feature_cache, drafter.lm_head.weight.detach())
    batch = make_batch(seqs, 6, 4, np.random.default_rng(2))
    same = make_batch(seqs, 6, 4, np.random.default_rng(2), ce_labels="argmax")
    same.ce_labels = batch.labels.clone()
    kw = {"fused": fused, "d2t": torch.arange(drafter.config.vocab_size) if d2t else None}
    l0, m0, g0 = _loss_and_grads(drafter, batch, **kw)
    l1, m1, g1 = _loss_and_grads(drafter, same, **kw)
    assert l1 == l0 and m1 == m0
    for name in g0:
        assert torch.equal(g1[name], g0[name]), name


@pytest.mark.parametrize("fused", [True, False])
def test_argmax_labels_move_ce_only(train_target, feature_cache, fused):
    drafter = _drafter(train_target)
    seqs = _seqs(feature_cache, drafter.lm_head.weight.detach())
    _, tok, _ = _loss_and_grads(drafter, make_batch(seqs, 6, 4, np.random.default_rng(2)), fused=fused)
    _, arg, _ = _loss_and_grads(drafter, make_batch(seqs, 6, 4, np.random.default_rng(2), ce_labels="argmax"),
                                fused=fused)
    assert arg["ce"] != pytest.approx(tok["ce"], rel=1e-3)
    for key in ("l1", "bce", "tau_probabilistic", "accept_rate", "top1"):
        assert arg[key] == pytest.approx(tok[key], rel=1e-6), key


def test_fused_argmax_loss_equals_the_direct_form(train_target, feature_cache):
    drafter = _drafter(train_target)
    seqs = _seqs(feature_cache, drafter.lm_head.weight.detach())
    batch = make_batch(seqs, 6, 4, np.random.default_rng(2), ce_labels="argmax")
    d2t = torch.tensor(sorted(set(torch.unique(batch.ce_labels).tolist()[::2]) | set(range(40))))  # some in the bucket
    l0, m0, g0 = _loss_and_grads(drafter, batch, fused=True, chunk=7, d2t=d2t)
    l1, m1, g1 = _loss_and_grads(drafter, batch, fused=False, d2t=d2t)
    torch.testing.assert_close(l0, l1, rtol=1e-5, atol=1e-6)
    assert 0 < m0["bucket_labels"] < 1
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-4, atol=1e-7, msg=name)


def test_bad_ce_labels_are_refused_by_name(train_target, feature_cache, tmp_path):
    seqs = [feature_cache[i] for i in range(2)]
    with pytest.raises(ConfigError, match="ce_labels: expected one of"):
        make_batch(seqs, 4, 4, np.random.default_rng(0), ce_labels="sampled")
    with pytest.raises(ConfigError, match="t_argmax"):
        make_batch(seqs, 4, 4, np.random.default_rng(0), ce_labels="argmax")
    with pytest.raises(ConfigError, match="TrainConfig.ce_labels"):
        TrainConfig(out_dir=str(tmp_path), ce_labels="top1")


def test_training_with_argmax_labels_runs_and_resumes_under_the_same_labels_only(train_target, feature_cache, tmp_path):
    def cfg(steps, labels):
        return TrainConfig(out_dir=str(tmp_path), steps=steps, seqs_per_step=2, anchors_per_seq=4, block_size=4,
                           num_draft_layers=1, markov_rank=8, save_every=1, log_every=1, lr=1e-3, ce_labels=labels)
    train_drafter(train_target, feature_cache, cfg(2, "argmax"))
    with pytest.raises(ConfigError, match="ce_labels"):
        train_drafter(train_target, feature_cache, cfg(3, "token"))
    train_drafter(train_target, feature_cache, cfg(3, "argmax"))
    state = torch.load(tmp_path / "training_state.pt", weights_only=True)
    assert state["step"] == 3 and state["config"]["ce_labels"] == "argmax"
