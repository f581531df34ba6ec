"""modeling/registry.py: model_type lookup, target validation, RoPE tables."""

from __future__ import annotations

import pytest
import torch

from dspark_export.errors import ConfigError
from dspark_export.modeling.registry import (
    SUPPORTED_MODEL_TYPES,
    compute_rope,
    get_architecture,
    make_hf_config,
    read_rope,
    validate_target_config,
)


def test_supported_types_are_explicit():
    assert SUPPORTED_MODEL_TYPES == ("llama", "qwen2", "qwen3")
    assert get_architecture("qwen3").has_qk_norm
    assert not get_architecture("llama").has_qk_norm
    assert not get_architecture("qwen2").has_qk_norm


def test_unknown_model_type_names_it_and_lists_supported():
    with pytest.raises(ConfigError, match=r"'gpt2'.*\['llama', 'qwen2', 'qwen3'\]"):
        get_architecture("gpt2")
    with pytest.raises(ConfigError, match="'Llama'"):
        get_architecture("Llama")  # no fuzzy matching


@pytest.mark.parametrize("model_type, bias, expected", [
    ("llama", False, ()), ("llama", True, ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("qwen3", True, ("q_proj", "k_proj", "v_proj", "o_proj")), ("qwen2", True, ("q_proj", "k_proj", "v_proj")),
])
def test_biased_projections(model_type, bias, expected):
    assert get_architecture(model_type).biased_projections(bias) == expected


def test_qwen2_attention_bias_is_forced(qwen2_target, llama_target):
    assert get_architecture("qwen2").attention_bias(qwen2_target.config) is True
    assert get_architecture("llama").attention_bias(llama_target.config) is False


def test_read_rope_equals_compute_rope(any_target):
    read, computed = read_rope(any_target.model), compute_rope(any_target.config)
    D = any_target.config.head_dim
    assert read.inv_freq.shape == (D // 2,) and read.inv_freq.dtype == torch.float32
    torch.testing.assert_close(read.inv_freq, computed.inv_freq, rtol=0, atol=0)
    assert read.attention_scaling == computed.attention_scaling == 1.0
    expected = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    torch.testing.assert_close(read.inv_freq, expected)


def test_scaled_rope_uses_transformers_init():
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    config = make_hf_config("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=512, rope_parameters=rope))
    tables = compute_rope(config)
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert tables.inv_freq.shape == (8,)
    assert not torch.allclose(tables.inv_freq, plain)  # low frequencies were divided by the factor
    torch.testing.assert_close(tables.inv_freq[0], plain[0])


def _copy(config):
    return config.__class__.from_dict(config.to_dict())


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("mlp_bias", True), ("use_sliding_window", True)])
def test_unsupported_target_features_are_rejected(qwen3_target, field, value):
    config = _copy(qwen3_target.config)
    setattr(config, field, value)
    with pytest.raises(ConfigError, match=rf"{field}: expected one of .*found {value!r}"):
        validate_target_config(config)


def test_dynamic_rope_is_rejected(llama_target):
    config = _copy(llama_target.config)
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ConfigError, match="rope_type.*'dynamic'"):
        compute_rope(config)
