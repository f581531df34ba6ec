"""modeling/checkpoint.py: save/load round trips, a hand-written DeepSpec folder, and every error path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark_export.errors import CheckpointError, ConfigError
from dspark_export.modeling.checkpoint import load_drafter, read_drafter_config, save_drafter

from .deepspec_keys import expected_state_dict_shapes


@torch.no_grad()
def _block_outputs(drafter):
    aux = torch.randn(6, drafter.config.feature_size, generator=torch.Generator().manual_seed(0))
    kv = [(k.transpose(0, 1)[None], v.transpose(0, 1)[None]) for k, v in drafter.context_kv(aux, torch.arange(6))]
    return drafter.forward_block(torch.tensor([7]), torch.tensor([6]), kv, torch.tensor([6]))


def _assert_same_drafter(a, b):
    assert a.config == b.config
    state_b = b.state_dict()
    for name, tensor in a.state_dict().items():
        assert tensor.equal(state_b[name]), name
    for x, y in zip(_block_outputs(a), _block_outputs(b)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_round_trip(tmp_path, any_target, make_drafter):
    drafter = make_drafter(any_target)
    path = save_drafter(drafter, tmp_path / "drafter")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no staging folder left
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [drafter.config.architecture] and config["dtype"] == "float32"
    loaded = load_drafter(path, any_target)
    _assert_same_drafter(drafter, loaded)
    assert not loaded.training and loaded.config.is_trained is False
    assert not loaded.embed_tokens.weight.requires_grad and not loaded.lm_head.weight.requires_grad


def test_embeddings_come_from_the_target_when_absent(tmp_path, qwen3_target, make_drafter):
    drafter = make_drafter(qwen3_target)
    path = save_drafter(drafter, tmp_path / "drafter", include_embeddings=False)
    stored = load_file(path / "model.safetensors")
    assert "embed_tokens.weight" not in stored and "lm_head.weight" not in stored
    loaded = load_drafter(path, qwen3_target)
    assert loaded.embed_tokens.weight.equal(qwen3_target.model.get_input_embeddings().weight)
    assert loaded.lm_head.weight.equal(qwen3_target.model.get_output_embeddings().weight)
    _assert_same_drafter(drafter, loaded)


def test_bf16_checkpoint_is_upcast(tmp_path, llama_target, make_drafter):
    drafter = make_drafter(llama_target)
    path = save_drafter(drafter, tmp_path / "drafter", dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in load_file(path / "model.safetensors").values())
    loaded = load_drafter(path, llama_target)
    for name, tensor in drafter.state_dict().items():
        assert loaded.state_dict()[name].dtype == torch.float32
        assert loaded.state_dict()[name].equal(tensor.to(torch.bfloat16).float()), name


def test_save_replaces_a_drafter_but_not_other_folders(tmp_path, llama_target, make_drafter):
    first, second = make_drafter(llama_target, seed=1), make_drafter(llama_target, seed=2)
    save_drafter(first, tmp_path / "d")
    save_drafter(second, tmp_path / "d")
    _assert_same_drafter(second, load_drafter(tmp_path / "d", llama_target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("...")
    with pytest.raises(CheckpointError, match="not a drafter folder; refusing"):
        save_drafter(first, tmp_path / "precious")
    with pytest.raises(ConfigError, match="dtype"):
        save_drafter(first, tmp_path / "e", dtype=torch.int8)


def test_saved_drafter_folder_has_ordinary_permissions(tmp_path, llama_target, make_drafter):
    """Not mkdtemp's 0700: a drafter folder is shared like any folder the user creates (umask applies)."""
    import os

    mask = os.umask(0o022)
    try:
        path = save_drafter(make_drafter(llama_target, seed=1), tmp_path / "shared")
    finally:
        os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in path.iterdir())


# --------------------------------------------------------------------------- a hand-written DeepSpec folder


def _deepspec_config(**changes) -> dict:
    """config.json as DeepSpec build_draft_config writes it for a (tiny) Qwen3 target (reference §1.1)."""
    config = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "head_dim": 16,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
        "max_position_embeddings": 512, "max_window_layers": 28, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": None,
        "use_sliding_window": False, "vocab_size": 256, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2, "num_target_layers": 4,
        "block_size": 7, "mask_token_id": 250, "target_layer_ids": [0, 2], "num_anchors": 512,
        "enable_confidence_head": True, "confidence_head_with_markov": True, "markov_rank": 8,
        "markov_head_type": "vanilla", "transformers_version": "5.10.2",
    }
    config.update(changes)
    return config


def _deepspec_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 tensors under DeepSpec's names (reference §1.8), shapes from the key table."""
    from dspark_export.modeling.config import DrafterConfig

    generator = torch.Generator().manual_seed(seed)
    shapes = expected_state_dict_shapes(DrafterConfig.from_dict(config))
    return {name: (torch.randn(shape, generator=generator) * 0.1).to(torch.bfloat16) for name, shape in shapes.items()}


