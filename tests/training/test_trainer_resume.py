"""Resumable training with small checkpoints, τ per checkpoint, and training over the draft vocabulary."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from dspark_export.errors import ConfigError
from dspark_export.training.trainer import TrainConfig, train_drafter


def _cfg(tmp_path, steps, **kw):
    return TrainConfig(out_dir=str(tmp_path), steps=steps, seqs_per_step=2, anchors_per_seq=4, block_size=4,
                       markov_rank=8, lr=3e-3, bf16=False, save_every=2, log_every=1, **kw)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


D2T = np.arange(3, 3 + 96)  # a draft vocabulary of 96 of the 256 ids (the toy responses use ids 3..255)


@pytest.mark.parametrize("draft_vocab", [None, len(D2T)])
def test_resume_continues_the_loss_curve_the_steps_and_the_tau_log(train_target, feature_cache, tmp_path,
                                                                   draft_vocab):
    d2t = None if draft_vocab is None else D2T
    kw = dict(d2t=d2t, eval_cache=feature_cache, eval_stride=3, eval_limit=4)
    full = train_drafter(train_target, feature_cache, _cfg(tmp_path / "full", 6, draft_vocab=draft_vocab), **kw)
    train_drafter(train_target, feature_cache, _cfg(tmp_path / "split", 6, draft_vocab=draft_vocab), stop_at=3, **kw)
    assert [r["step"] for r in _rows(tmp_path / "split" / "checkpoints.jsonl")] == [2, 3]
    resumed = train_drafter(train_target, feature_cache, _cfg(tmp_path / "split", 6, draft_vocab=draft_vocab), **kw)
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    m_full, m_split = _rows(tmp_path / "full" / "metrics.jsonl"), _rows(tmp_path / "split" / "metrics.jsonl")
    assert [r["step"] for r in m_split] == [1, 2, 3, 4, 5, 6]  # the step count continues
    assert [r["loss"] for r in m_split] == pytest.approx([r["loss"] for r in m_full], rel=1e-5)  # and the curve
    train_s = [r["train_s"] for r in m_split]
    assert train_s == sorted(train_s) and train_s[3] >= train_s[2]  # wall time adds up over calls
    if draft_vocab:
        assert 0 < m_split[-1]["bucket_mass"] < 1 and "bucket_labels" in m_split[-1]
    c_full, c_split = _rows(tmp_path / "full" / "checkpoints.jsonl"), _rows(tmp_path / "split" / "checkpoints.jsonl")
    assert [r["step"] for r in c_full] == [2, 4, 6] and [r["step"] for r in c_split] == [2, 3, 4, 6]
    by_step = {r["step"]: r for r in c_split}
    for r in c_full:
        assert 1 <= r["tau"] <= 5 and r["rounds"] > 0 and len(r["conditional_acceptance"]) == 4
        assert by_step[r["step"]]["tau"] == pytest.approx(r["tau"], abs=1e-6)
    # calling again after the end neither trains nor logs a second τ for the last checkpoint
    train_drafter(train_target, feature_cache, _cfg(tmp_path / "split", 6, draft_vocab=draft_vocab), **kw)
    assert [r["step"] for r in _rows(tmp_path / "split" / "checkpoints.jsonl")] == [2, 3, 4, 6]


def test_checkpoints_leave_out_the_frozen_shared_tensors(train_target, feature_cache, tmp_path):
    train_drafter(train_target, feature_cache, _cfg(tmp_path, 2))
    state = torch.load(tmp_path / "training_state.pt", weights_only=True)
    assert "lm_head.weight" not in state["drafter"] and "embed_tokens.weight" not in state["drafter"]
    assert "fc.weight" in state["drafter"] and state["d2t"] is None


def test_a_state_with_the_shared_tensors_still_resumes(train_target, feature_cache, tmp_path):
    """States written before checkpoints were made small (full state_dict) resume as before."""
    train_drafter(train_target, feature_cache, _cfg(tmp_path / "a", 4), stop_at=2)
    path = tmp_path / "a" / "training_state.pt"
    state = torch.load(path, weights_only=True)
    lm = train_target.model.get_output_embeddings().weight.detach().clone()
    emb = train_target.model.get_input_embeddings().weight.detach().clone()
    state["drafter"].update({"lm_head.weight": lm, "embed_tokens.weight": emb})
    state["config"].pop("draft_vocab")
    del state["d2t"]
    torch.save(state, path)
    train_drafter(train_target, feature_cache, _cfg(tmp_path / "a", 4))
    assert torch.load(path, weights_only=True)["step"] == 4


def test_draft_vocabulary_mismatches_are_refused(train_target, feature_cache, tmp_path):
    with pytest.raises(ConfigError, match="draft_vocab"):
        train_drafter(train_target, feature_cache, _cfg(tmp_path, 2, draft_vocab=96))  # no d2t given
    with pytest.raises(ConfigError, match="draft_vocab"):
        train_drafter(train_target, feature_cache, _cfg(tmp_path, 2, draft_vocab=10), d2t=D2T)
    with pytest.raises(ConfigError, match="distinct"):
        train_drafter(train_target, feature_cache, _cfg(tmp_path, 2, draft_vocab=3), d2t=np.array([4, 4, 5]))
    with pytest.raises(ConfigError, match="draft_vocab"):
        TrainConfig(out_dir=str(tmp_path), draft_vocab=0)
    train_drafter(train_target, feature_cache, _cfg(tmp_path / "run", 2, draft_vocab=96), d2t=D2T)
    with pytest.raises(ConfigError, match="another draft vocabulary"):
        train_drafter(train_target, feature_cache, _cfg(tmp_path / "run", 4, draft_vocab=96), d2t=D2T + 1)


def test_an_evaluation_cache_without_greedy_records_is_refused_before_training(train_target, records, tmp_path):
    import copy

    from dspark_export.modeling.config import default_target_layer_ids
    from dspark_export.training.features import FeatureCache, build_feature_cache

    sampled = [{**r, "temperature": 1.0} for r in records[:3]]
    ids = default_target_layer_ids(train_target.config.num_hidden_layers)
    build_feature_cache(copy.deepcopy(train_target.model), sampled, ids, tmp_path / "f", dtype=torch.float32)
    with pytest.raises(ConfigError, match="greedy"):
        train_drafter(train_target, FeatureCache(tmp_path / "f"), _cfg(tmp_path / "run", 2),
                      eval_cache=FeatureCache(tmp_path / "f"))
    assert not (tmp_path / "run" / "training_state.pt").exists()


def test_feature_cache_grows_with_appended_records(train_target, records, tmp_path):
    """Records appended after a cache was built (more data): full parts are kept, the short last part is rebuilt."""
    import copy

    from dspark_export.modeling.config import default_target_layer_ids
    from dspark_export.training.features import FeatureCache, build_feature_cache

    ids = default_target_layer_ids(train_target.config.num_hidden_layers)
    model = copy.deepcopy(train_target.model)
    build_feature_cache(model, records[:5], ids, tmp_path, part_size=4, dtype=torch.float32)
    stamp = (tmp_path / "part-00000" / "aux.npy").stat().st_mtime_ns
    assert len(FeatureCache(tmp_path)) == 5
    build_feature_cache(model, records[:10], ids, tmp_path, part_size=4, dtype=torch.float32)
    cache = FeatureCache(tmp_path)
    assert len(cache) == 10 and (tmp_path / "part-00000" / "aux.npy").stat().st_mtime_ns == stamp
    for i in (4, 5, 9):
        assert cache[i].tokens.tolist() == records[i]["prompt_ids"] + records[i]["response_ids"]
    stamps = {q.name: q.stat().st_mtime_ns for q in tmp_path.glob("part-*/aux.npy")}
    with pytest.raises(ConfigError, match="holds 10 records but this run gives 6"):  # a cache never shrinks
        build_feature_cache(model, records[:6], ids, tmp_path, part_size=4, dtype=torch.float32)
    assert len(FeatureCache(tmp_path)) == 10
    assert {q.name: q.stat().st_mtime_ns for q in tmp_path.glob("part-*/aux.npy")} == stamps


def test_warm_start_begins_from_the_checkpoint_and_resumes_as_its_own_run(train_target, feature_cache, tmp_path):
    from dspark_export.modeling.checkpoint import save_drafter

    base = train_drafter(train_target, feature_cache, _cfg(tmp_path / "base", 4))
    save_drafter(base, tmp_path / "base-drafter", dtype=torch.float16)  # as shipped: fp16 on disk
    cfg = dict(init_from=str(tmp_path / "base-drafter"))
    # block size may change: the block runs γ rows of the same weights
    ev = dict(eval_cache=feature_cache, eval_stride=3, eval_limit=4)
    start = train_drafter(train_target, feature_cache, dataclasses.replace(
        _cfg(tmp_path / "warm", 4, **cfg), block_size=3), time_budget_s=0, **ev)
    for name, tensor in base.state_dict().items():
        torch.testing.assert_close(start.state_dict()[name], tensor, atol=1e-3, rtol=1e-3, msg=name)
    cold = train_drafter(train_target, feature_cache, _cfg(tmp_path / "cold", 4), time_budget_s=0)
    assert not torch.allclose(cold.state_dict()["fc.weight"], base.state_dict()["fc.weight"])
    # the warm run resumes from its own state (the checkpoint is read once), and only with the same origin
    train_drafter(train_target, feature_cache, dataclasses.replace(_cfg(tmp_path / "warm", 4, **cfg), block_size=3), **ev)
    assert torch.load(tmp_path / "warm" / "training_state.pt", weights_only=True)["step"] == 4
    rows = _rows(tmp_path / "warm" / "checkpoints.jsonl")  # the starting point's τ is step 0
    assert [r["step"] for r in rows] == [0, 2, 4] and all(1 <= r["tau"] <= 4 for r in rows)
    with pytest.raises(ConfigError, match="init_from"):
        train_drafter(train_target, feature_cache, dataclasses.replace(_cfg(tmp_path / "warm", 5), block_size=3))


def test_a_warm_start_cut_off_before_its_first_step_still_logs_step_0(train_target, feature_cache, tmp_path):
    from dspark_export.modeling.checkpoint import save_drafter

    save_drafter(train_drafter(train_target, feature_cache, _cfg(tmp_path / "base", 2)), tmp_path / "base-drafter")
    cfg = _cfg(tmp_path / "warm", 2, init_from=str(tmp_path / "base-drafter"))
    train_drafter(train_target, feature_cache, cfg, time_budget_s=0)  # state at step 0, no τ logged (no cache)
    ev = dict(eval_cache=feature_cache, eval_stride=3, eval_limit=4)
    train_drafter(train_target, feature_cache, cfg, **ev)
    assert [r["step"] for r in _rows(tmp_path / "warm" / "checkpoints.jsonl")] == [0, 2]


def test_warm_start_from_another_architecture_is_refused_by_name(train_target, feature_cache, tmp_path):
    from dspark_export.modeling.checkpoint import save_drafter

    base = train_drafter(train_target, feature_cache, _cfg(tmp_path / "base", 2))
    save_drafter(base, tmp_path / "base-drafter")
    with pytest.raises(ConfigError, match=r"markov_rank \(checkpoint 8, run 4\)"):
        train_drafter(train_target, feature_cache, dataclasses.replace(
            _cfg(tmp_path / "warm", 2, init_from=str(tmp_path / "base-drafter")), markov_rank=4))
    assert not (tmp_path / "warm" / "training_state.pt").exists()


def test_a_warm_start_may_grow_the_stack_and_drafts_as_its_checkpoint_at_step_0(train_target, feature_cache,
                                                                                tmp_path):
    from dspark_export.modeling.checkpoint import save_drafter

    base = train_drafter(train_target, feature_cache, _cfg(tmp_path / "base", 2))  # one layer
    save_drafter(base, tmp_path / "base-drafter")
    grown = train_drafter(train_target, feature_cache, dataclasses.replace(
        _cfg(tmp_path / "grown", 2, init_from=str(tmp_path / "base-drafter")), num_draft_layers=3), time_budget_s=0)
    assert grown.config.num_hidden_layers == 3
    sd = grown.state_dict()
    for layer in (1, 2):  # the new layers: a copy of the last one, residual outputs zeroed
        assert not sd[f"layers.{layer}.self_attn.o_proj.weight"].any() and not sd[f"layers.{layer}.mlp.down_proj.weight"].any()
        torch.testing.assert_close(sd[f"layers.{layer}.self_attn.q_proj.weight"], base.state_dict()["layers.0.self_attn.q_proj.weight"])
    torch.manual_seed(0)
    T, R = 12, 2
    aux = torch.randn(T, base.config.feature_size)
    with torch.no_grad():
        outs = []
        for model in (base.eval(), grown.eval()):
            kv = [(k.reshape(1, *k.shape).transpose(1, 2).expand(R, -1, -1, -1),
                   v.reshape(1, *v.shape).transpose(1, 2).expand(R, -1, -1, -1))
                  for k, v in model.context_kv(aux, torch.arange(T))]
            outs.append(model.forward_block(torch.tensor([5, 9]), torch.tensor([T, 7]), kv, torch.tensor([T, 7])))
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    # ... and training moves the new layers off zero
    trained = train_drafter(train_target, feature_cache, dataclasses.replace(
        _cfg(tmp_path / "grown", 2, init_from=str(tmp_path / "base-drafter")), num_draft_layers=3))
    assert trained.state_dict()["layers.2.mlp.down_proj.weight"].abs().sum() > 0


def test_a_warm_start_never_drops_layers(train_target, feature_cache, tmp_path):
    from dspark_export.modeling.checkpoint import save_drafter

    base = train_drafter(train_target, feature_cache, dataclasses.replace(_cfg(tmp_path / "base", 2), num_draft_layers=2))
    save_drafter(base, tmp_path / "base-drafter")
    with pytest.raises(ConfigError, match=r"num_hidden_layers \(checkpoint 2, run 1\); a warm start may add layers"):
        train_drafter(train_target, feature_cache, _cfg(tmp_path / "warm", 2, init_from=str(tmp_path / "base-drafter")))
