"""``dspark::MarkovDraft`` as a Triton kernel: one program per request, the γ slots in a loop.

I/O contract: the table in ``markov_draft/schema.py``; the numpy reference (``reference.py``) is the
spec, and with the same uniforms the kernel makes the same choices (numerics: ``triton_sampling.py``).
Everything runs on the device; the host only checks the inputs and allocates the outputs.

    program r:  prev = anchor_ids[r]
    for k in 0..γ-1:
        confidence[r,k] = σ((h_k·w[:H] + W1[prev]·w[H:] + b) / T_k)      (1 without confidence weights)
        L_k = U_k + W2·W1[prev], blockwise over Vd → draft_logits[r,k]  (U_k without Markov weights)
        j_k = argmax L_k (temperature 0) or sample(warp(L_k), u[r,k])   (``triton_sampling``, re-reading L_k)
        x_k = j_k, or d2t[j_k] with a draft vocabulary (a target id); draft_ids[r,k] = x_k; prev = x_k

Gate: ``triton_support.has_triton()``. Importing this module imports triton. With
``TRITON_INTERPRET=1`` set before triton is first imported in the process, the kernel runs on CPU
tensors in Triton's interpreter (tests/plugins/triton_interpreter.py).
Dimension letters: R requests, γ draft slots, V vocab, Vd draft vocabulary (= V without d2t), H hidden
size, r Markov rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dspark_export.plugins.common.sampling import SamplingBatch
from dspark_export.plugins.markov_draft.reference import check_arguments, preset_dims  # the reference's own checks
from dspark_export.plugins.markov_draft.schema import SCHEMA
from dspark_export.plugins.common.triton_sampling import sample_row, warp_stats
from dspark_export.plugins.common.triton_support import (
    check_blocks, check_same_device, compile_ptx, host_values, next_power_of_2, shape_proxies,
)

DEFAULT_BLOCK_V = 1024
"""Vocab block of one step of a program (a power of two; tests use 16 to exercise the masked tail)."""
DEFAULT_NUM_PROBES = 8
"""Probes per pass of the top-k/top-p searches (``triton_sampling``): at most 11 passes each, not 33."""
_MAX_BLOCK_H = 256
_VALUE_INPUTS = ("anchor_ids", "temperature", "top_k", "top_p", "uniforms", "d2t")
"""Inputs whose values (not only shapes) the boundary check reads; copied to the host when checking."""


class MarkovDraftTritonOutputs(NamedTuple):
    """draft_ids: [R, γ] int64; draft_logits: [R, γ, Vd] float32 (before warping); confidence: [R, γ] float32."""

    draft_ids: torch.Tensor
    draft_logits: torch.Tensor
    confidence: torch.Tensor


@triton.jit
def markov_draft_kernel(
    base_logits_ptr, hidden_ptr, anchor_ids_ptr, temperature_ptr, top_k_ptr, top_p_ptr, uniforms_ptr,
    confidence_temperature_ptr, markov_w1_ptr, markov_w2_ptr, confidence_weight_ptr, confidence_bias_ptr, d2t_ptr,
    draft_ids_ptr, draft_logits_ptr, confidence_ptr,
    GAMMA, VD, H, RANK,
    HAS_MARKOV: tl.constexpr, HAS_CONFIDENCE: tl.constexpr, HAS_D2T: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, NUM_PROBES: tl.constexpr,
):
    """One program per request row: draft γ tokens left to right (see the module docstring)."""
    request = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + request)
    top_k = tl.load(top_k_ptr + request)
    top_p = tl.load(top_p_ptr + request)
    prev = tl.load(anchor_ids_ptr + request)
    offs_v0 = tl.arange(0, BLOCK_V)
    offs_h0 = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < RANK
    for slot in range(0, GAMMA):
        row = request * GAMMA + slot
        if HAS_MARKOV:
            w1_prev = tl.load(markov_w1_ptr + prev * RANK + offs_r, mask=mask_r, other=0.0)  # W1[x_{k-1}]
        conf = tl.full((), 1.0, tl.float32)
        if HAS_CONFIDENCE:
            z = tl.full((), 0.0, tl.float32)
            for h_start in range(0, H, BLOCK_H):
                offs_h = h_start + offs_h0
                mask_h = offs_h < H
                h = tl.load(hidden_ptr + row * H + offs_h, mask=mask_h, other=0.0)
                w = tl.load(confidence_weight_ptr + offs_h, mask=mask_h, other=0.0)
                z += tl.sum(h * w, 0)
            if HAS_MARKOV:
                z += tl.sum(w1_prev * tl.load(confidence_weight_ptr + H + offs_r, mask=mask_r, other=0.0), 0)
            z = tl.math.div_rn(z + tl.load(confidence_bias_ptr), tl.load(confidence_temperature_ptr + slot))
            conf = tl.math.div_rn(1.0, 1.0 + tl.exp(-z))
        tl.store(confidence_ptr + row, conf)
        logits_row = draft_logits_ptr + row * VD
        for start in range(0, VD, BLOCK_V):  # L_k = U_k + W2·W1[prev], written once, re-read by the warp
            offs = start + offs_v0
            mask = offs < VD
            logits = tl.load(base_logits_ptr + row * VD + offs, mask=mask, other=0.0)
            if HAS_MARKOV:
                w2 = tl.load(markov_w2_ptr + offs[:, None] * RANK + offs_r[None, :],
                             mask=mask[:, None] & mask_r[None, :], other=0.0)
                logits = logits + tl.sum(w2 * w1_prev[None, :], 1)
            tl.store(logits_row + offs, logits, mask=mask)
        tl.debug_barrier()  # the warp passes below read L_k back, possibly in other threads of the program
        stats = warp_stats(logits_row, VD, temperature, top_k, top_p, BLOCK_V, NUM_PROBES)
        token = stats[1]  # greedy: the first argmax
        if temperature > 0:
            uniform = tl.load(uniforms_ptr + row)
            token = sample_row(logits_row, stats, logits_row, stats, uniform, VD, BLOCK_V, False)
        if HAS_D2T:
            token = tl.load(d2t_ptr + token)  # draft row -> target id
        tl.store(draft_ids_ptr + row, token)
        prev = token


def markov_draft_triton(
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchor_ids: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    confidence_temperature: torch.Tensor,
    markov_w1: torch.Tensor | None = None,
    markov_w2: torch.Tensor | None = None,
    confidence_weight: torch.Tensor | None = None,
    confidence_bias: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    *,
    block_v: int = DEFAULT_BLOCK_V,
    num_probes: int = DEFAULT_NUM_PROBES,
    check_values: bool = True,
) -> MarkovDraftTritonOutputs:
    """``reference.markov_draft`` on torch tensors (schema inputs in schema order) with the Triton kernel.

    Args:
        base_logits ... d2t: the schema inputs (see ``schema.py``), torch tensors on one
            device (a CUDA device, or the CPU under ``TRITON_INTERPRET=1``); give both or neither of each
            optional pair, and d2t only with the Markov pair. Inputs are never modified.
        block_v: vocab block per step (a power of two >= 16).
        num_probes: probes per pass of the top-k/top-p searches (a power of two); more probes, fewer passes.
        check_values: also check value ranges (temperature, top_k, top_p, uniforms, anchor ids) as the
            reference does; this copies those small [R]/[R, γ] inputs and d2t to the host (a device sync).
            Shapes, dtypes and the optional pairs are always checked, without a copy. Unchecked bad
            values are undefined behaviour (an anchor id >= V reads out of bounds).

    Returns:
        ``MarkovDraftTritonOutputs`` (draft_ids, draft_logits, confidence) on the inputs' device.

    Raises:
        PluginError: an input breaks the schema (as the reference raises it) or block_v is invalid.
    """
    tensors = dict(base_logits=base_logits, hidden=hidden, anchor_ids=anchor_ids, temperature=temperature, top_k=top_k,
                   top_p=top_p, uniforms=uniforms, confidence_temperature=confidence_temperature, markov_w1=markov_w1,
                   markov_w2=markov_w2, confidence_weight=confidence_weight, confidence_bias=confidence_bias,
                   d2t=d2t)
    name = SCHEMA.qualified_name
    check_blocks(name, block_v, num_probes)
    feeds = shape_proxies(name, tensors)
    check_same_device(name, tensors)
    if check_values:
        feeds.update(host_values(tensors, tuple(n for n in _VALUE_INPUTS if tensors[n] is not None)))
    # The reference's own checks (optional pairs, schema, values). Without check_values the value
    # inputs are the zero stand-ins, which pass, so only shapes, dtypes and pairs are checked.
    check_arguments(feeds, SamplingBatch(feeds["temperature"], feeds["top_k"], feeds["top_p"]), feeds["uniforms"])
    num_requests, gamma, draft_vocab = base_logits.shape
    hidden_size = hidden.shape[-1]
    has_markov, has_confidence, has_d2t = markov_w1 is not None, confidence_weight is not None, d2t is not None
    rank = markov_w1.shape[1] if has_markov else 0
    device = base_logits.device
    draft_ids = torch.empty((num_requests, gamma), dtype=torch.int64, device=device)
    draft_logits = torch.empty((num_requests, gamma, draft_vocab), dtype=torch.float32, device=device)
    confidence = torch.empty((num_requests, gamma), dtype=torch.float32, device=device)
    if num_requests == 0:
        return MarkovDraftTritonOutputs(draft_ids, draft_logits, confidence)
    contiguous = {key: (value.contiguous() if value is not None else base_logits) for key, value in tensors.items()}
    markov_draft_kernel[(num_requests,)](
        *contiguous.values(), draft_ids, draft_logits, confidence,
        gamma, draft_vocab, hidden_size, rank,
        HAS_MARKOV=has_markov, HAS_CONFIDENCE=has_confidence, HAS_D2T=has_d2t, BLOCK_V=block_v, NUM_PROBES=num_probes,
        BLOCK_H=min(next_power_of_2(hidden_size), _MAX_BLOCK_H), BLOCK_R=next_power_of_2(rank),
    )
    return MarkovDraftTritonOutputs(draft_ids, draft_logits, confidence)


def run(feeds: Mapping[str, torch.Tensor], **options) -> dict[str, torch.Tensor]:
    """``markov_draft_triton`` over a feed keyed by the schema's input names (absent optional inputs omitted).

    Args:
        feeds: input name -> torch tensor.
        **options: ``block_v``, ``num_probes``, ``check_values`` of ``markov_draft_triton``.

    Returns:
        {"draft_ids": [R, γ] int64, "draft_logits": [R, γ, Vd] float32, "confidence": [R, γ] float32}.
    """
    # Unknown names and missing inputs raise the schema's PluginError, not a TypeError.
    SCHEMA.check_inputs(shape_proxies(SCHEMA.qualified_name, feeds), preset_dims(feeds))
    return markov_draft_triton(**feeds, **options)._asdict()


def ptx(
    has_markov: bool = True,
    has_confidence: bool = True,
    block_v: int = DEFAULT_BLOCK_V,
    block_h: int = _MAX_BLOCK_H,
    block_r: int = 16,
    num_probes: int = DEFAULT_NUM_PROBES,
    capability: int = 90,
    has_d2t: bool = False,
) -> str:
    """PTX of ``markov_draft_kernel`` for one static configuration, compiled without a GPU (see ``compile_ptx``)."""
    pointers = {name: "*i64" if SCHEMA.input(name).dtype.kind == "i" else "*fp32" for name in SCHEMA.input_names}
    signature = {f"{name}_ptr": kind for name, kind in pointers.items()}
    signature.update(draft_ids_ptr="*i64", draft_logits_ptr="*fp32", confidence_ptr="*fp32",
                     GAMMA="i32", VD="i32", H="i32", RANK="i32")
    constexprs = dict(HAS_MARKOV=has_markov, HAS_CONFIDENCE=has_confidence, HAS_D2T=has_d2t, BLOCK_V=block_v,
                      BLOCK_H=block_h,
                      BLOCK_R=block_r, NUM_PROBES=num_probes)
    signature.update({name: "constexpr" for name in constexprs})
    return compile_ptx(markov_draft_kernel, signature, constexprs, capability)


@triton.jit
def markov_draft_trt_kernel(
    base_logits_ptr, hidden_ptr, anchor_ids_ptr, temperature_ptr, top_k_ptr, top_p_ptr, uniforms_ptr,
    confidence_temperature_ptr, markov_w1_ptr, markov_w2_ptr, confidence_weight_ptr, confidence_bias_ptr,
    GAMMA, V, H, RANK,
    draft_ids_ptr, draft_logits_ptr, confidence_ptr,
    HAS_MARKOV: tl.constexpr, HAS_CONFIDENCE: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, NUM_PROBES: tl.constexpr,
):
    """``markov_draft_kernel`` with TensorRT's argument order (inputs, scalars, outputs); grid (R,).

    The plugin takes the full-vocabulary form (``tensorrt.PLUGIN_SCHEMA``: no d2t, Vd = V); the lowering
    expands a d2t node to it."""
    markov_draft_kernel(
        base_logits_ptr, hidden_ptr, anchor_ids_ptr, temperature_ptr, top_k_ptr, top_p_ptr, uniforms_ptr,
        confidence_temperature_ptr, markov_w1_ptr, markov_w2_ptr, confidence_weight_ptr, confidence_bias_ptr,
        anchor_ids_ptr,  # d2t: never read (HAS_D2T False)
        draft_ids_ptr, draft_logits_ptr, confidence_ptr, GAMMA, V, H, RANK,
        HAS_MARKOV, HAS_CONFIDENCE, False, BLOCK_V, BLOCK_H, BLOCK_R, NUM_PROBES,
    )
