"""The DSpark drafter as a PyTorch module, decomposed for inference (fp32 reference).

Source: DSpark paper §3 and DeepSpec ``Qwen3DSparkModel`` (reference §1.2-§1.8), decomposed as in
reference §5.3 (mathematically equal to the reference's single forward with a draft KV cache):

- :meth:`DSparkDrafter.context_kv`: target features → per-layer context K/V, computed once per
  committed row: ``h = hidden_norm(fc(aux))``, ``K_l = RoPE(k_norm_l(k_proj_l(h)))``, ``V_l = v_proj_l(h)``.
- :meth:`DSparkDrafter.forward_block`: the parallel stage. Block ``[anchor, mask×(γ-1)]`` at positions
  ``start..start+γ-1`` attends, non-causally, to the request's context entries and to all γ block
  slots; returns the post-final-norm hidden states and the base logits ``U = lm_head(h)``.
- :meth:`DSparkDrafter.markov_bias`, :meth:`DSparkDrafter.confidence_logits`: the pieces of the
  sequential stage (reference §1.6, §1.7); sampling itself belongs to ``plugins/markov_draft``.

State_dict names are exactly DeepSpec's (reference §1.8, no prefix); the RoPE table ``inv_freq`` is a
non-persistent buffer. Methods do not switch autograd off; wrap calls in ``torch.no_grad()``.

Dimension letters: R requests, T context rows, P padded context length, γ block size, H hidden size,
F = m·H target features, V vocab, kvH KV heads, D head dim, r Markov rank.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import torch
from torch import nn

from dspark_export.errors import ConfigError
from dspark_export.modeling.config import DrafterConfig
from dspark_export.modeling.layers import ConfidenceHead, DrafterLayer, RMSNorm, VanillaMarkovHead, rope_cos_sin
from dspark_export.modeling.registry import compute_rope

if TYPE_CHECKING:
    from dspark_export.modeling.target import TargetModel

__all__ = ["DSparkDrafter", "DrafterConfig", "init_drafter", "INIT_STD", "SHARED_EMBEDDING_NAMES"]

logger = logging.getLogger(__name__)

#: Std of the normal init of every fresh drafter matrix (transformers' default ``initializer_range``).
INIT_STD = 0.02
#: Tensors copied from the target and frozen (reference §1.5); shipped drafters may omit them.
SHARED_EMBEDDING_NAMES = ("embed_tokens.weight", "lm_head.weight")

#: Per drafter layer: (key, value), each [R, kvH, P, D] float32 (block) or [T, kvH, D] (context).
ContextKV = Sequence[tuple[torch.Tensor, torch.Tensor]]


class DSparkDrafter(nn.Module):
    """DSpark drafter (DeepSpec ``Qwen3DSparkModel`` layout; Llama/Qwen2 layers without q/k norm).

    Submodules: ``embed_tokens`` [V, H], ``fc`` [H, F], ``hidden_norm``, ``layers.{i}``, ``norm``,
    ``lm_head`` [V, H], ``markov_head`` (None when ``markov_rank == 0``) and ``confidence_head``
    (None when disabled; input H + r with the Markov head and ``confidence_head_with_markov``, else H).
    """

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(config.feature_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.markov_head = VanillaMarkovHead(V, config.markov_rank) if config.has_markov_head else None
        self.confidence_head = ConfidenceHead(config.confidence_input_size) if config.has_confidence_head else None
        rope = compute_rope(config.to_hf_config())
        self.register_buffer("inv_freq", rope.inv_freq, persistent=False)  # [D/2] float32
        self.attention_scaling = rope.attention_scaling

    # ------------------------------------------------------------------------ parallel stage

    def project_context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(aux))`` (reference §1.2): aux_hidden [T, F] float32 → [T, H] float32."""
        return self.hidden_norm(self.fc(aux_hidden))

    def context_kv(self, aux_hidden: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context K/V of committed rows (reference §2.3, §5.3).

        Args:
            aux_hidden: [T, F] float32, raw outputs of the tapped target layers, in tap order.
            position_ids: [T] int64, the rows' absolute positions.

        Returns:
            One ``(key, value)`` per drafter layer, each [T, kvH, D] float32;
            ``key = RoPE(k_norm(k_proj(h)))`` (k_norm only for Qwen3), ``value = v_proj(h)``,
            ``h = project_context(aux_hidden)``.

        Raises:
            ValueError: shapes do not agree (the message gives them).
        """
        if aux_hidden.dim() != 2 or aux_hidden.shape[1] != self.config.feature_size \
                or tuple(position_ids.shape) != (aux_hidden.shape[0],):
            raise ValueError(f"context_kv: expected aux_hidden [T, {self.config.feature_size}] and position_ids "
                             f"[T], found {list(aux_hidden.shape)} and {list(position_ids.shape)}")
        h = self.project_context(aux_hidden)
        cos, sin = self.rope_cos_sin(position_ids)
        return [layer.self_attn.project_kv(h, cos, sin) for layer in self.layers]

    def forward_block(self, anchor_ids: torch.Tensor, start_positions: torch.Tensor, context_kv: ContextKV,
                      context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft block forward of R requests (paper §3.1 parallel stage; reference §1.3, §1.4, §2.3).

        Block r holds ``[anchor_ids[r], mask×(γ-1)]`` at positions ``start..start+γ-1``. Each layer
        attends from the block to context entries ``0..context_lens[r]-1`` and to all γ block slots
        (non-causal, GQA, scale D^-0.5); context entries at ``>= context_lens[r]`` are masked out.

        Args:
            anchor_ids: [R] int64, last committed token of each request.
            start_positions: [R] int64, absolute position of the anchor.
            context_kv: per drafter layer ``(key, value)``, each [R, kvH, P, D] float32.
            context_lens: [R] int64, valid context entries per request, in [0, P].

        Returns:
            hidden [R, γ, H] float32 (after the final norm) and base_logits [R, γ, V] float32.

        Raises:
            ValueError: shapes do not agree or a context length is outside [0, P].
        """
        self._check_block_inputs(anchor_ids, start_positions, context_kv, context_lens)
        R, G = anchor_ids.shape[0], self.config.block_size
        device = anchor_ids.device
        mask_ids = torch.full((R, G - 1), self.config.mask_token_id, dtype=anchor_ids.dtype, device=device)
        block_ids = torch.cat((anchor_ids[:, None], mask_ids), dim=1)  # [R, γ]
        cos, sin = self.rope_cos_sin(start_positions[:, None] + torch.arange(G, device=device))  # [R, γ, D]
        P = context_kv[0][0].shape[2]
        context_valid = torch.arange(P, device=device)[None, :] < context_lens[:, None]  # [R, P]
        block_valid = torch.ones(R, G, dtype=torch.bool, device=device)
        key_valid = torch.cat((context_valid, block_valid), dim=1)  # [R, P+γ]
        h = self.embed_tokens(block_ids)
        for layer, (context_key, context_value) in zip(self.layers, context_kv):
            h = layer(h, cos, sin, context_key, context_value, key_valid)
        h = self.norm(h)
        return h, self.lm_head(h)

    def _check_block_inputs(self, anchor_ids: torch.Tensor, start_positions: torch.Tensor, context_kv: ContextKV,
                            context_lens: torch.Tensor) -> None:
        R = anchor_ids.shape[0] if anchor_ids.dim() == 1 else -1
        if R < 0 or tuple(start_positions.shape) != (R,) or tuple(context_lens.shape) != (R,):
            raise ValueError(f"forward_block: expected anchor_ids, start_positions, context_lens all [R], found "
                             f"{list(anchor_ids.shape)}, {list(start_positions.shape)}, {list(context_lens.shape)}")
        if len(context_kv) != self.config.num_hidden_layers:
            raise ValueError(f"forward_block: expected {self.config.num_hidden_layers} (key, value) pairs, "
                             f"found {len(context_kv)}")
        kvH, D = self.config.num_key_value_heads, self.config.head_dim
        P = context_kv[0][0].shape[2] if context_kv[0][0].dim() == 4 else -1
        for i, pair in enumerate(context_kv):
            for name, t in zip(("key", "value"), pair):
                if tuple(t.shape) != (R, kvH, P, D):
                    raise ValueError(f"forward_block: context {name} of layer {i}: expected "
                                     f"[{R}, {kvH}, P, {D}] (same P for all), found {list(t.shape)}")
        if R and (int(context_lens.min()) < 0 or int(context_lens.max()) > P):
            raise ValueError(f"forward_block: context_lens must lie in [0, P={P}], found {context_lens.tolist()}")

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables at ``positions [...] int64`` → cos, sin each [..., D] float32 (the target's RoPE)."""
        return rope_cos_sin(self.inv_freq, self.attention_scaling, positions)

    # ------------------------------------------------------------------------ sequential stage pieces

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """Markov logit bias ``W1[prev] @ W2^T`` (paper Eq. 5; reference §1.6).

        Args:
            prev_ids: [R] int64, previous token of the slot (the anchor for slot 0).

        Returns:
            [R, V] float32; zeros when the drafter has no Markov head (DFlash-style).
        """
        if self.markov_head is None:
            return torch.zeros(prev_ids.shape[0], self.config.vocab_size, device=prev_ids.device)
        return self.markov_head(prev_ids)

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Confidence logits ``[h_k ; W1[prev_k]]·w + b`` (paper Eq. 7 plus DeepSpec's bias; reference §1.7).

        Args:
            hidden: [R, γ, H] float32, post-final-norm block hidden states.
            prev_ids: [R, γ] int64, previous token of each slot (anchor, then the sampled drafts).

        Returns:
            [R, γ] float32 logits; σ(logit) estimates P(draft k accepted | drafts before it accepted).
            The input is h_k alone without a Markov head or with ``confidence_head_with_markov=False``.

        Raises:
            ConfigError: the drafter has no confidence head (``enable_confidence_head=False``).
        """
        if self.confidence_head is None:
            raise ConfigError("confidence_logits: expected a drafter with a confidence head, found "
                              "enable_confidence_head=False (check config.has_confidence_head first)")
        features = hidden
        if self.config.confidence_head_with_markov and self.markov_head is not None:
            features = torch.cat((hidden, self.markov_head.markov_w1(prev_ids)), dim=-1)
        return self.confidence_head(features)

    # ------------------------------------------------------------------------ shared embeddings

    def load_shared_embeddings(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Copy the target's input embeddings and LM head ([V, H] each) in, and freeze them (reference §1.5).

        Raises:
            ConfigError: a tensor is not [V, H].
        """
        for name, source in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            param = getattr(self, name).weight
            if source.shape != param.shape:
                raise ConfigError(f"drafter {name}.weight: expected the target's [V, H] = {list(param.shape)}, "
                                  f"found {list(source.shape)}")
            with torch.no_grad():
                param.copy_(source.detach().to(torch.float32))
            param.requires_grad_(False)


def init_drafter(target: "TargetModel", config: DrafterConfig, *, seed: int = 0) -> DSparkDrafter:
    """A fresh, untrained drafter for ``target`` (``is_trained=False``), fp32, eval mode.

    Init (seeded by ``seed`` through a private generator, so global RNG state is untouched): every
    matrix ~ N(0, INIT_STD=0.02) (transformers' default ``initializer_range``), biases 0, RMSNorm
    weights 1. ``embed_tokens``/``lm_head`` are copies of the target's input and output embeddings
    (the latter may be tied to the former) and are frozen, as DeepSpec ``initialize_embeddings_and_head``.

    Raises:
        ConfigError: ``config`` does not fit the target (see :meth:`DrafterConfig.check_target`).
    """
    config.check_target(target.config)
    if config.is_trained:
        config = config.replace(is_trained=False)
    drafter = DSparkDrafter(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, INIT_STD, generator=generator)
    embeddings = target.model.get_input_embeddings().weight
    drafter.load_shared_embeddings(embeddings, target.model.get_output_embeddings().weight)
    logger.info("initialised an untrained %s drafter (%d layers, seed %d)", config.model_type,
                config.num_hidden_layers, seed)
    return drafter.eval()