def _write_deepspec(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_load_hand_written_deepspec_folder(tmp_path, qwen3_target):
    config = _deepspec_config()
    tensors = _deepspec_tensors(config)
    drafter = load_drafter(_write_deepspec(tmp_path / "ds", config, tensors), qwen3_target)
    c = drafter.config
    assert (c.num_hidden_layers, c.block_size, c.target_layer_ids, c.mask_token_id) == (2, 7, (0, 2), 250)
    assert c.rope_parameters == {"rope_theta": 10000.0, "rope_type": "default"} and c.is_trained
    state = drafter.state_dict()
    assert set(state) == set(tensors)
    for name, tensor in tensors.items():
        assert state[name].dtype == torch.float32 and state[name].equal(tensor.float()), name
    hidden, logits = _block_outputs(drafter)
    assert hidden.shape == (1, 7, 64) and logits.shape == (1, 7, 256) and torch.isfinite(logits).all()


def test_load_sharded_deepspec_folder(tmp_path, qwen3_target):
    config = _deepspec_config(rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    del config["rope_theta"]
    tensors = _deepspec_tensors(config)
    folder = tmp_path / "sharded"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, folder / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: s for s, ns in shards.items() for n in ns}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    drafter = load_drafter(folder, qwen3_target)
    for name, tensor in tensors.items():
        assert drafter.state_dict()[name].equal(tensor.float()), name

    index["weight_map"][names[0]] = "../outside.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="must be a file name"):
        load_drafter(folder, qwen3_target)
    index["weight_map"][names[0]] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"index lists \['{names[0]}'\] in this shard"):
        load_drafter(folder, qwen3_target)


# --------------------------------------------------------------------------- errors


def _deepspec_with(tmp_path, config=None, edit=None) -> Path:
    config = config or _deepspec_config()
    tensors = _deepspec_tensors(config)
    if edit:
        edit(tensors)
    return _write_deepspec(tmp_path / "bad", config, tensors)


def test_tensor_shape_mismatch(tmp_path, qwen3_target):
    def edit(t):
        t["layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64, dtype=torch.bfloat16)

    with pytest.raises(CheckpointError, match=r"tensor layers.1.mlp.up_proj.weight: expected shape \[128, 64\], "
                                              r"found \[100, 64\]"):
        load_drafter(_deepspec_with(tmp_path, edit=edit), qwen3_target)


def test_missing_and_unexpected_tensors(tmp_path, qwen3_target):
    def edit(t):
        del t["layers.0.self_attn.k_norm.weight"]
        t["markov_head.gate_proj.weight"] = torch.zeros(8, 72, dtype=torch.bfloat16)

    with pytest.raises(CheckpointError, match=r"missing \['layers.0.self_attn.k_norm.weight'\], "
                                              r"unexpected \['markov_head.gate_proj.weight'\]"):
        load_drafter(_deepspec_with(tmp_path, edit=edit), qwen3_target)


def test_non_float_dtype(tmp_path, qwen3_target):
    def edit(t):
        t["norm.weight"] = torch.ones(64, dtype=torch.int32)

    with pytest.raises(CheckpointError, match=r"tensor norm.weight: expected dtype float32, bfloat16 or float16, "
                                              r"found torch.int32"):
        load_drafter(_deepspec_with(tmp_path, edit=edit), qwen3_target)


@pytest.mark.parametrize("changes, match", [
    ({"hidden_size": 32, "intermediate_size": 64, "head_dim": 8},
     "hidden_size is 32 but the target's is 64"),
    ({"vocab_size": 300}, "vocab_size is 300 but the target's is 256"),
    ({"num_target_layers": 8, "target_layer_ids": [0, 3]},
     r"target_layer_ids \[0, 3\] includes the last target layer for a target with 4 layers"),
    ({"num_target_layers": 8, "target_layer_ids": [1, 6]}, r"\[1, 6\] is out of range"),
    ({"num_target_layers": 36}, "num_target_layers is 36 but the target's is 4"),
])
def test_config_does_not_fit_the_target(tmp_path, qwen3_target, changes, match):
    with pytest.raises(ConfigError, match=match):
        load_drafter(_deepspec_with(tmp_path, _deepspec_config(**changes)), qwen3_target)


def test_model_type_mismatch(tmp_path, llama_target):
    with pytest.raises(ConfigError, match="model_type is 'qwen3' but the target's is 'llama'"):
        load_drafter(_deepspec_with(tmp_path), llama_target)


def test_bad_config_files(tmp_path, qwen3_target):
    with pytest.raises(CheckpointError, match="config.json: not found"):
        load_drafter(tmp_path, qwen3_target)
    (tmp_path / "config.json").write_text("[1, 2")
    with pytest.raises(CheckpointError, match="expected JSON"):
        read_drafter_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_deepspec_config(architectures=["Qwen3Eagle3Model"])))
    with pytest.raises(ConfigError, match=r"'Qwen3Eagle3Model'\] is not a DSpark drafter.*LlamaDSparkModel"):
        read_drafter_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_deepspec_config(architectures=["LlamaDSparkModel"])))
    with pytest.raises(ConfigError, match="LlamaDSparkModel expects model_type 'llama', found 'qwen3'"):
        read_drafter_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_deepspec_config(markov_head_type="rnn")))
    with pytest.raises(ConfigError, match="'rnn' head is not implemented"):
        read_drafter_config(tmp_path)


