"""``dspark::SpeculativeVerify`` as a Triton kernel: one program per request, ragged rows by query_start.

I/O contract: the table in ``speculative_verify/schema.py``; the numpy reference (``reference.py``) is
the spec, and with the same uniforms the kernel makes the same choices (numerics: ``triton_sampling.py``).
Everything runs on the device; the host only checks the inputs and allocates the outputs.

    program r:  s = query_start[r], n = verify_lens[r], a = 0
    loop:  p = warp(target_logits[s + a])                   (stops at the first rejection or at a = n)
           if a < n:  q = warp(draft_logits[r, a]), x = draft_ids[r, a]
                      accepted = u[r, a]·q(x) < p(x);  a += accepted
    num_accepted[r] = a                                     (p and q of row a are the loop's last ones)
    temperature 0:  next_ids[r] = argmax target_logits[s + a]
    a < n (rejected): next = sample(max(p_a − q_a, 0), u[r, γ]), or sample(p_a, u[r, γ]) if that is all zero
    a == n (bonus):   next = sample(p_a, u[r, γ])

Rows past the first rejection are never read, and no row is warped twice. Greedy needs no special
acceptance code: warp gives one-hot p and q, and u·q(x) < p(x) holds iff x == argmax p (u < 1), as in
the reference.
Gate: ``triton_support.has_triton()``. Importing this module imports triton. With
``TRITON_INTERPRET=1`` set before triton is first imported in the process, the kernel runs on CPU
tensors in Triton's interpreter (tests/plugins/triton_interpreter.py).
Dimension letters: R requests, γ draft slots, V vocab, M target logit rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dspark_export.plugins.common.sampling import SamplingBatch
from dspark_export.plugins.speculative_verify.reference import check_arguments  # the reference's own checks
from dspark_export.plugins.speculative_verify.schema import SCHEMA
from dspark_export.plugins.common.triton_sampling import no_stats, probs_at, residual_is_positive, sample_row, warp_stats
from dspark_export.plugins.common.triton_support import (
    check_blocks, check_same_device, compile_ptx, host_values, shape_proxies,
)

DEFAULT_BLOCK_V = 1024
"""Vocab block of one step of a program (a power of two; tests use 16 to exercise the masked tail)."""
DEFAULT_NUM_PROBES = 8
"""Probes per pass of the top-k/top-p searches (``triton_sampling``): at most 11 passes each, not 33."""
_VALUE_INPUTS = ("query_start", "draft_ids", "verify_lens", "temperature", "top_k", "top_p", "uniforms")
"""Inputs whose values (not only shapes) the boundary check reads; copied to the host when checking."""


class VerifyTritonOutputs(NamedTuple):
    """num_accepted: [R] int64, the leading accepted run; next_ids: [R] int64, recovered or bonus token."""

    num_accepted: torch.Tensor
    next_ids: torch.Tensor


@triton.jit
def speculative_verify_kernel(
    target_logits_ptr, query_start_ptr, draft_ids_ptr, draft_logits_ptr, verify_lens_ptr,
    temperature_ptr, top_k_ptr, top_p_ptr, uniforms_ptr,
    num_accepted_ptr, next_ids_ptr,
    GAMMA, V,
    BLOCK_V: tl.constexpr, NUM_PROBES: tl.constexpr,
):
    """One program per request: the leading accepted run, then the residual or bonus token."""
    request = tl.program_id(0).to(tl.int64)
    first_row = tl.load(query_start_ptr + request)
    verify_len = tl.load(verify_lens_ptr + request)
    temperature = tl.load(temperature_ptr + request)
    top_k = tl.load(top_k_ptr + request)
    top_p = tl.load(top_p_ptr + request)
    uniforms_row = uniforms_ptr + request * (GAMMA + 1)
    num_accepted = tl.full((), 0, tl.int64)
    p_stats = no_stats()
    q_stats = no_stats()
    is_running = True
    while is_running:  # visits rows 0..a: p of target row a and, while a < n, q of draft row a
        target_row = target_logits_ptr + (first_row + num_accepted) * V
        draft_row = draft_logits_ptr + (request * GAMMA + num_accepted) * V
        p_stats = warp_stats(target_row, V, temperature, top_k, top_p, BLOCK_V, NUM_PROBES)
        is_running = num_accepted < verify_len
        if is_running:
            q_stats = warp_stats(draft_row, V, temperature, top_k, top_p, BLOCK_V, NUM_PROBES)
            draft = tl.load(draft_ids_ptr + request * GAMMA + num_accepted)
            p_draft, q_draft = probs_at(target_row, p_stats, draft_row, q_stats, draft, V, BLOCK_V)
            is_running = tl.load(uniforms_row + num_accepted) * q_draft < p_draft
            num_accepted += is_running.to(tl.int64)
    tl.store(num_accepted_ptr + request, num_accepted)

    # p_stats (and, when rejected, q_stats) now belong to row a = num_accepted.
    target_row = target_logits_ptr + (first_row + num_accepted) * V
    draft_row = draft_logits_ptr + (request * GAMMA + num_accepted) * V
    next_id = p_stats[1]  # greedy: argmax of target row a (what sampling the one-hot residual or p gives)
    if temperature > 0:
        uniform = tl.load(uniforms_row + GAMMA)
        use_residual = num_accepted < verify_len  # rejected: the residual, unless it is all zero
        if use_residual:
            use_residual = residual_is_positive(target_row, p_stats, draft_row, q_stats, V, BLOCK_V)
        if use_residual:
            next_id = sample_row(target_row, p_stats, draft_row, q_stats, uniform, V, BLOCK_V, True)
        else:  # the bonus sample (all verified drafts accepted), or p when the residual is all zero
            next_id = sample_row(target_row, p_stats, target_row, p_stats, uniform, V, BLOCK_V, False)
    tl.store(next_ids_ptr + request, next_id)


def speculative_verify_triton(
    target_logits: torch.Tensor,
    query_start: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_logits: torch.Tensor,
    verify_lens: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    block_v: int = DEFAULT_BLOCK_V,
    num_probes: int = DEFAULT_NUM_PROBES,
    check_values: bool = True,
) -> VerifyTritonOutputs:
    """``reference.speculative_verify`` on torch tensors (schema inputs in schema order) with the Triton kernel.

    Args:
        target_logits ... uniforms: the schema inputs (see ``schema.py``), torch tensors on one device
            (a CUDA device, or the CPU under ``TRITON_INTERPRET=1``). Inputs are never modified.
        block_v: vocab block per step (a power of two >= 16).
        num_probes: probes per pass of the top-k/top-p searches (a power of two); more probes, fewer passes.
        check_values: also check values as the reference does (sampling ranges, verify_lens in
            [0, γ], query_start widths and bounds, verified draft ids in [0, V)); this copies the small
            [R]/[R, γ] inputs to the host (a device sync). Shapes and dtypes are always checked, without
            a copy. Unchecked bad values are undefined behaviour (rows or ids out of bounds).

    Returns:
        ``VerifyTritonOutputs`` (num_accepted, next_ids) on the inputs' device.

    Raises:
        PluginError: an input breaks the schema (as the reference raises it) or block_v is invalid.
    """
    tensors = dict(target_logits=target_logits, query_start=query_start, draft_ids=draft_ids, draft_logits=draft_logits,
                   verify_lens=verify_lens, temperature=temperature, top_k=top_k, top_p=top_p, uniforms=uniforms)
    name = SCHEMA.qualified_name
    check_blocks(name, block_v, num_probes)
    feeds = shape_proxies(name, tensors)
    check_same_device(name, tensors)
    if check_values:
        feeds.update(host_values(tensors, _VALUE_INPUTS))
        check_arguments(**_reference_arguments(feeds))  # the reference's own checks: schema, then values
    else:
        SCHEMA.check_inputs(feeds)
    num_requests, gamma = draft_ids.shape
    device = target_logits.device
    num_accepted = torch.empty((num_requests,), dtype=torch.int64, device=device)
    next_ids = torch.empty((num_requests,), dtype=torch.int64, device=device)
    if num_requests == 0:
        return VerifyTritonOutputs(num_accepted, next_ids)
    speculative_verify_kernel[(num_requests,)](
        *(tensor.contiguous() for tensor in tensors.values()), num_accepted, next_ids,
        gamma, target_logits.shape[1], BLOCK_V=block_v, NUM_PROBES=num_probes,
    )
    return VerifyTritonOutputs(num_accepted, next_ids)


def run(feeds: Mapping[str, torch.Tensor], **options) -> dict[str, torch.Tensor]:
    """``speculative_verify_triton`` over a feed keyed by the schema's input names.

    Args:
        feeds: input name -> torch tensor.
        **options: ``block_v``, ``num_probes``, ``check_values`` of ``speculative_verify_triton``.

    Returns:
        {"num_accepted": [R] int64, "next_ids": [R] int64}.
    """
    # Unknown names and missing inputs raise the schema's PluginError, not a TypeError.
    SCHEMA.check_inputs(shape_proxies(SCHEMA.qualified_name, feeds))
    return speculative_verify_triton(**feeds, **options)._asdict()


def ptx(block_v: int = DEFAULT_BLOCK_V, num_probes: int = DEFAULT_NUM_PROBES, capability: int = 90) -> str:
    """PTX of ``speculative_verify_kernel``, compiled without a GPU (see ``triton_support.compile_ptx``)."""
    signature = {f"{spec.name}_ptr": "*i64" if spec.dtype.kind == "i" else "*fp32" for spec in SCHEMA.inputs}
    signature.update(num_accepted_ptr="*i64", next_ids_ptr="*i64", GAMMA="i32", V="i32", BLOCK_V="constexpr",
                     NUM_PROBES="constexpr")
    return compile_ptx(speculative_verify_kernel, signature, {"BLOCK_V": block_v, "NUM_PROBES": num_probes}, capability)


def _reference_arguments(feeds: dict) -> dict:
    """The reference check's arguments from a feed keyed by input name."""
    sampling = SamplingBatch(feeds["temperature"], feeds["top_k"], feeds["top_p"])
    names = ("target_logits", "query_start", "draft_ids", "draft_logits", "verify_lens")
    return dict({name: feeds[name] for name in names}, sampling=sampling, uniforms=feeds["uniforms"])


@triton.jit
def speculative_verify_trt_kernel(
    target_logits_ptr, query_start_ptr, draft_ids_ptr, draft_logits_ptr, verify_lens_ptr,
    temperature_ptr, top_k_ptr, top_p_ptr, uniforms_ptr,
    GAMMA, V,
    num_accepted_ptr, next_ids_ptr,
    BLOCK_V: tl.constexpr, NUM_PROBES: tl.constexpr,
):
    """``speculative_verify_kernel`` with TensorRT's argument order (inputs, scalars, outputs); grid (R,)."""
    speculative_verify_kernel(
        target_logits_ptr, query_start_ptr, draft_ids_ptr, draft_logits_ptr, verify_lens_ptr,
        temperature_ptr, top_k_ptr, top_p_ptr, uniforms_ptr, num_accepted_ptr, next_ids_ptr, GAMMA, V,
        BLOCK_V, NUM_PROBES,
    )
