"""Training over the draft vocabulary d2t: the pooled-bucket loss (training/objective.py, "Draft vocabulary")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_export.modeling.config import DrafterConfig
from dspark_export.modeling.drafter import init_drafter
from dspark_export.training.objective import (dspark_loss, make_batch, response_logsumexp, target_logsumexp,
                                              token_to_draft)


def _drafter(train_target, markov_rank=8, seed=5):
    cfg = DrafterConfig.from_target(train_target.config, num_draft_layers=1, block_size=4, markov_rank=markov_rank,
                                    enable_confidence_head=markov_rank > 0, confidence_head_with_markov=markov_rank > 0)
    drafter = init_drafter(train_target, cfg, seed=seed).train()
    with torch.no_grad():  # move off the init so every head contributes
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(seed)))
    return drafter


def _loss_and_grads(drafter, batch, **kw):
    drafter.zero_grad(set_to_none=True)
    loss, metrics = dspark_loss(drafter, batch, bf16=False, **kw)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}


def _d2t_missing_some_labels(batch, vocab, n):
    """A d2t of n ids that leaves out some of the batch's labels (so the bucket holds labels) and keeps others."""
    labels = torch.unique(batch.labels[batch.valid]).tolist()
    rng = np.random.default_rng(0)
    keep = set(labels[::2])  # half of the labels inside d2t, half in the bucket
    others = [v for v in rng.permutation(vocab).tolist() if v not in set(labels)]
    return torch.tensor(sorted(keep | set(others[:n - len(keep)])))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("markov_rank", [8, 0])
def test_pooled_loss_equals_the_full_vocabulary_loss_when_n_is_v(train_target, feature_cache, fused, markov_rank):
    drafter = _drafter(train_target, markov_rank)
    batch = make_batch([feature_cache[i] for i in range(3)], 6, 4, np.random.default_rng(2))
    V = drafter.config.vocab_size
    l0, m0, g0 = _loss_and_grads(drafter, batch, fused=fused, chunk=7)
    l1, m1, g1 = _loss_and_grads(drafter, batch, fused=fused, chunk=7, d2t=torch.arange(V))
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for key in ("ce", "l1", "tau_probabilistic") + (("bce",) if markov_rank else ()):
        assert m1[key] == pytest.approx(m0[key], rel=1e-5)
    assert m1["top1"] == m0["top1"] and m1["bucket_labels"] == 0 and m1["bucket_mass"] == pytest.approx(0, abs=1e-5)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("markov_rank", [8, 0])
def test_fused_pooled_loss_equals_the_direct_form(train_target, feature_cache, markov_rank):
    """N < V with labels in the bucket: the chunked loss equals the direct autograd form (values, gradients)."""
    drafter = _drafter(train_target, markov_rank)
    batch = make_batch([feature_cache[i] for i in range(3)], 6, 4, np.random.default_rng(2))
    d2t = _d2t_missing_some_labels(batch, drafter.config.vocab_size, 64)
    l0, m0, g0 = _loss_and_grads(drafter, batch, fused=False, d2t=d2t)
    l1, m1, g1 = _loss_and_grads(drafter, batch, fused=True, chunk=5, d2t=d2t)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for key in ("ce", "l1", "tau_probabilistic", "bucket_labels", "bucket_mass"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7)
    assert m1["top1"] == m0["top1"] and m1["bucket_labels"] > 0.1
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-7, msg=name)


def test_bucket_mass_and_l1_are_those_of_the_exported_draft_distribution(train_target, feature_cache):
    """Recomputed here over the full vocabulary: the target's bucket mass is its probability outside d2t, and
    L1 is ‖q − p_t‖₁ for q the inference drafter's distribution (every token outside d2t at exactly 0)."""
    drafter = _drafter(train_target)
    batch = make_batch([feature_cache[i] for i in range(3)], 6, 4, np.random.default_rng(3))
    V = drafter.config.vocab_size
    d2t = _d2t_missing_some_labels(batch, V, 48)
    with torch.no_grad():
        _, m = dspark_loss(drafter, batch, bf16=False, d2t=d2t)
        from dspark_export.training.objective import block_forward

        hidden, U = block_forward(drafter, batch)
        prev = torch.cat((torch.gather(batch.tokens, 1, batch.anchors)[:, :, None], batch.labels[:, :, :-1]), dim=2)
        logits = U + drafter.markov_head(prev)
        outside = torch.ones(V, dtype=torch.bool)
        outside[d2t] = False
        q = torch.softmax(logits.masked_fill(outside, float("-inf")), dim=-1)  # the exported block's q
        pos = (batch.anchors[:, :, None] + torch.arange(4)).clamp(max=batch.tokens.shape[1] - 1)
        t = torch.gather(batch.last, 1, pos.reshape(pos.shape[0], -1, 1).expand(-1, -1, batch.last.shape[-1]))
        p_t = torch.softmax(drafter.lm_head(t), dim=-1).reshape(q.shape)
    w = (batch.valid & batch.keep[:, :, None]).float() * torch.exp(-torch.arange(4.0) / 4)
    mean = lambda x: float((w * x).sum() / w.sum())  # noqa: E731
    assert m["bucket_mass"] == pytest.approx(mean(p_t[..., outside].sum(-1)), rel=1e-5)
    assert m["l1"] == pytest.approx(mean((q - p_t).abs().sum(-1)), rel=1e-5)
    assert m["bucket_labels"] == pytest.approx(mean(outside[batch.labels].float()), rel=1e-6)
    alpha = torch.minimum(q, p_t).sum(-1)  # acceptance of the exported block at T = 1
    assert m["accept_rate"] == pytest.approx(((alpha * w.bool()).sum((0, 1)) / w.bool().sum((0, 1))).tolist(),
                                             abs=1e-4)


