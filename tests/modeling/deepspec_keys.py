"""The DeepSpec drafter state_dict key table (reference §1.8), written out independently of the module."""

from __future__ import annotations

from dspark_export.modeling.config import DrafterConfig


def expected_state_dict_shapes(config: DrafterConfig) -> dict[str, list[int]]:
    """DeepSpec reference §1.8 key table, written out independently of the module."""
    H, V, D, I = config.hidden_size, config.vocab_size, config.head_dim, config.intermediate_size
    qd, kvd, r = config.num_attention_heads * D, config.num_key_value_heads * D, config.markov_rank
    names = {"embed_tokens.weight": [V, H], "fc.weight": [H, config.feature_size], "hidden_norm.weight": [H]}
    biased = {"llama": "qkvo", "qwen3": "qkvo", "qwen2": "qkv"}[config.model_type] if config.attention_bias else ""
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}"
        names[f"{p}.input_layernorm.weight"] = [H]
        for proj, shape in (("q", [qd, H]), ("k", [kvd, H]), ("v", [kvd, H]), ("o", [H, qd])):
            names[f"{p}.self_attn.{proj}_proj.weight"] = shape
            if proj in biased:
                names[f"{p}.self_attn.{proj}_proj.bias"] = [shape[0]]
        if config.model_type == "qwen3":
            names[f"{p}.self_attn.q_norm.weight"] = [D]
            names[f"{p}.self_attn.k_norm.weight"] = [D]
        names[f"{p}.post_attention_layernorm.weight"] = [H]
        names[f"{p}.mlp.gate_proj.weight"] = [I, H]
        names[f"{p}.mlp.up_proj.weight"] = [I, H]
        names[f"{p}.mlp.down_proj.weight"] = [H, I]
    names.update({"norm.weight": [H], "lm_head.weight": [V, H]})
    if r:
        names.update({"markov_head.markov_w1.weight": [V, r], "markov_head.markov_w2.weight": [V, r]})
    if config.enable_confidence_head:
        with_markov = r > 0 and config.confidence_head_with_markov
        names.update({"confidence_head.proj.weight": [1, H + (r if with_markov else 0)],
                      "confidence_head.proj.bias": [1]})
    return names
