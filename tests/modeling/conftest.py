"""Fixtures for tests/modeling: wrapped tiny targets, tiny drafters, a hand-written tiny GGUF.

The tiny targets are deep copies of the session models from tests/conftest.py, so nothing here
changes the shared fixtures.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_export.modeling.config import DrafterConfig
from dspark_export.modeling.drafter import DSparkDrafter, init_drafter
from dspark_export.modeling.target import TargetModel, wrap_target

TINY_QWEN2_DIMS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_hidden_layers=4, vocab_size=256, max_position_embeddings=512,
                       rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def llama_target(tiny_llama) -> TargetModel:
    return wrap_target(copy.deepcopy(tiny_llama), source="tiny llama")


@pytest.fixture(scope="session")
def qwen3_target(tiny_qwen3) -> TargetModel:
    return wrap_target(copy.deepcopy(tiny_qwen3), source="tiny qwen3")


@pytest.fixture(scope="session")
def qwen2_target() -> TargetModel:
    """Tiny Qwen2 (biased q/k/v, tied embeddings), built here because tests/conftest.py has none."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    config = AutoConfig.for_model("qwen2", **TINY_QWEN2_DIMS)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 2
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return wrap_target(model.eval(), source="tiny qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen3", "qwen2"])
def any_target(request) -> TargetModel:
    return request.getfixturevalue(f"{request.param}_target")


def perturb_(module: torch.nn.Module, seed: int, scale: float = 0.1) -> torch.nn.Module:
    """Give every trainable tensor a seeded random value, so no weight is a trivial 0 or 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            noise = torch.randn(param.shape, generator=generator) * scale
            param.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return module


@pytest.fixture(scope="session")
def make_drafter():
    """Factory: ``make_drafter(target, **config_overrides) -> DSparkDrafter`` (2 layers, r=8, perturbed)."""

    def make(target: TargetModel, seed: int = 0, **overrides) -> DSparkDrafter:
        kwargs = dict(num_draft_layers=2, markov_rank=8, block_size=5)
        kwargs.update(overrides)
        config = DrafterConfig.from_target(target.config, **kwargs)
        return perturb_(init_drafter(target, config, seed=seed), seed=seed + 100)

    return make


# --------------------------------------------------------------------------- a hand-written tiny GGUF

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation for Llama GGUFs (transformers undoes it when loading)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _byte_level_tokens() -> list[str]:
    """The 256 GPT-2 byte-level symbols, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def write_tiny_llama_gguf(model, path: Path) -> Path:
    """Write a tiny Llama (F32 tensors) with a byte-level tokenizer (3 specials + 253 bytes) and a chat template."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    # the last byte (252) gives its id to "ab", the one merge: llama.cpp refuses a gpt2 vocabulary without merges
    # and transformers one whose merge result is not a token
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_level_tokens()[: config.vocab_size - 4], "ab"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    for name, tensor in model.state_dict().items():
        writer.add_tensor(*_gguf_tensor(name, tensor.numpy().astype(np.float32), config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_tensor(name: str, array: np.ndarray, config) -> tuple[str, np.ndarray]:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name], np.ascontiguousarray(array)
    _, _, index, *rest = name.split(".")
    role = ".".join(rest[:-1])
    if role == "self_attn.q_proj":
        array = _llama_cpp_permute(array, config.num_attention_heads)
    elif role == "self_attn.k_proj":
        array = _llama_cpp_permute(array, config.num_key_value_heads)
    return f"blk.{index}.{_GGUF_LAYER_NAMES[role]}.weight", np.ascontiguousarray(array)


@pytest.fixture(scope="session")
def tiny_chat_template() -> str:
    """The chat template written into :func:`tiny_gguf`."""
    return TINY_CHAT_TEMPLATE


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_llama) -> Path:
    """Path of ``tiny.gguf``: the session's tiny Llama as F32 GGUF (alone in its folder)."""
    folder = tmp_path_factory.mktemp("gguf")
    return write_tiny_llama_gguf(tiny_llama, folder / "tiny.gguf")