def test_gradients_flow_to_the_d2t_rows_only_and_bucket_labels_carry_no_ce(train_target, feature_cache):
    drafter = _drafter(train_target)
    batch = make_batch([feature_cache[i] for i in range(3)], 6, 4, np.random.default_rng(2))
    V = drafter.config.vocab_size
    d2t = _d2t_missing_some_labels(batch, V, 40)
    _, m, grads = _loss_and_grads(drafter, batch, d2t=d2t)
    assert all(g.abs().sum() > 0 for n, g in grads.items() if n != "markov_head.markov_w2.weight"), \
        [n for n, g in grads.items() if g.abs().sum() == 0]
    gW2 = grads["markov_head.markov_w2.weight"]
    inside = torch.zeros(V, dtype=torch.bool)
    inside[d2t] = True
    assert gW2[inside].abs().sum(-1).gt(0).all() and gW2[~inside].abs().sum() == 0
    assert drafter.lm_head.weight.grad is None
    # only bucket labels: CE is 0 and has no gradient; L1 still trains
    only_bucket = torch.tensor(sorted(set(range(V)) - set(batch.labels[batch.valid].tolist())))
    drafter.zero_grad(set_to_none=True)
    loss, m = dspark_loss(drafter, batch, bf16=False, d2t=only_bucket)
    assert m["ce"] == 0 and m["bucket_labels"] == pytest.approx(1.0)
    loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0


def test_precomputed_target_logsumexp_equals_the_on_the_fly_one(train_target, feature_cache):
    drafter = _drafter(train_target)
    seqs = [feature_cache[i] for i in range(3)]
    W = drafter.lm_head.weight.detach()
    batch = make_batch(seqs, 6, 4, np.random.default_rng(2))
    for s in seqs:
        s.t_lse = target_logsumexp(torch.from_numpy(s.last), W, bf16=False).numpy()
    cached = make_batch(seqs, 6, 4, np.random.default_rng(2))
    assert batch.t_lse is None and cached.t_lse is not None
    d2t = _d2t_missing_some_labels(batch, drafter.config.vocab_size, 64)
    l0, m0, g0 = _loss_and_grads(drafter, batch, d2t=d2t)
    l1, m1, g1 = _loss_and_grads(drafter, cached, d2t=d2t)
    torch.testing.assert_close(l1, l0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], msg=name)


def test_the_response_rows_logsumexp_trains_as_the_whole_sequences(train_target, feature_cache):
    """t_lse computed on the response rows only (+inf on the prompt's) gives the same loss, metrics and
    gradients, padded anchors included (more anchors asked for than the responses have)."""
    drafter = _drafter(train_target)
    W = drafter.lm_head.weight.detach()
    batches = []
    for fill in (lambda s: target_logsumexp(torch.from_numpy(s.last), W).numpy(), lambda s: response_logsumexp(s, W)):
        seqs = [feature_cache[i] for i in range(3)]
        for s in seqs:
            s.t_lse = fill(s)
        batches.append(make_batch(seqs, 200, 4, np.random.default_rng(3)))
    full, response = batches
    assert not bool(full.keep.all()) and bool(torch.isinf(response.t_lse).any())
    d2t = _d2t_missing_some_labels(full, drafter.config.vocab_size, 64)
    l0, m0, g0 = _loss_and_grads(drafter, full, d2t=d2t)
    l1, m1, g1 = _loss_and_grads(drafter, response, d2t=d2t)
    assert torch.isfinite(l1) and l1 == l0 and m1 == m0
    for name in g0:
        assert torch.equal(g1[name], g0[name]), name


def test_bad_d2t_is_refused():
    for bad in (torch.tensor([1, 1]), torch.tensor([0, 300]), torch.tensor([-1]), torch.zeros(0, dtype=torch.long)):
        with pytest.raises(ValueError, match="d2t"):
            token_to_draft(bad, 256)
    t2d = token_to_draft(torch.tensor([5, 2, 9]), 12)
    assert t2d.tolist() == [-1, -1, 1, -1, -1, 0, -1, -1, -1, 2, -1, -1]
