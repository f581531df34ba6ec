"""modeling/drafter.py: state_dict names, context/block decomposition vs an unbatched reference, heads, init."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from dspark_export.errors import ConfigError
from dspark_export.modeling.config import DrafterConfig
from dspark_export.modeling.drafter import INIT_STD, DSparkDrafter, init_drafter

from .deepspec_keys import expected_state_dict_shapes

ATOL = 2e-5


@pytest.mark.parametrize("overrides", [
    {}, {"markov_rank": 0}, {"enable_confidence_head": False}, {"confidence_head_with_markov": False},
    {"markov_rank": 0, "enable_confidence_head": False},
], ids=["full", "no-markov", "no-confidence", "confidence-hidden-only", "dflash"])
def test_state_dict_names_and_shapes(any_target, make_drafter, overrides):
    drafter = make_drafter(any_target, **overrides)
    got = {name: list(t.shape) for name, t in drafter.state_dict().items()}
    assert got == expected_state_dict_shapes(drafter.config)
    assert all(t.dtype == torch.float32 for t in drafter.state_dict().values())


def test_llama_attention_bias_adds_all_four_biases(llama_target):
    config = DrafterConfig.from_target(llama_target.config, num_draft_layers=1).replace(attention_bias=True)
    names = set(DSparkDrafter(config).state_dict())
    assert {f"layers.0.self_attn.{p}_proj.bias" for p in "qkvo"} <= names


# --------------------------------------------------------------------------- unbatched reference


def reference_block(drafter: DSparkDrafter, rotary, aux: torch.Tensor, anchor: int, start: int):
    """One request, DeepSpec's formulation (reference §1.3): k/v over cat([H_ctx, x]), full non-causal SDPA.

    aux [T, F] holds the context rows at positions 0..T-1. Returns hidden [γ, H], logits [γ, V].
    """
    c = drafter.config
    G, T, nh, kvH, D = c.block_size, aux.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
    context = drafter.fc(aux)
    context = context * torch.rsqrt(context.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * drafter.hidden_norm.weight
    h = drafter.embed_tokens(torch.tensor([[anchor] + [c.mask_token_id] * (G - 1)]))  # [1, γ, H]
    positions = torch.cat((torch.arange(T), start + torch.arange(G)))[None]
    cos, sin = rotary(h, positions)  # transformers' rotary embedding of the target, [1, T+γ, D]
    for layer in drafter.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(1, G, nh, D)
        kv_in = torch.cat((context[None], x), dim=1)  # the context is not normed by input_layernorm
        k = attn.k_proj(kv_in).view(1, T + G, kvH, D)
        v = attn.v_proj(kv_in).view(1, T + G, kvH, D).transpose(1, 2)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos[:, T:], sin[:, T:])
        _, k = apply_rotary_pos_emb(k.transpose(1, 2), k.transpose(1, 2), cos, sin)
        out = F.scaled_dot_product_attention(q, repeat_kv(k, nh // kvH), repeat_kv(v, nh // kvH), is_causal=False)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(1, G, nh * D))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = drafter.norm(h)
    return h[0], drafter.lm_head(h)[0]


def _pack_context(drafter, auxes, pad_to, garbage_seed=None):
    """context_kv of each request, padded to [R, kvH, P, D]; pad entries are zeros or random garbage."""
    layers = []
    generator = torch.Generator().manual_seed(garbage_seed or 0)
    per_request = [drafter.context_kv(aux, torch.arange(aux.shape[0])) for aux in auxes]
    for layer in range(drafter.config.num_hidden_layers):
        keys, values = [], []
        for kv in per_request:
            for store, t in ((keys, kv[layer][0]), (values, kv[layer][1])):
                t = t.transpose(0, 1)  # [kvH, T, D]
                pad_shape = (t.shape[0], pad_to - t.shape[1], t.shape[2])
                pad = torch.randn(pad_shape, generator=generator) * 50 if garbage_seed else torch.zeros(pad_shape)
                store.append(torch.cat((t, pad), dim=1))
        layers.append((torch.stack(keys), torch.stack(values)))
    return layers


@pytest.fixture
def drafter_and_auxes(any_target, make_drafter):
    drafter = make_drafter(any_target, seed=5)
    generator = torch.Generator().manual_seed(11)
    auxes = [torch.randn(n, drafter.config.feature_size, generator=generator) for n in (5, 0, 9)]
    return any_target, drafter, auxes


@torch.no_grad()
def test_context_kv_shapes(drafter_and_auxes):
    _, drafter, auxes = drafter_and_auxes
    c = drafter.config
    kv = drafter.context_kv(auxes[2], torch.arange(9))
    assert len(kv) == c.num_hidden_layers
    for key, value in kv:
        assert key.shape == value.shape == (9, c.num_key_value_heads, c.head_dim)
        assert key.dtype == value.dtype == torch.float32
    torch.testing.assert_close(drafter.project_context(auxes[2]),
                               drafter.hidden_norm(auxes[2] @ drafter.fc.weight.T))


@torch.no_grad()
def test_forward_block_matches_unbatched_reference(drafter_and_auxes):
    target, drafter, auxes = drafter_and_auxes
    rotary = target.model.model.rotary_emb
    anchors, lens = torch.tensor([17, 3, 250]), torch.tensor([5, 0, 9])
    hidden, logits = drafter.forward_block(anchors, lens, _pack_context(drafter, auxes, 12), lens)
    G, H, V = drafter.config.block_size, drafter.config.hidden_size, drafter.config.vocab_size
    assert hidden.shape == (3, G, H) and logits.shape == (3, G, V)
    for r, aux in enumerate(auxes):
        ref_hidden, ref_logits = reference_block(drafter, rotary, aux, int(anchors[r]), int(lens[r]))
        torch.testing.assert_close(hidden[r], ref_hidden, rtol=0, atol=ATOL)
        torch.testing.assert_close(logits[r], ref_logits, rtol=0, atol=ATOL)


@torch.no_grad()
def test_batched_equals_alone_and_padding_is_masked(drafter_and_auxes):
    _, drafter, auxes = drafter_and_auxes
    anchors, lens = torch.tensor([17, 3, 250]), torch.tensor([5, 0, 9])
    batched, _ = drafter.forward_block(anchors, lens, _pack_context(drafter, auxes, 16, garbage_seed=7), lens)
    for r, aux in enumerate(auxes):
        alone, _ = drafter.forward_block(anchors[r:r + 1], lens[r:r + 1], _pack_context(drafter, [aux], aux.shape[0]),
                                         lens[r:r + 1])
        torch.testing.assert_close(batched[r], alone[0], rtol=0, atol=ATOL)


@torch.no_grad()
def test_context_changes_the_block_and_block_is_not_causal(drafter_and_auxes):
    _, drafter, auxes = drafter_and_auxes
    ctx = _pack_context(drafter, [auxes[2]], 9)
    full, _ = drafter.forward_block(torch.tensor([17]), torch.tensor([9]), ctx, torch.tensor([9]))
    shorter, _ = drafter.forward_block(torch.tensor([17]), torch.tensor([9]), ctx, torch.tensor([4]))
    assert not torch.allclose(full, shorter, atol=1e-3)
    # Slot 0 (the anchor) sees the mask slots after it, so it depends on the mask token id.
    other = DSparkDrafter(drafter.config.replace(mask_token_id=(drafter.config.mask_token_id + 1) % 256))
    other.load_state_dict(drafter.state_dict())
    moved, _ = other.forward_block(torch.tensor([17]), torch.tensor([9]), ctx, torch.tensor([9]))
    assert not torch.allclose(full[:, 0], moved[:, 0], atol=1e-4)


def test_forward_block_rejects_bad_shapes(drafter_and_auxes):
    _, drafter, auxes = drafter_and_auxes
    ctx = _pack_context(drafter, [auxes[0]], 5)
    with pytest.raises(ValueError, match="context_lens must lie in"):
        drafter.forward_block(torch.tensor([1]), torch.tensor([5]), ctx, torch.tensor([6]))
    with pytest.raises(ValueError, match="all \\[R\\]"):
        drafter.forward_block(torch.tensor([1, 2]), torch.tensor([5]), ctx, torch.tensor([5]))
    with pytest.raises(ValueError, match="pairs"):
        drafter.forward_block(torch.tensor([1]), torch.tensor([5]), ctx[:1], torch.tensor([5]))
    with pytest.raises(ValueError, match="aux_hidden"):
        drafter.context_kv(torch.zeros(3, 7), torch.arange(3))


# --------------------------------------------------------------------------- sequential-stage pieces


@torch.no_grad()
def test_markov_bias(llama_target, make_drafter):
    drafter = make_drafter(llama_target)
    prev = torch.tensor([0, 5, 255])
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    torch.testing.assert_close(drafter.markov_bias(prev), w1[prev] @ w2.T)
    plain = make_drafter(llama_target, markov_rank=0)
    assert plain.markov_head is None
    assert plain.markov_bias(prev).equal(torch.zeros(3, 256))


@torch.no_grad()
def test_confidence_logits(llama_target, make_drafter):
    drafter = make_drafter(llama_target)
    hidden, prev = torch.randn(2, 5, 64), torch.randint(0, 256, (2, 5))
    w, b = drafter.confidence_head.proj.weight[0], drafter.confidence_head.proj.bias
    features = torch.cat((hidden, drafter.markov_head.markov_w1.weight[prev]), dim=-1)
    logits = drafter.confidence_logits(hidden, prev)
    assert logits.shape == (2, 5) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, features @ w + b)
    hidden_only = make_drafter(llama_target, confidence_head_with_markov=False)
    w, b = hidden_only.confidence_head.proj.weight[0], hidden_only.confidence_head.proj.bias
    torch.testing.assert_close(hidden_only.confidence_logits(hidden, prev), hidden @ w + b)
    with pytest.raises(ConfigError, match="enable_confidence_head=False"):
        make_drafter(llama_target, enable_confidence_head=False).confidence_logits(hidden, prev)


# --------------------------------------------------------------------------- init_drafter


def test_init_drafter_copies_and_freezes_target_embeddings(any_target):
    config = DrafterConfig.from_target(any_target.config, num_draft_layers=2).replace(is_trained=True)
    drafter = init_drafter(any_target, config, seed=3)
    assert drafter.config.is_trained is False and not drafter.training
    model = any_target.model
    assert drafter.embed_tokens.weight.equal(model.get_input_embeddings().weight)
    assert drafter.lm_head.weight.equal(model.get_output_embeddings().weight)
    assert drafter.embed_tokens.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert not drafter.embed_tokens.weight.requires_grad and not drafter.lm_head.weight.requires_grad
    assert drafter.fc.weight.requires_grad
    assert drafter.inv_freq.equal(any_target.rope.inv_freq)


def test_init_drafter_is_seeded_and_documented_std(llama_target):
    config = DrafterConfig.from_target(llama_target.config, num_draft_layers=2)
    a, b = init_drafter(llama_target, config, seed=1), init_drafter(llama_target, config, seed=1)
    c = init_drafter(llama_target, config, seed=2)
    for name, tensor in a.state_dict().items():
        assert tensor.equal(b.state_dict()[name]), name
    assert not a.fc.weight.equal(c.fc.weight)
    assert abs(float(a.markov_head.markov_w1.weight.detach().std()) - INIT_STD) < 0.002
    assert a.norm.weight.eq(1).all() and a.confidence_head.proj.bias.eq(0).all()


def test_init_drafter_checks_the_target(llama_target, qwen3_target):
    config = DrafterConfig.from_target(llama_target.config)
    with pytest.raises(ConfigError, match="model_type is 'llama' but the target's is 'qwen3'"):
        init_drafter(qwen3_target, config)
