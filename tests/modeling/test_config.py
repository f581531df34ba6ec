"""modeling/config.py: DrafterConfig validation, from_target, dict round trips, defaults."""

from __future__ import annotations

import dataclasses

import pytest

from dspark_export.errors import ConfigError
from dspark_export.modeling.config import DrafterConfig, default_mask_token_id, default_target_layer_ids
from dspark_export.modeling.registry import compute_rope


def _copy(config, **changes):
    new = config.__class__.from_dict(config.to_dict())
    for key, value in changes.items():
        setattr(new, key, value)
    return new


def test_from_target_copies_the_target_fields(any_target):
    t = any_target.config
    c = DrafterConfig.from_target(t, num_draft_layers=3, block_size=7, markov_rank=16)
    assert (c.model_type, c.hidden_size, c.intermediate_size) == (t.model_type, 64, 128)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.vocab_size, c.max_position_embeddings, c.rms_norm_eps) == (256, 512, t.rms_norm_eps)
    assert c.rope_parameters == dict(t.rope_parameters) and c.rope_theta == 10000.0
    assert c.attention_bias is (t.model_type == "qwen2")
    assert (c.num_hidden_layers, c.num_target_layers, c.target_layer_ids) == (3, 4, (0, 1, 2))
    assert (c.block_size, c.markov_rank, c.markov_head_type) == (7, 16, "vanilla")
    assert c.enable_confidence_head and c.confidence_head_with_markov and not c.is_trained
    assert (c.feature_size, c.confidence_input_size) == (3 * 64, 64 + 16)
    assert c.architecture == {"llama": "LlamaDSparkModel", "qwen3": "Qwen3DSparkModel",
                              "qwen2": "Qwen2DSparkModel"}[t.model_type]


def test_drafter_rope_equals_target_rope(any_target):
    c = DrafterConfig.from_target(any_target.config)
    assert compute_rope(c.to_hf_config()).inv_freq.equal(any_target.rope.inv_freq)


@pytest.mark.parametrize("num_layers, expected", [
    (2, (0,)), (4, (0, 1, 2)), (6, (0, 1, 2, 3, 4)), (7, (1, 2, 3, 4, 5)), (30, (1, 8, 15, 21, 28)),
    (36, (1, 9, 18, 26, 34)),
])
def test_default_target_layer_ids(num_layers, expected):
    assert default_target_layer_ids(num_layers) == expected


@pytest.mark.parametrize("num_layers", range(2, 81))
def test_default_target_layer_ids_properties(num_layers):
    ids = default_target_layer_ids(num_layers)
    assert len(ids) == min(5, num_layers - 1)
    assert all(b > a for a, b in zip(ids, ids[1:]))
    assert ids[0] >= 0 and ids[-1] <= num_layers - 2


def test_default_target_layer_ids_needs_two_layers():
    with pytest.raises(ConfigError, match="num_target_layers"):
        default_target_layer_ids(1)


def test_default_mask_token(llama_target):
    config = llama_target.config  # pad 2 == eos 2, no unk
    assert default_mask_token_id(config, [2]) == 255
    assert default_mask_token_id(_copy(config, pad_token_id=7), [2]) == 7
    assert default_mask_token_id(_copy(config, unk_token_id=0), [2]) == 0
    assert default_mask_token_id(_copy(config, unk_token_id=0), [2, 0]) == 255
    assert DrafterConfig.from_target(config).mask_token_id == 255
    assert DrafterConfig.from_target(config, mask_token_id=9).mask_token_id == 9


def test_dict_round_trip(qwen3_target):
    c = DrafterConfig.from_target(qwen3_target.config, num_draft_layers=2, markov_rank=0)
    d = c.to_dict()
    assert d["architectures"] == ["Qwen3DSparkModel"] and d["target_layer_ids"] == [0, 1, 2]
    assert d["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert DrafterConfig.from_dict(d) == c


def _deepspec_dict(**changes):
    d = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "vocab_size": 256, "max_position_embeddings": 512, "num_hidden_layers": 1, "num_target_layers": 4,
         "target_layer_ids": [0, 2], "block_size": 7, "mask_token_id": 250, "markov_rank": 8,
         "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
         "num_anchors": 512, "tie_word_embeddings": False, "bos_token_id": 1, "hidden_act": "silu",
         "layer_types": ["full_attention"], "attention_bias": False}
    d.update(changes)
    return d


