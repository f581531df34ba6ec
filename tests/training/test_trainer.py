"""Feature cache and training loop: resumable, seeded, metrics logged."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from dspark_export.errors import ConfigError
from dspark_export.modeling.config import default_target_layer_ids
from dspark_export.training.features import FeatureCache, build_feature_cache
from dspark_export.training.trainer import TrainConfig, lr_path_from_metrics, train_drafter


def test_feature_cache_matches_the_target(train_target, records, feature_cache):
    assert len(feature_cache) == len(records)
    s = feature_cache[3]
    rec = records[3]
    assert s.tokens.tolist() == rec["prompt_ids"] + rec["response_ids"] and s.prompt_len == len(rec["prompt_ids"])
    with torch.no_grad():
        out = train_target.model(input_ids=torch.from_numpy(s.tokens)[None], output_hidden_states=True)
    ids = feature_cache.target_layer_ids
    aux = torch.cat([out.hidden_states[l + 1][0] for l in ids], -1).numpy()
    np.testing.assert_allclose(s.aux, aux, atol=2e-3, rtol=2e-3)  # float16 storage
    logits = train_target.model.get_output_embeddings()(torch.from_numpy(s.last)).detach().numpy()
    np.testing.assert_allclose(logits, out.logits[0].numpy(), atol=2e-2, rtol=1e-2)


def test_feature_cache_resumes_and_rejects_other_taps(train_target, records, tmp_path):
    ids = default_target_layer_ids(train_target.config.num_hidden_layers)
    model = copy.deepcopy(train_target.model)
    build_feature_cache(model, records[:4], ids, tmp_path, part_size=2, dtype=torch.float32)
    stamp = (tmp_path / "part-00000" / "aux.npy").stat().st_mtime_ns
    build_feature_cache(model, records[:6], ids, tmp_path, part_size=2, dtype=torch.float32)
    assert (tmp_path / "part-00000" / "aux.npy").stat().st_mtime_ns == stamp  # kept, not recomputed
    cache = FeatureCache(tmp_path)
    assert len(cache) == 6
    # lengths from the index, across parts, equal the arrays' (the trainer sizes its draws from them)
    assert [cache.length(i) for i in range(6)] == [len(r["prompt_ids"]) + len(r["response_ids"]) for r in records[:6]]
    assert [cache.prompt_len(i) for i in range(6)] == [cache[i].prompt_len for i in range(6)]
    with pytest.raises(ConfigError, match="target_layer_ids"):
        build_feature_cache(model, records[:2], ids[:1], tmp_path, part_size=2, dtype=torch.float32)


def test_incomplete_cache_is_refused(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"format": 1, "complete": False, "parts": []}))
    with pytest.raises(ConfigError, match="complete"):
        FeatureCache(tmp_path)


def _cfg(tmp_path, steps, **kw):
    return TrainConfig(out_dir=str(tmp_path), steps=steps, seqs_per_step=2, anchors_per_seq=4, block_size=4,
                       markov_rank=8, lr=3e-3, bf16=False, save_every=2, log_every=1, **kw)


def test_training_is_seeded_and_resumes_exactly(train_target, feature_cache, tmp_path):
    full = train_drafter(train_target, feature_cache, _cfg(tmp_path / "full", 6))
    train_drafter(train_target, feature_cache, _cfg(tmp_path / "split", 6), stop_at=3)  # "interrupted" at 3
    resumed = train_drafter(train_target, feature_cache, _cfg(tmp_path / "split", 6))
    assert full.config.is_trained
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    rows = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert len(rows[-1]["accept_rate"]) == 4 and "tau_probabilistic" in rows[-1]


def test_ctrl_c_saves_the_last_completed_step_and_resumes_exactly(train_target, feature_cache, tmp_path):
    """Ctrl-C between save points keeps the steps done since the last save (save_every=2, stopped at 3)."""
    full = train_drafter(train_target, feature_cache, _cfg(tmp_path / "full", 6))

    def interrupt_at_3(line):
        if line.startswith("step 3/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_drafter(train_target, feature_cache, _cfg(tmp_path / "split", 6), progress=interrupt_at_3)
    assert torch.load(tmp_path / "split" / "training_state.pt", weights_only=True)["step"] == 3
    resumed = train_drafter(train_target, feature_cache, _cfg(tmp_path / "split", 6))
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_ctrl_c_inside_a_step_redoes_that_step_on_resume(train_target, feature_cache, tmp_path, monkeypatch):
    """Ctrl-C during a step's forward pass (after its batch was drawn): the resumed run draws the same batch."""
    import dspark_export.training.trainer as trainer_module

    full = train_drafter(train_target, feature_cache, _cfg(tmp_path / "full", 6))
    real_loss, calls = trainer_module.dspark_loss, []

    def loss_interrupted_on_4th_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "dspark_loss", loss_interrupted_on_4th_call)
    with pytest.raises(KeyboardInterrupt):
        train_drafter(train_target, feature_cache, _cfg(tmp_path / "split", 6))
    monkeypatch.setattr(trainer_module, "dspark_loss", real_loss)
    assert torch.load(tmp_path / "split" / "training_state.pt", weights_only=True)["step"] == 3
    resumed = train_drafter(train_target, feature_cache, _cfg(tmp_path / "split", 6))
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_resume_with_another_config_is_refused(train_target, feature_cache, tmp_path):
    train_drafter(train_target, feature_cache, _cfg(tmp_path, 2))
    with pytest.raises(ConfigError, match="markov_rank"):
        train_drafter(train_target, feature_cache, _cfg(tmp_path, 4).__class__(
            **{**_cfg(tmp_path, 4).__dict__, "markov_rank": 4}))


