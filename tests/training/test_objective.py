"""The training forward equals the inference forward, and the objective trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_export.modeling.config import DrafterConfig
from dspark_export.modeling.drafter import init_drafter
from dspark_export.training.objective import LossWeights, block_forward, dspark_loss, make_batch, sample_anchors


def test_sample_anchors_stay_inside_the_assistant_tokens():
    rng = np.random.default_rng(0)
    a = sample_anchors(prompt_len=5, length=30, n=8, rng=rng)
    assert len(a) == 8 and list(a) == sorted(set(a))
    assert a.min() >= 5 and a.max() <= 28
    assert list(sample_anchors(5, 8, 10, rng)) == [5, 6]  # fewer candidates than n: all of them
    assert len(sample_anchors(5, 6, 10, rng)) == 0  # one assistant token: no label after it


@pytest.mark.parametrize("layers", [1, 2])
def test_block_forward_matches_forward_block_per_anchor(train_target, feature_cache, layers):
    cfg = DrafterConfig.from_target(train_target.config, num_draft_layers=layers, block_size=4, markov_rank=8)
    drafter = init_drafter(train_target, cfg, seed=3)
    seqs = [feature_cache[0], feature_cache[1]]
    batch = make_batch(seqs, anchors_per_seq=5, block_size=4, rng=np.random.default_rng(1))
    with torch.no_grad():
        hidden, U = block_forward(drafter, batch)
        for b, s in enumerate(seqs):
            T = len(s.tokens)
            ctx = drafter.context_kv(torch.from_numpy(s.aux), torch.arange(T))
            for j in range(batch.anchors.shape[1]):
                if not batch.keep[b, j]:
                    continue
                p = int(batch.anchors[b, j])
                kv = [(k.transpose(0, 1)[None], v.transpose(0, 1)[None]) for k, v in ctx]  # [1, kvH, T, D]
                h_ref, u_ref = drafter.forward_block(torch.tensor([s.tokens[p]]), torch.tensor([p]), kv,
                                                     torch.tensor([p]))
                torch.testing.assert_close(hidden[b, j], h_ref[0], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(U[b, j], u_ref[0], atol=1e-4, rtol=1e-4)


def test_dspark_loss_terms_and_training_reduces_it(train_target, feature_cache):
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(train_target.config, num_draft_layers=1, block_size=4, markov_rank=8)
    drafter = init_drafter(train_target, cfg, seed=0).train()
    batch = make_batch([feature_cache[i] for i in range(4)], 8, 4, np.random.default_rng(0))
    _, first = dspark_loss(drafter, batch, bf16=False)
    assert set(first) >= {"ce", "l1", "bce", "accept_rate", "top1", "tau_probabilistic"}
    assert 0 <= first["l1"] <= 2 and len(first["accept_rate"]) == 4
    assert 1.0 <= first["tau_probabilistic"] <= 5.0
    expected = 0.1 * first["ce"] + 0.9 * first["l1"] + first["bce"]
    assert first["loss"] == pytest.approx(expected, rel=1e-5)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(30):
        loss, metrics = dspark_loss(drafter, batch, bf16=False)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert metrics["loss"] < 0.7 * first["loss"]
    assert metrics["tau_probabilistic"] > first["tau_probabilistic"]
    # frozen shared tensors did not move
    torch.testing.assert_close(drafter.lm_head.weight, train_target.model.get_output_embeddings().weight)


def test_dflash_loss_has_no_confidence_term(train_target, feature_cache):
    cfg = DrafterConfig.from_target(train_target.config, block_size=4, markov_rank=0, enable_confidence_head=False)
    drafter = init_drafter(train_target, cfg)
    batch = make_batch([feature_cache[0]], 4, 4, np.random.default_rng(0))
    _, m = dspark_loss(drafter, batch, LossWeights(), bf16=False)
    assert "bce" not in m and m["loss"] == pytest.approx(0.1 * m["ce"] + 0.9 * m["l1"], rel=1e-5)


def test_loss_weights_weigh_the_terms_and_refuse_bad_values(train_target, feature_cache):
    """A CE-heavy objective (`train --loss-weights ce=1`) is the same terms weighed differently; weights that
    cannot train are refused by name."""
    from dspark_export.errors import ConfigError

    cfg = DrafterConfig.from_target(train_target.config, block_size=4, markov_rank=8)
    drafter = init_drafter(train_target, cfg)
    batch = make_batch([feature_cache[0]], 4, 4, np.random.default_rng(0))
    _, m = dspark_loss(drafter, batch, LossWeights(ce=1.0, l1=0.5, bce=0.0), bf16=False)
    assert m["loss"] == pytest.approx(1.0 * m["ce"] + 0.5 * m["l1"], rel=1e-5)
    for bad, field in [(dict(ce=-1.0), "ce"), (dict(l1=float("nan")), "l1"), (dict(decay=0.0), "decay"),
                       (dict(ce=0.0, l1=0.0), "both 0"), (dict(bce=True), "bce")]:
        with pytest.raises(ConfigError, match=f"LossWeights.*{field}"):
            LossWeights(**bad)


@pytest.mark.parametrize("markov_rank", [8, 0])
@pytest.mark.parametrize("chunk", [3, 64])
def test_fused_vocab_loss_equals_the_direct_form(train_target, feature_cache, markov_rank, chunk):
    """Values, metrics and every trainable tensor's gradient of the chunked loss equal the direct autograd form."""
    cfg = DrafterConfig.from_target(train_target.config, num_draft_layers=1, block_size=4, markov_rank=markov_rank,
                                    enable_confidence_head=markov_rank > 0,
                                    confidence_head_with_markov=markov_rank > 0)
    drafter = init_drafter(train_target, cfg, seed=5).train()
    with torch.no_grad():  # move off the init so every head contributes
        for p in drafter.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    batch = make_batch([feature_cache[i] for i in range(3)], 6, 4, np.random.default_rng(2))
    results = []
    for fused in (False, True):
        drafter.zero_grad(set_to_none=True)
        loss, metrics = dspark_loss(drafter, batch, bf16=False, fused=fused, chunk=chunk)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.requires_grad}
        results.append((loss.detach(), metrics, grads))
    (l0, m0, g0), (l1, m1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for key in ("ce", "l1", "bce", "tau_probabilistic") if markov_rank else ("ce", "l1", "tau_probabilistic"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-5)
    assert m1["top1"] == m0["top1"]
    assert g0.keys() == g1.keys() and len(g0) > 5
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-7, msg=name)
    assert drafter.lm_head.weight.grad is None  # the shared head stays frozen