def test_from_dict_accepts_deepspec_layout():
    c = DrafterConfig.from_dict(_deepspec_dict())
    assert c.rope_parameters == {"rope_theta": 1e6, "rope_type": "default"}
    assert c.head_dim == 16 and c.target_layer_ids == (0, 2) and c.is_trained
    v5 = _deepspec_dict(rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    assert DrafterConfig.from_dict(v5).rope_theta == 5e5  # rope_parameters wins over rope_theta
    legacy = _deepspec_dict(rope_scaling={"type": "linear", "factor": 2.0})
    assert DrafterConfig.from_dict(legacy).rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}


def test_from_dict_missing_fields():
    d = _deepspec_dict()
    del d["block_size"]
    with pytest.raises(ConfigError, match="block_size"):
        DrafterConfig.from_dict(d)
    d = _deepspec_dict()
    del d["rope_theta"]
    with pytest.raises(ConfigError, match="rope_theta"):
        DrafterConfig.from_dict(d)


@pytest.mark.parametrize("field, value, match", [
    ("hidden_size", 0, "hidden_size: expected a positive int, found 0"),
    ("num_key_value_heads", 3, "num_key_value_heads: expected a divisor"),
    ("target_layer_ids", [2, 1], "target_layer_ids: expected strictly increasing"),
    ("target_layer_ids", [0, 3], r"target_layer_ids.*\[0, 2\].*last target layer 3"),
    ("target_layer_ids", [-2, 1], r"target_layer_ids: expected strictly increasing ids in \{-1\}"),
    ("target_layer_ids", [1, -1], "target_layer_ids: expected strictly increasing"),
    ("target_layer_ids", [], "non-empty"),
    ("mask_token_id", 256, r"mask_token_id: expected an int in \[0, 255\], found 256"),
    ("markov_rank", -1, "markov_rank"),
    ("markov_head_type", "gated", "'gated' head is not implemented"),
    ("markov_head_type", "rnn", "not implemented"),
    ("markov_head_type", "lstm", "markov_head_type: expected one of"),
    ("hidden_act", "gelu", "hidden_act: expected 'silu'"),
    ("enable_confidence_head", 1, "enable_confidence_head: expected a bool"),
    ("rope_parameters", {"rope_theta": 1e4, "rope_type": "dynamic"}, "rope_type"),
    ("rope_parameters", {"rope_type": "default"}, "rope_theta"),
    ("rms_norm_eps", 0.0, "rms_norm_eps"),
    ("model_type", "mistral", "unsupported model_type 'mistral'"),
])
def test_validation_errors(llama_target, field, value, match):
    base = DrafterConfig.from_target(llama_target.config)
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(base, **{field: value})


def test_gated_head_allowed_without_markov(llama_target):
    c = DrafterConfig.from_target(llama_target.config, markov_rank=0, markov_head_type="gated")
    assert not c.has_markov_head and c.confidence_input_size == 64


def test_confidence_input_without_markov(llama_target):
    c = DrafterConfig.from_target(llama_target.config, markov_rank=8, confidence_head_with_markov=False)
    assert c.confidence_input_size == 64


def test_check_target_names_both_values(llama_target, qwen3_target):
    c = DrafterConfig.from_target(llama_target.config)
    c.check_target(llama_target.config)
    with pytest.raises(ConfigError, match="model_type is 'llama' but the target's is 'qwen3'"):
        c.check_target(qwen3_target.config)
    with pytest.raises(ConfigError, match="hidden_size is 64 but the target's is 32"):
        c.check_target(_copy(llama_target.config, hidden_size=32))
    with pytest.raises(ConfigError, match="vocab_size is 256 but the target's is 300"):
        c.check_target(_copy(llama_target.config, vocab_size=300))
    with pytest.raises(ConfigError, match=r"\[0, 1, 2\] includes the last target layer.*3 layers"):
        c.check_target(_copy(llama_target.config, num_hidden_layers=3))
    with pytest.raises(ConfigError, match=r"\[0, 2\] is out of range for a target with 2 layers.*\[0, 0\]"):
        c.replace(target_layer_ids=(0, 2)).check_target(_copy(llama_target.config, num_hidden_layers=2))
    with pytest.raises(ConfigError, match="num_target_layers is 4 but the target's is 8"):
        c.check_target(_copy(llama_target.config, num_hidden_layers=8))
