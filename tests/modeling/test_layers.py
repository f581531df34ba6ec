"""modeling/layers.py: RMSNorm and RoPE against transformers' own implementations."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from dspark_export.modeling.layers import RMSNorm, apply_rope, rope_cos_sin


def test_rms_norm_matches_transformers():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=generator) * 3
    ours, theirs = RMSNorm(64, 1e-6), LlamaRMSNorm(64, eps=1e-6)
    with torch.no_grad():
        weight = torch.randn(64, generator=generator)
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


def test_rope_matches_target_rotary_embedding(llama_target):
    rotary, rope = llama_target.model.model.rotary_emb, llama_target.rope
    positions = torch.tensor([[0, 3, 7, 100, 511]])
    x = torch.randn(1, 4, 5, 16)  # [B, heads, T, D], transformers layout
    cos_ref, sin_ref = rotary(x, positions)
    cos, sin = rope_cos_sin(rope.inv_freq, rope.attention_scaling, positions[0])  # [T, D]
    torch.testing.assert_close(cos, cos_ref[0], rtol=0, atol=1e-6)
    expected, _ = apply_rotary_pos_emb(x, x, cos_ref, sin_ref)
    ours = apply_rope(x[0].transpose(0, 1), cos, sin).transpose(0, 1)  # [T, heads, D] layout
    torch.testing.assert_close(ours, expected[0], rtol=1e-6, atol=1e-6)
