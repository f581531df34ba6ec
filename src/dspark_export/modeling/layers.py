"""Building blocks of the DSpark drafter: RMSNorm, RoPE, context-injected attention, MLP, heads.

Sources: DeepSpec reference §1.3 (``Qwen3DSparkDecoderLayer``/``Qwen3DSparkAttention``), §1.6
(``VanillaMarkov``), §1.7 (``AcceptRatePredictor``); transformers' Llama/Qwen3 for RMSNorm and RoPE.
Submodule attribute names are DeepSpec's, so ``state_dict`` keys match its checkpoints.

Dimension letters: R requests, P padded context length, γ block size, H hidden size, I MLP width,
V vocab, nh query heads, kvH KV heads, D head dim, r Markov rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_export.modeling.config import DrafterConfig

__all__ = [
    "RMSNorm", "rotate_half", "apply_rope", "rope_cos_sin", "DrafterAttention", "DrafterMLP", "DrafterLayer",
    "VanillaMarkovHead", "ConfidenceHead",
]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] → [..., D]: ``cat(-x[D/2:], x[:D/2])`` (transformers' non-interleaved RoPE)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., heads, D]`` with ``cos, sin [..., D]`` (same leading dims, no heads axis)."""
    return x * cos.unsqueeze(-2) + rotate_half(x) * sin.unsqueeze(-2)


def rope_cos_sin(inv_freq: torch.Tensor, attention_scaling: float,
                 positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for absolute ``positions [...] int64`` → each ``[..., D] float32``.

    ``angle = pos · inv_freq`` duplicated over both halves, times ``attention_scaling``, as
    transformers' rotary embeddings compute them.
    """
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(torch.float32)  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


class RMSNorm(nn.Module):
    """``x · rsqrt(mean(x²) + eps) · weight`` over the last axis, in fp32 (Llama/Qwen RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))


class DrafterAttention(nn.Module):
    """Attention with context KV injection (reference §1.3): q from the block, k/v from context + block."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        biased = config.spec.biased_projections(config.attention_bias)
        self.q_proj = nn.Linear(H, self.num_heads * D, bias="q_proj" in biased)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias="k_proj" in biased)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias="v_proj" in biased)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias="o_proj" in biased)
        has_qk_norm = config.spec.has_qk_norm  # Qwen3: per-head RMSNorm on q and k before RoPE
        self.q_norm = RMSNorm(D, config.rms_norm_eps) if has_qk_norm else None
        self.k_norm = RMSNorm(D, config.rms_norm_eps) if has_qk_norm else None

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., H]``, ``cos, sin [..., D]`` → key (k_norm, RoPE) and value, each ``[..., kvH, D]``."""
        key = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.k_norm is not None:
            key = self.k_norm(key)
        value = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(key, cos, sin), value

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_key: torch.Tensor,
                context_value: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """Block attention over ``[context ; block]``, non-causal, GQA, scale D^-0.5.

        Args:
            x: [R, γ, H] float32, normed block stream.
            cos, sin: [R, γ, D] float32, RoPE at the block positions.
            context_key, context_value: [R, kvH, P, D] float32.
            key_valid: [R, P+γ] bool, False for context entries at or past the request's length.

        Returns:
            [R, γ, H] float32, the o_proj output.
        """
        R, G, _ = x.shape
        query = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        if self.q_norm is not None:
            query = self.q_norm(query)
        query = apply_rope(query, cos, sin).transpose(1, 2)  # [R, nh, γ, D]
        block_key, block_value = self.project_kv(x, cos, sin)  # [R, γ, kvH, D]
        key = torch.cat((context_key, block_key.transpose(1, 2)), dim=2)  # [R, kvH, P+γ, D]
        value = torch.cat((context_value, block_value.transpose(1, 2)), dim=2)
        n_rep = self.num_heads // self.num_kv_heads  # query head h reads KV head h // n_rep
        key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
        scores = (query @ key.transpose(-1, -2)) * self.head_dim**-0.5  # [R, nh, γ, P+γ]
        scores = scores.masked_fill(~key_valid[:, None, None, :], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ value  # [R, nh, γ, D]
        return self.o_proj(out.transpose(1, 2).reshape(R, G, self.num_heads * self.head_dim))


class DrafterMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` (Qwen3MLP / LlamaMLP without biases)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """Pre-norm decoder layer; only the block stream is normed, never the context (reference §1.3)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DrafterAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DrafterMLP(config)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_key: torch.Tensor,
                context_value: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """[R, γ, H] → [R, γ, H]; other arguments as :meth:`DrafterAttention.forward`."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context_key, context_value, key_valid)
        return h + self.mlp(self.post_attention_layernorm(h))


class VanillaMarkovHead(nn.Module):
    """DeepSpec ``VanillaMarkov`` (reference §1.6, paper Eq. 5): ``bias(prev) = W1[prev] @ W2^T``."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # W1 [V, r]
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # W2 [V, r]

    def forward(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """prev_ids [...] int64 → logit bias [..., V] float32."""
        return self.markov_w2(self.markov_w1(prev_ids))


class ConfidenceHead(nn.Module):
    """DeepSpec ``AcceptRatePredictor`` (reference §1.7, paper Eq. 7 plus a bias): one logit per slot."""

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, 1, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[..., H(+r)] → [...] float32 logits."""
        return self.proj(features).squeeze(-1).float()