def test_dflash_variant_has_no_heads(train_target, feature_cache, tmp_path):
    d = train_drafter(train_target, feature_cache, _cfg(tmp_path, 2, variant="dflash"))
    assert d.markov_head is None and d.confidence_head is None


def test_lr_path_from_another_run_is_followed_step_by_step(train_target, feature_cache, tmp_path):
    """An ablation at an equal budget: the run takes, at every step, the lr the reference run logged for it
    (interpolated between logged steps), not its own warmup + cosine."""
    ref = tmp_path / "ref.jsonl"
    ref.write_text("\n".join(json.dumps({"step": s, "lr": lr}) for s, lr in [(2, 1e-3), (4, 3e-3), (6, 0.0)]) + "\n")
    schedule = lr_path_from_metrics(ref)
    assert [round(schedule(i), 7) for i in range(6)] == [1e-3, 1e-3, 2e-3, 3e-3, 1.5e-3, 0.0]
    train_drafter(train_target, feature_cache, _cfg(tmp_path / "run", 6), lr_schedule=schedule)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == [1e-3, 1e-3, 2e-3, 3e-3, 1.5e-3, 0.0]
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "lr": 0.1}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: expected a JSON object with numeric 'step' and 'lr'"):
        lr_path_from_metrics(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="no metrics rows"):
        lr_path_from_metrics(tmp_path / "empty.jsonl")
    with pytest.raises(ConfigError, match="cannot read"):
        lr_path_from_metrics(tmp_path / "missing.jsonl")


def _picked_rows(monkeypatch, *args, **kwargs) -> list[int]:
    """Train, recording the source row of every sequence the steps drew."""
    from dspark_export.training import trainer
    from dspark_export.training.objective import make_batch

    rows = []

    def recording(seqs, *a, **kw):
        rows.extend(int(s.source["row"]) for s in seqs)
        return make_batch(seqs, *a, **kw)

    monkeypatch.setattr(trainer, "make_batch", recording)
    train_drafter(*args, **kwargs)
    return rows


def test_domain_weights_draw_records_by_their_domain(train_target, feature_cache, tmp_path, monkeypatch):
    domains = ["code" if i < 3 else "chat" for i in range(len(feature_cache))]   # rows 0-2 code, 3-9 chat
    uniform = _picked_rows(monkeypatch, train_target, feature_cache, _cfg(tmp_path / "uniform", 30))
    heavy = _picked_rows(monkeypatch, train_target, feature_cache,
                         _cfg(tmp_path / "code", 30, domain_weights={"code": 1e6}), domains=domains)
    # two sequences a step without replacement: with code 10^6 times as likely, each step draws two of the three code
    # rows (a chat row only with odds ~1e-5); uniform draws 3/10 code rows
    assert all(r < 3 for r in heavy) and len(heavy) == 60
    assert 0.1 < np.mean([r < 3 for r in uniform]) < 0.5


def test_domain_weights_need_every_records_domain(train_target, feature_cache, tmp_path):
    cfg = _cfg(tmp_path, 2, domain_weights={"code": 2.0})
    with pytest.raises(ConfigError, match="one domain per record"):
        train_drafter(train_target, feature_cache, cfg)
    with pytest.raises(ConfigError, match=r"no record has domain \['code'\]"):
        train_drafter(train_target, feature_cache, cfg, domains=["chat"] * len(feature_cache))
    for bad in ({}, {"code": 0.0}, {"code": float("inf")}, {"code": float("nan")}, {"code": 1e308}, {"code": 1e-320},
                {"code": True}, [("code", 2.0)]):
        with pytest.raises(ConfigError, match="domain_weights"):
            _cfg(tmp_path, 2, domain_weights=bad)


def test_a_run_resumes_only_with_its_own_domain_weights(train_target, feature_cache, tmp_path):
    domains = ["code" if i < 3 else "chat" for i in range(len(feature_cache))]
    train_drafter(train_target, feature_cache, _cfg(tmp_path, 4, domain_weights={"code": 2.0}), domains=domains,
                  stop_at=2)
    with pytest.raises(ConfigError, match="domain_weights"):
        train_drafter(train_target, feature_cache, _cfg(tmp_path, 4, domain_weights={"code": 3.0}), domains=domains)