def test_fused_vocab_loss_bf16_tracks_fp32(train_target, feature_cache):
    cfg = DrafterConfig.from_target(train_target.config, num_draft_layers=1, block_size=4, markov_rank=8)
    drafter = init_drafter(train_target, cfg, seed=5).train()
    batch = make_batch([feature_cache[i] for i in range(2)], 6, 4, np.random.default_rng(2))
    _, m32 = dspark_loss(drafter, batch, bf16=False)
    _, m16 = dspark_loss(drafter, batch, bf16=True)
    assert m16["ce"] == pytest.approx(m32["ce"], rel=2e-2) and m16["l1"] == pytest.approx(m32["l1"], abs=2e-2)


def test_fused_vocab_loss_bf16_gradients_track_fp32(train_target, feature_cache):
    cfg = DrafterConfig.from_target(train_target.config, num_draft_layers=1, block_size=4, markov_rank=8)
    drafter = init_drafter(train_target, cfg, seed=5).train()
    batch = make_batch([feature_cache[i] for i in range(2)], 6, 4, np.random.default_rng(2))
    grads = []
    for bf16 in (False, True):
        drafter.zero_grad(set_to_none=True)
        loss, _ = dspark_loss(drafter, batch, bf16=bf16)
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in drafter.parameters() if p.requires_grad]))
    cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert cos > 0.98 and (grads[1].norm() / grads[0].norm() - 1).abs() < 0.05


def test_fused_vocab_loss_refuses_a_bad_chunk():
    from dspark_export.training.objective import FusedVocabLoss

    W, h = torch.randn(50, 8), torch.randn(3, 8, requires_grad=True)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="chunk"):
            FusedVocabLoss.apply(h, W, torch.zeros(3, 0), torch.zeros(50, 0), h.detach(), torch.zeros(3, dtype=torch.long),
                                 bad, False)
