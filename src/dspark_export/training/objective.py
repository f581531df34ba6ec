"""The DSpark training forward and objective (paper §3, Eq. 8-10; DeepSpec reference §1.3, §1.4, §3).

One training example is a cached target sequence (tokens, tapped-layer features ``aux``, the
target's final hidden ``last``) and N anchor positions inside its assistant tokens. Block j holds
``[tokens[p_j], MASK×(γ-1)]`` at positions ``p_j..p_j+γ-1``; it attends to the context rows
``< p_j`` (strictly: the anchor's own target features do not exist yet at inference) and,
bidirectionally, to its own γ slots, never to other blocks. Slot k predicts ``tokens[p_j+k+1]``.
All N blocks of a sequence run in one attention call with that mask, which gives exactly the same
numbers as :meth:`DSparkDrafter.forward_block` run per block (tested).

Loss, with w_k = valid_k · exp(-k / 4) (valid: the label exists and is an assistant token, as a
contiguous prefix):

    CE   = Σ w·CE(draft_logits, labels) / Σ w
    L1   = Σ w·‖p_d − p_t‖₁ / Σ w                 p_d = softmax(U + Markov(prev)), p_t = target's
    α    = clamp(1 − ½‖p_d − p_t‖₁, 0, 1), detached   (analytic acceptance at T = 1)
    BCE  = Σ w·BCEWithLogits(conf_logit, α) / Σ w
    loss = ce_weight·CE + l1_weight·L1 + bce_weight·BCE     (DeepSpec: 0.1, 0.9, 1.0)

with teacher-forced previous tokens ``prev = [anchor, labels[:-1]]`` for the Markov head and the
confidence head. CE's label is the sequence's next token, or with ``make_batch(..., ce_labels="argmax")`` the
target's own argmax at that position over the full vocabulary (``TrainBatch.ce_labels``): what a greedy (T = 0)
verification accepts. The two differ on responses the target sampled at T > 0; ``prev`` stays the sequence's
tokens either way, since the cached features were computed on them.

Cost: the [M, V] logits (M = B·N·γ rows, V = 49152 for SmolLM2) dominate. ``dspark_loss`` never
materialises them in fp32: :class:`FusedVocabLoss` walks the rows in chunks, computing per chunk the
draft and target logits, CE, L1 and the argmax; it keeps p (in the matmul dtype: fp32, or bf16 with `bf16`)
and sign(p − q) (int8) as [M, V] tensors for the backward pass, which then runs only the H-wide
gradient products (the gradients are written out in its docstring). Per-chunk tensors stay in cache instead of streaming ~8 fp32 [M, V]
temporaries through memory, which roughly halves a training step on CPU (reports/measurement_history.md,
"fused vocab loss"). ``fused=False`` keeps
the direct autograd form; the tests hold the two equal (values and gradients).

Draft vocabulary (``d2t`` [N], `training.draft_vocab`; ``dspark_loss(..., d2t=)``): the exported block drafts
from ``softmax`` over the N rows of d2t only (every other token gets exactly 0, ARCHITECTURE "Draft
vocabulary"), so training computes the drafter's logits over those N rows only, normalised over them
(p_d = softmax over d2t, what inference draws from), and pools every target token outside d2t into one
bucket of the loss, dropped at inference:

    p_t[v] = exp(t·W_v − lse_V(t·Wᵀ)) for v in d2t     P_out = 1 − Σ_{d2t} p_t   (target's mass outside)
    L1  = Σ_{d2t} |p_d − p_t| + |0 − P_out|             the drafter's bucket mass is 0, as at inference
    α   = clamp(1 − ½·L1, 0, 1) = Σ_{d2t} min(p_d, p_t)  the acceptance of the exported block (T = 1)
    CE  = −log p_d[label] for labels in d2t; 0 for a label in the bucket (it can never be drafted)

lse_V(t·Wᵀ) is the target's full-vocabulary logsumexp (one scalar per token, `target_logsumexp`; the
trainer computes it once per cached sequence, the target being frozen). Why the drafter's bucket logit is
−∞ and not logsumexp over the shared head's non-d2t rows: that logsumexp needs the [M, V − N] product in
the forward and its softmax in the backward, i.e. the full-vocabulary cost this mode exists to avoid, and
it trains a bucket mass the exported block never has (its α would count bucket mass that cannot be
accepted). With −∞ the loss is exactly the inference drafter's L1 to the target, whose minimiser on d2t
(p_d ≥ p_t there) is the one of the logsumexp design. With N = V the bucket is empty and every term
equals the full-vocabulary loss (tested). The Markov table W2 [V, r] gets gradients on the d2t rows only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..modeling.drafter import DSparkDrafter
from ..modeling.layers import apply_rope
from .features import Sequence_

__all__ = ["LossWeights", "TrainBatch", "make_batch", "sample_anchors", "block_forward", "dspark_loss",
           "FusedVocabLoss", "target_logsumexp", "target_lse_argmax", "response_logsumexp", "response_targets",
           "token_to_draft", "CE_LABELS"]


@dataclass(frozen=True)
class LossWeights:
    """The objective's term weights (DeepSpec's defaults) and the position decay. Raising `ce` leans the
    drafter toward the target's argmax (greedy acceptance); `l1` matches whole distributions (T = 1)."""

    ce: float = 0.1
    l1: float = 0.9
    bce: float = 1.0
    decay: float = 4.0  #: position weight exp(-k / decay)

    def __post_init__(self):
        for name in ("ce", "l1", "bce", "decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"LossWeights.{name}: expected a finite number >= 0, found {value!r}")
        if self.decay <= 0:
            raise ConfigError(f"LossWeights.decay: expected > 0, found {self.decay!r}")
        if self.ce == 0 and self.l1 == 0:
            raise ConfigError("LossWeights: ce and l1 are both 0; the drafter's logits would get no gradient")


@dataclass
class TrainBatch:
    """B sequences padded to S, N anchors each.

    tokens [B, S] int64; aux [B, S, F] float32; last [B, S, H] float32; seq_lens [B] int64;
    anchors [B, N] int64 (0 where keep is False); keep [B, N] bool; labels [B, N, γ] int64;
    valid [B, N, γ] bool (contiguous prefix per block); t_lse [B, S] float32 or None: the target's
    full-vocabulary logsumexp per position (`target_logsumexp`; only the draft-vocabulary loss reads it);
    ce_labels [B, N, γ] int64 or None: CE's labels when they are not `labels` (the target's argmax,
    `make_batch(ce_labels="argmax")`).
    """

    tokens: torch.Tensor
    aux: torch.Tensor
    last: torch.Tensor
    seq_lens: torch.Tensor
    anchors: torch.Tensor
    keep: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor
    t_lse: torch.Tensor | None = None
    ce_labels: torch.Tensor | None = None


#: CE's label per draft slot: "token" (the sequence's next token) or "argmax" (the target's own argmax there)
CE_LABELS = ("token", "argmax")


def sample_anchors(prompt_len: int, length: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """Up to n anchor positions p, drawn without replacement, sorted: p is an assistant token
    (p >= prompt_len) with at least one assistant token after it (p <= length - 2) (reference §3)."""
    candidates = np.arange(prompt_len, length - 1)
    if len(candidates) > n:
        candidates = np.sort(rng.choice(candidates, size=n, replace=False))
    return candidates


def make_batch(seqs: list[Sequence_], anchors_per_seq: int, block_size: int, rng: np.random.Generator,
               ce_labels: str = "token") -> TrainBatch:
    """A batch of `seqs` with up to `anchors_per_seq` anchors each (`sample_anchors`). `ce_labels` "argmax" also
    fills `TrainBatch.ce_labels` from each sequence's `t_argmax` [T] (`response_targets`): slot k of anchor p
    is labelled with the target's argmax at position p + k, the row that predicts token p + k + 1.

    Raises:
        ConfigError: `ce_labels` is not one of `CE_LABELS`, or "argmax" with a sequence lacking `t_argmax`.
    """
    if ce_labels not in CE_LABELS:
        raise ConfigError(f"ce_labels: expected one of {list(CE_LABELS)}, found {ce_labels!r}")
    if ce_labels == "argmax" and any(getattr(s, "t_argmax", None) is None for s in seqs):
        raise ConfigError("ce_labels 'argmax': every sequence needs its target argmax (t_argmax, response_targets)")
    B, S, G = len(seqs), max(len(s.tokens) for s in seqs), block_size
    Fdim, H = seqs[0].aux.shape[1], seqs[0].last.shape[1]
    tokens = np.zeros((B, S), np.int64)
    aux = np.zeros((B, S, Fdim), np.float32)
    last = np.zeros((B, S, H), np.float32)
    anchors = np.zeros((B, anchors_per_seq), np.int64)
    keep = np.zeros((B, anchors_per_seq), bool)
    labels = np.zeros((B, anchors_per_seq, G), np.int64)
    argmax = np.zeros((B, anchors_per_seq, G), np.int64) if ce_labels == "argmax" else None
    valid = np.zeros((B, anchors_per_seq, G), bool)
    for b, s in enumerate(seqs):
        T = len(s.tokens)
        tokens[b, :T], aux[b, :T], last[b, :T] = s.tokens, s.aux, s.last
        a = sample_anchors(s.prompt_len, T, anchors_per_seq, rng)
        anchors[b, :len(a)], keep[b, :len(a)] = a, True
        idx = a[:, None] + 1 + np.arange(G)[None, :]  # [n, γ]
        ok = idx < T
        labels[b, :len(a)] = np.where(ok, s.tokens[np.minimum(idx, T - 1)], 0)
        if argmax is not None:
            argmax[b, :len(a)] = np.where(ok, s.t_argmax[np.minimum(idx - 1, T - 1)], 0)
        valid[b, :len(a)] = ok  # contiguous: idx grows with k
    t_lse = None
    if all(getattr(s, "t_lse", None) is not None for s in seqs):
        t_lse = np.zeros((B, S), np.float32)
        for b, s in enumerate(seqs):
            t_lse[b, :len(s.tokens)] = s.t_lse[:len(s.tokens)]
    t = torch.from_numpy
    return TrainBatch(t(tokens), t(aux), t(last), torch.tensor([len(s.tokens) for s in seqs]), t(anchors), t(keep),
                      t(labels), t(valid), None if t_lse is None else t(t_lse), None if argmax is None else t(argmax))


@torch.no_grad()
def target_lse_argmax(last: torch.Tensor, W: torch.Tensor, *, bf16: bool = False,
                      chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's full-vocabulary logsumexp and argmax per row: (lse_V(last·Wᵀ) [M] float32, argmax [M] int64,
    the first maximum) from last [M, H] (final hidden) and the LM head W [V, H], the matmul in bfloat16 when
    `bf16` (as `FusedVocabLoss` computes the target logits), in row chunks so [M, V] is never held."""
    last = last.reshape(-1, W.shape[1])
    Wc = W.to(torch.bfloat16) if bf16 else W.float()
    lse, top = torch.empty(last.shape[0]), torch.empty(last.shape[0], dtype=torch.long)
    with torch.autocast("cpu", enabled=False):
        for lo in range(0, last.shape[0], chunk):
            z = (last[lo:lo + chunk].to(Wc.dtype) @ Wc.T).float()
            lse[lo:lo + chunk], top[lo:lo + chunk] = torch.logsumexp(z, dim=-1), z.argmax(dim=-1)
    return lse, top


def target_logsumexp(last: torch.Tensor, W: torch.Tensor, *, bf16: bool = False, chunk: int = 256) -> torch.Tensor:
    """`target_lse_argmax`'s logsumexp [M] alone."""
    return target_lse_argmax(last, W, bf16=bf16, chunk=chunk)[0]


def response_targets(seq: Sequence_, W: torch.Tensor, *, bf16: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A sequence's `t_lse` [T] float32 and `t_argmax` [T] int64 for `make_batch`: `target_lse_argmax` on its
    response rows (from prompt_len on); +inf and 0 on its prompt rows. Why only the response: the loss reads
    them only at a block's target positions, anchor + 0..γ-1 with every kept anchor >= prompt_len
    (`sample_anchors`), and a third of the training tokens are prompt tokens; +inf gives q = 0 (finite
    losses) on the rows of padded anchors, which weigh 0."""
    lse, top = np.full(len(seq.tokens), np.inf, np.float32), np.zeros(len(seq.tokens), np.int64)
    start = min(int(seq.prompt_len), len(seq.tokens))
    if start < len(seq.tokens):
        a, b = target_lse_argmax(torch.as_tensor(np.asarray(seq.last[start:])), W, bf16=bf16)
        lse[start:], top[start:] = a.numpy(), b.numpy()
    return lse, top


def response_logsumexp(seq: Sequence_, W: torch.Tensor, *, bf16: bool = False) -> np.ndarray:
    """`response_targets`' t_lse alone."""
    return response_targets(seq, W, bf16=bf16)[0]


def token_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d [V] int64: the index of each token in d2t, −1 for a token outside it (the pooled bucket).

    Raises:
        ValueError: d2t is not 1-D, holds ids outside [0, V) or repeats one.
    """
    d2t = torch.as_tensor(d2t, dtype=torch.long)
    if d2t.ndim != 1 or not d2t.numel() or int(d2t.min()) < 0 or int(d2t.max()) >= vocab_size \
            or torch.unique(d2t).numel() != d2t.numel():
        raise ValueError(f"d2t: expected distinct token ids in [0, {vocab_size}) as a non-empty 1-D tensor, found "
                         f"shape {tuple(d2t.shape)}")
    t2d = torch.full((vocab_size,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(d2t.numel())
    return t2d


def block_forward(drafter: DSparkDrafter, batch: TrainBatch, *, logits: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All blocks of the batch in one pass → hidden [B, N, γ, H] (post final norm) and base logits
    U [B, N, γ, V] (float32; bf16 matmul when autocast is on), or None for U when ``logits`` is False."""
    cfg = drafter.config
    B, S = batch.tokens.shape
    N, G = batch.anchors.shape[1], cfg.block_size
    device = batch.tokens.device
    ctx = drafter.project_context(batch.aux)  # [B, S, H]
    ctx_cos, ctx_sin = drafter.rope_cos_sin(torch.arange(S, device=device).expand(B, S))
    block_pos = batch.anchors[:, :, None] + torch.arange(G, device=device)  # [B, N, γ]
    cos, sin = drafter.rope_cos_sin(block_pos.reshape(B, N * G))  # [B, Nγ, D]
    anchor_tok = torch.gather(batch.tokens, 1, batch.anchors)  # [B, N]
    block_ids = torch.full((B, N, G), cfg.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = anchor_tok
    h = drafter.embed_tokens(block_ids.reshape(B, N * G))  # [B, Nγ, H]
    # mask [B, 1, Nγ, S + Nγ]: context rows strictly before the anchor, plus the own block
    q_block = torch.arange(N * G, device=device) // G
    ctx_ok = torch.arange(S, device=device)[None, None, :] < batch.anchors.repeat_interleave(G, dim=1)[:, :, None]
    blk_ok = (q_block[:, None] == q_block[None, :]).expand(B, N * G, N * G)
    mask = torch.cat((ctx_ok, blk_ok), dim=2)[:, None]
    for layer in drafter.layers:
        attn = layer.self_attn
        ck, cv = attn.project_kv(ctx, ctx_cos, ctx_sin)  # [B, S, kvH, D]
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).unflatten(-1, (attn.num_heads, attn.head_dim))
        if attn.q_norm is not None:
            q = attn.q_norm(q)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, nh, Nγ, D]
        bk, bv = attn.project_kv(x, cos, sin)
        k = torch.cat((ck, bk), dim=1).transpose(1, 2)  # [B, kvH, S+Nγ, D]
        v = torch.cat((cv, bv), dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(B, N * G, attn.num_heads * attn.head_dim))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = drafter.norm(h).reshape(B, N, G, -1)
    return h, (drafter.lm_head(h) if logits else None)


class FusedVocabLoss(torch.autograd.Function):
    """Per-row CE and L1 over the vocabulary, computed in row chunks (see the module docstring).

    Forward inputs: h [M, H] float32 (draft hidden), W [V, H] float32 (frozen LM head, no gradient),
    a [M, r] float32 and W2 [V, r] float32 (Markov head: W1[prev] and W2; both may be empty, r = 0),
    t [M, H] float32 (target final hidden, no gradient), labels [M] int64, chunk (rows per chunk),
    bf16 (the two H-wide matmuls in bfloat16, as autocast would), t_lse [M] float32 or None, Wt [V, H] float32 or
    None (the head of the target's logits q when it is not W: `dspark_loss(target_head=)`). Outputs: ce [M]
    and l1 [M] float32 (differentiable), argmax [M] int64 of the draft logits and P_out [M] float32 (zeros
    without t_lse) (not differentiable). Saved
    for backward: p [M, V] in the matmul dtype and sign(p − q) [M, V] int8.

    Draft vocabulary (module docstring): W and W2 hold the N rows of d2t, labels are indices into d2t or
    −1 for the pooled bucket (ce 0, no CE gradient), and t_lse is the target's full-vocabulary logsumexp,
    so q = exp(t·Wᵀ − t_lse) sums to 1 − P_out and l1 adds P_out (constant in the drafter's tensors, so
    the gradients below are unchanged). t_lse None: q = softmax(t·Wᵀ), no bucket.

    Raises:
        ValueError: chunk is not an integer >= 1.

    With z = h·Wᵀ + a·W2ᵀ, p = softmax(z), q = softmax(t·Wtᵀ) (Wt = W unless given), s = sign(p − q):
        ce = logsumexp(z) − z[label]            ∂ce/∂z = p − onehot(label)
        l1 = Σ|p − q|                           ∂l1/∂z = p ⊙ (s − ⟨p, s⟩)
    and ∂/∂h = ∂/∂z·W, ∂/∂a = ∂/∂z·W2, ∂/∂W2 = (∂/∂z)ᵀ·a.
    """

    @staticmethod
    def _chunk(h, W, a, W2, t, lo, hi, t_lse=None, Wt=None):
        mm_dtype = W.dtype   # the caller passes W (and Wt) already in the matmul dtype
        z = (h[lo:hi].to(mm_dtype) @ W.T).float()
        if a.shape[1]:
            z = z + a[lo:hi] @ W2.T
        tz = (t[lo:hi].to(mm_dtype) @ (W if Wt is None else Wt).T).float()
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        p = torch.exp(z - lse)
        q = torch.softmax(tz, dim=-1) if t_lse is None else torch.exp(tz - t_lse[lo:hi, None])
        return z, lse, p, q

    @staticmethod
    def forward(ctx, h, W, a, W2, t, labels, chunk: int, bf16: bool, t_lse=None, Wt=None):
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"FusedVocabLoss: chunk must be an integer >= 1 rows, found {chunk!r}")
        M, V = h.shape[0], W.shape[0]
        inside = labels >= 0
        out_mass = torch.zeros(M)
        ce, l1, top = torch.empty(M), torch.empty(M), torch.empty(M, dtype=torch.long)
        # kept for the backward pass: p (in the matmul dtype), s = sign(p − q) as int8 (−1, 0, 1), ⟨p, s⟩
        keep_dtype = torch.bfloat16 if bf16 else torch.float32
        P, sign, ps = torch.empty(M, V, dtype=keep_dtype), torch.empty(M, V, dtype=torch.int8), torch.empty(M, 1)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            Wc = W.to(torch.bfloat16) if bf16 else W
            Wtc = None if Wt is None else (Wt.to(torch.bfloat16) if bf16 else Wt)
            for lo in range(0, M, chunk):
                hi = min(M, lo + chunk)
                z, lse, p, q = FusedVocabLoss._chunk(h, Wc, a, W2, t, lo, hi, t_lse, Wtc)
                ce[lo:hi] = torch.where(inside[lo:hi],
                                        lse[:, 0] - z.gather(1, labels[lo:hi, None].clamp(min=0))[:, 0], 0.0)
                d = p - q
                l1[lo:hi] = d.abs().sum(-1)
                if t_lse is not None:  # the pooled bucket: the target's mass outside the rows, the drafter's 0
                    out_mass[lo:hi] = (1 - q.sum(-1)).clamp(min=0)
                    l1[lo:hi] += out_mass[lo:hi]
                s = torch.sign(d)
                sign[lo:hi] = s
                ps[lo:hi] = (p * s).sum(-1, keepdim=True)
                P[lo:hi] = p
                top[lo:hi] = z.argmax(-1)
        ctx.save_for_backward(h, W, a, W2, labels, P, sign, ps)
        ctx.chunk, ctx.bf16 = chunk, bf16
        ctx.mark_non_differentiable(top, out_mass)
        return ce, l1, top, out_mass

    @staticmethod
    def backward(ctx, g_ce, g_l1, _g_top, _g_out_mass):
        h, W, a, W2, labels, P, sign, ps = ctx.saved_tensors
        M = h.shape[0]
        g_ce = torch.zeros(M) if g_ce is None else g_ce.float() * (labels >= 0)  # no CE gradient in the bucket
        g_l1 = torch.zeros(M) if g_l1 is None else g_l1.float()
        gh = torch.zeros_like(h)
        ga = torch.zeros_like(a)
        gW2 = torch.zeros_like(W2)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            Wc = W.to(torch.bfloat16) if ctx.bf16 else W
            for lo in range(0, M, ctx.chunk):
                hi = min(M, lo + ctx.chunk)
                p = P[lo:hi].float()
                # g_l1·(s − ⟨p, s⟩) + g_ce, with s ∈ {−1, 0, 1} as autograd's |·|' (0 where p = q)
                coef = g_l1[lo:hi, None] * (sign[lo:hi].float() - ps[lo:hi]) + g_ce[lo:hi, None]
                gz = p.mul_(coef)
                gz[torch.arange(hi - lo), labels[lo:hi].clamp(min=0)] -= g_ce[lo:hi]
                gh[lo:hi] = (gz.to(Wc.dtype) @ Wc).float()
                if a.shape[1]:
                    ga[lo:hi] = gz @ W2
                    gW2 += gz.T @ a[lo:hi]
        return gh, None, ga, gW2, None, None, None, None, None, None

def dspark_loss(drafter: DSparkDrafter, batch: TrainBatch, weights: LossWeights = LossWeights(),
                bf16: bool = False, *, fused: bool = True, chunk: int = 128,
                d2t: torch.Tensor | None = None, target_head: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Loss and metrics of one batch (formulas in the module docstring).

    Args:
        target_head: the head [V, H] of the target's distribution p_t (None = the drafter's shared head). Why:
            a quantized engine verifies with its own quantized head, whose argmax leaves the float head's at
            near-ties (`trainer.target_head_weight`); the batch's t_lse / ce_labels must come from the same head.
        d2t: the draft vocabulary [N] int64 (distinct token ids; None = the full vocabulary): logits and
            losses over its N rows plus the pooled bucket (module docstring). The batch's ``t_lse`` is used
            when present, else computed here from the full head (one [M, V] product, no gradient).
    Returns:
        (loss scalar, metrics: {"loss", "ce", "l1", "bce", "accept_rate" [γ] (mean analytic α_k),
        "top1" [γ] (argmax(draft) == label), "tau_probabilistic", "weight"}; with d2t also
        "bucket_labels" (weighted share of labels outside d2t) and "bucket_mass" (weighted mean P_out)).
    Raises:
        ValueError: d2t is not a set of token ids of this vocabulary.
    """
    cfg = drafter.config
    G = cfg.block_size
    prev = torch.cat((torch.gather(batch.tokens, 1, batch.anchors)[:, :, None], batch.labels[:, :, :-1]), dim=2)
    pos = (batch.anchors[:, :, None] + torch.arange(G)).clamp(max=batch.tokens.shape[1] - 1)
    t_hidden = torch.gather(batch.last, 1, pos.reshape(pos.shape[0], -1, 1).expand(-1, -1, batch.last.shape[-1]))
    valid = (batch.valid & batch.keep[:, :, None]).float()
    w = valid * torch.exp(-torch.arange(G, dtype=torch.float32) / weights.decay)
    wsum = w.sum().clamp(min=1e-6)
    w1_prev = drafter.markov_head.markov_w1(prev) if drafter.markov_head is not None else None  # [B, N, γ, r]
    labels = batch.labels if batch.ce_labels is None else batch.ce_labels   # CE's labels (module docstring)
    bucket = None
    if d2t is not None:
        d2t = torch.as_tensor(d2t, dtype=torch.long)
        labels = token_to_draft(d2t, cfg.vocab_size)[labels]  # −1: the pooled bucket
    if fused:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            hidden, _ = block_forward(drafter, batch, logits=False)
        hidden = hidden.float()
        H, V = hidden.shape[-1], cfg.vocab_size
        W = drafter.lm_head.weight.detach()
        if drafter.markov_head is not None:
            a, W2 = w1_prev.reshape(-1, cfg.markov_rank), drafter.markov_head.markov_w2.weight
        else:
            a, W2 = hidden.new_zeros(hidden.shape[:-1].numel(), 0), hidden.new_zeros(V, 0)
        t_flat, t_lse = t_hidden.reshape(-1, H).float(), None
        Wt = None if target_head is None else target_head.detach().float()
        if d2t is not None:
            full_t = drafter.lm_head.weight.detach() if Wt is None else Wt
            W, W2 = W[d2t], W2.index_select(0, d2t)  # autograd scatters W2's gradient back to its d2t rows
            Wt = None if Wt is None else Wt[d2t]
            if batch.t_lse is not None:
                t_lse = torch.gather(batch.t_lse, 1, pos.reshape(pos.shape[0], -1)).reshape(-1)
            else:
                t_lse = target_logsumexp(t_flat, full_t, bf16=bf16, chunk=chunk)
        ce, l1, top, out_mass = FusedVocabLoss.apply(hidden.reshape(-1, H), W, a, W2, t_flat, labels.reshape(-1),
                                                     chunk, bf16, t_lse, Wt)
        ce, l1, argmax = ce.reshape(w.shape), l1.reshape(w.shape), top.reshape(w.shape)
        if d2t is not None:
            bucket = out_mass.reshape(w.shape)
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            hidden, U = block_forward(drafter, batch)
            logits = U.float()
            if drafter.markov_head is not None:
                logits = logits + drafter.markov_head(prev).float()
            with torch.no_grad():
                t_logits = (drafter.lm_head(t_hidden) if target_head is None else
                            t_hidden.float() @ target_head.detach().float().T).float().reshape(logits.shape)
        p_t = torch.softmax(t_logits, dim=-1)
        if d2t is not None:
            logits, p_t = logits[..., d2t], p_t[..., d2t]
            bucket = (1 - p_t.sum(-1)).clamp(min=0)
        logp_d = torch.log_softmax(logits, dim=-1)
        inside = labels >= 0
        ce = torch.where(inside, F.nll_loss(logp_d.reshape(-1, logp_d.shape[-1]), labels.clamp(min=0).reshape(-1),
                                            reduction="none").reshape(w.shape), 0.0)
        l1 = (logp_d.exp() - p_t).abs().sum(-1)  # [B, N, γ], in [0, 2]
        if bucket is not None:
            l1 = l1 + bucket
        argmax = logits.argmax(-1)
    if d2t is not None:
        argmax = d2t[argmax]  # back to token ids
    alpha = (1 - 0.5 * l1).clamp(0, 1).detach()
    loss = weights.ce * (w * ce).sum() / wsum + weights.l1 * (w * l1).sum() / wsum
    metrics = {"ce": float((w * ce).sum().detach() / wsum), "l1": float((w * l1).sum().detach() / wsum)}
    if drafter.confidence_head is not None and weights.bce > 0:
        conf_in = hidden.float()
        if cfg.confidence_head_with_markov and drafter.markov_head is not None:
            conf_in = torch.cat((conf_in, w1_prev.float()), dim=-1)
        z = drafter.confidence_head(conf_in)
        bce = F.binary_cross_entropy_with_logits(z, alpha, reduction="none")
        loss = loss + weights.bce * (w * bce).sum() / wsum
        metrics["bce"] = float((w * bce).sum().detach() / wsum)
    with torch.no_grad():
        vsum = valid.sum((0, 1)).clamp(min=1)
        accept = (alpha * valid).sum((0, 1)) / vsum
        top1 = ((argmax == batch.labels).float() * valid).sum((0, 1)) / vsum
        surv = torch.cumprod(alpha * valid, dim=-1).sum(-1)  # expected accepted drafts per block
        kept = batch.keep.float()
        tau = float(((1 + surv) * kept).sum() / kept.sum().clamp(min=1))
    metrics.update(loss=float(loss.detach()), accept_rate=[round(float(x), 4) for x in accept],
                   top1=[round(float(x), 4) for x in top1], tau_probabilistic=tau, weight=float(wsum))
    if bucket is not None:
        metrics["bucket_labels"] = float((w * (labels < 0)).sum() / wsum)
        metrics["bucket_mass"] = float((w * bucket.detach()).sum() / wsum)
    if not math.isfinite(metrics["loss"]):
        raise FloatingPointError(f"dspark_loss: non-finite loss {metrics}")
    return loss, metrics
