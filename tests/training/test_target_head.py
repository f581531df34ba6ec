"""Training against the head the engines verify with (`TrainConfig.target_head`, `dspark_loss(target_head=)`): the
dequantized heads match the exporter's formats, the shared head changes nothing, and the fused loss still equals
the direct form when the target's head differs from the drafter's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_export.errors import ConfigError
from dspark_export.exporter.quantize import WeightFormat, dequantize_blocks, quantize_blocks, quantize_rows_int8
from dspark_export.training.objective import dspark_loss, make_batch, response_targets
from dspark_export.training.trainer import TrainConfig, target_head_weight, train_drafter

from .test_draft_vocab_loss import _drafter, _loss_and_grads


def test_target_heads_are_the_exporters_formats_dequantized():
    W = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    assert target_head_weight(W, "fp32") is W
    for name in ("int4", "int8"):
        f = WeightFormat(name)
        want = dequantize_blocks(*quantize_blocks(W.numpy().T, f), f, 64).T
        np.testing.assert_array_equal(target_head_weight(W, name).numpy(), want)
    w_q, scale = quantize_rows_int8(W.numpy())
    np.testing.assert_array_equal(target_head_weight(W, "w8a8").numpy(), w_q.T.astype(np.float32) * scale[:, None])
    assert 0 < float((target_head_weight(W, "int4") - W).abs().max()) < 0.05
    with pytest.raises(ConfigError, match="target head: expected one of"):
        target_head_weight(W, "nf4")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("d2t", [None, 40])
def test_the_shared_head_as_target_head_changes_nothing(train_target, feature_cache, fused, d2t):
    drafter = _drafter(train_target)
    batch = make_batch([feature_cache[i] for i in range(3)], 6, 4, np.random.default_rng(2))
    kw = {"fused": fused, "d2t": None if d2t is None else torch.arange(d2t)}
    l0, m0, g0 = _loss_and_grads(drafter, batch, **kw)
    l1, m1, g1 = _loss_and_grads(drafter, batch, target_head=drafter.lm_head.weight.clone(), **kw)
    assert l1 == l0 and m1 == m0
    for name in g0:
        assert torch.equal(g1[name], g0[name]), name


def test_fused_loss_with_another_target_head_equals_the_direct_form(train_target, feature_cache):
    drafter = _drafter(train_target)
    head = target_head_weight(drafter.lm_head.weight.detach(), "int4")
    seqs = [feature_cache[i] for i in range(3)]
    for s in seqs:
        s.t_lse, s.t_argmax = response_targets(s, head)
    batch = make_batch(seqs, 6, 4, np.random.default_rng(2), ce_labels="argmax")
    d2t = torch.tensor(sorted(set(torch.unique(batch.ce_labels).tolist()[::2]) | set(range(40))))
    l0, m0, g0 = _loss_and_grads(drafter, batch, fused=True, chunk=7, d2t=d2t, target_head=head)
    batch.t_lse = None   # the direct form normalises q over the head itself; the fused one with t_lse
    l1, m1, g1 = _loss_and_grads(drafter, batch, fused=False, d2t=d2t, target_head=head)
    torch.testing.assert_close(l0, l1, rtol=1e-5, atol=1e-6)
    for name in g0:
        torch.testing.assert_close(g0[name], g1[name], rtol=1e-4, atol=1e-7, msg=name)
    _, m_float, _ = _loss_and_grads(drafter, make_batch(seqs, 6, 4, np.random.default_rng(2)), d2t=d2t)
    assert m0["l1"] != pytest.approx(m_float["l1"], rel=1e-6)   # the head moved the target's distribution


def test_train_config_checks_the_target_head_and_resumes_only_under_it(train_target, feature_cache, tmp_path):
    with pytest.raises(ConfigError, match="TrainConfig.target_head"):
        TrainConfig(out_dir=str(tmp_path), target_head="int3")

    def cfg(steps, head):
        return TrainConfig(out_dir=str(tmp_path), steps=steps, seqs_per_step=2, anchors_per_seq=4, block_size=4,
                           num_draft_layers=1, markov_rank=8, save_every=1, log_every=1, lr=1e-3, draft_vocab=64,
                           target_head=head)
    d2t = torch.arange(64)
    train_drafter(train_target, feature_cache, cfg(2, "int4"), d2t=d2t)
    with pytest.raises(ConfigError, match="target_head"):
        train_drafter(train_target, feature_cache, cfg(3, "fp32"), d2t=d2t)
    train_drafter(train_target, feature_cache, cfg(3, "int4"), d2t=d2t)
    assert torch.load(tmp_path / "training_state.pt", weights_only=True)["step"] == 3