def test_weights_files(tmp_path, qwen3_target):
    (tmp_path / "config.json").write_text(json.dumps(_deepspec_config()))
    with pytest.raises(CheckpointError, match="expected model.safetensors or model.safetensors.index.json, found neither"):
        load_drafter(tmp_path, qwen3_target)
    (tmp_path / "training_state.rank0.pt").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match=r"only pickle files \['training_state.rank0.pt'\]"):
        load_drafter(tmp_path, qwen3_target)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        load_drafter(tmp_path, qwen3_target)


# --------------------------------------------------------------------------- DeepSpec's own save path

#: fields DeepSpec's Qwen3DSparkModel.__init__ asserts on the loaded config (reference §1.1; afdfa7c), and the
#: ones it then needs when markov_rank > 0 / the confidence head is on
DEEPSPEC_REQUIRED = ("target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head", "markov_rank",
                     "markov_head_type", "confidence_head_with_markov")


def _deepspec_saved(folder: Path, qwen3_target, target_layer_ids=(-1, 2)) -> Path:
    """A drafter folder as DeepSpec writes it: the tiny Qwen3 target's transformers config, deep-copied and given
    the DSpark fields the way build_draft_config sets them (reference §1.1), saved by transformers' own
    save_pretrained (so the file holds every key that path writes), plus bf16 tensors under DeepSpec's names."""
    import copy

    cfg = copy.deepcopy(qwen3_target.config)
    cfg.architectures = ["Qwen3DSparkModel"]
    cfg.num_target_layers = cfg.num_hidden_layers
    cfg.num_hidden_layers = 2
    cfg.layer_types = ["full_attention"] * 2
    cfg.block_size, cfg.tie_word_embeddings, cfg.mask_token_id = 7, False, 250
    cfg.target_layer_ids, cfg.num_anchors = list(target_layer_ids), 512
    cfg.enable_confidence_head, cfg.confidence_head_with_markov = True, True
    cfg.markov_rank, cfg.markov_head_type = 8, "vanilla"
    cfg.dtype = torch.bfloat16
    cfg.save_pretrained(folder)
    data = json.loads((folder / "config.json").read_text())
    save_file(_deepspec_tensors(data), folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_deepspec_config_round_trip_keeps_every_key(tmp_path, qwen3_target):
    """Every key DeepSpec's save path writes survives load + save unchanged (num_anchors, bos/eos/pad ids,
    sliding-window keys, attention_dropout, initializer_range, use_cache, transformers_version, ...); our own
    key sits under `dspark_export`; transformers reads the result back as DeepSpec's loader does, with every
    field DeepSpec's model asserts; tap -1 (the embedding output) is kept."""
    from transformers import AutoConfig

    src = _deepspec_saved(tmp_path / "ds", qwen3_target)
    written = json.loads((src / "config.json").read_text())
    for key in ("num_anchors", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout",
                "initializer_range", "use_cache", "transformers_version", "sliding_window", "use_sliding_window",
                "max_window_layers"):
        assert key in written, key     # the fixture really holds what the issue lists
    drafter = load_drafter(src, qwen3_target)
    assert drafter.config.target_layer_ids == (-1, 2) and drafter.config.is_trained
    out = save_drafter(drafter, tmp_path / "ours", dtype=torch.bfloat16)
    ours = json.loads((out / "config.json").read_text())
    changed = {k: (written[k], ours.get(k)) for k in written if ours.get(k, "<missing>") != written[k]}
    assert changed == {} and set(ours) - set(written) == {"dspark_export"}
    assert ours["dspark_export"] == {"is_trained": True}
    back = AutoConfig.from_pretrained(out)
    assert type(back).__name__ == "Qwen3Config"
    for field in DEEPSPEC_REQUIRED:
        assert getattr(back, field) == written[field], field
    again = load_drafter(out, qwen3_target)
    assert again.config == drafter.config and again.config.extra == drafter.config.extra


def test_fresh_drafter_config_carries_what_deepspec_needs(tmp_path, qwen3_target, make_drafter):
    """A drafter this project makes is written as build_draft_config would (the target's keys copied, the DSpark
    fields, num_anchors) and loads in transformers with every field DeepSpec's model asserts."""
    from transformers import AutoConfig

    out = save_drafter(make_drafter(qwen3_target), tmp_path / "fresh")
    data = json.loads((out / "config.json").read_text())
    target = qwen3_target.config.to_dict()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout", "initializer_range",
                "use_cache", "transformers_version"):
        assert data[key] == target[key], key
    back = AutoConfig.from_pretrained(out)
    for field in DEEPSPEC_REQUIRED:
        assert hasattr(back, field), field
    assert back.num_anchors == 512 and back.dspark_export == {"is_trained": False}
