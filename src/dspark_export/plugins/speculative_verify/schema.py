"""``dspark::SpeculativeVerify`` (version 1): the single source of truth of its contract.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; DSpark paper §2; DeepSpec
``verify_draft_tokens``, deepspec_reference.md §2.5). Request r's target rows are
query_start[r] .. query_start[r]+verify_lens[r]. Draft j < verify_lens[r] is accepted iff
u[r,j]·q_j(x_j) < p_j(x_j) (greedy: x_j == argmax p_j); num_accepted is the leading accepted run a.
next_ids: the residual sample ∝ max(p_a − q_a, 0) with u[r,γ] when a < verify_lens[r] (p_a if the
residual is all zero), else the bonus sample from p_a; greedy: argmax of target row a.

| name | shape | dtype | meaning |
| --- | --- | --- | --- |
| in `target_logits` | [M, V] | float32 | target logits; request r owns rows query_start[r] .. query_start[r]+verify_lens[r] |
| in `query_start` | [R+1] | int64 | cumulative verify widths: query_start[r+1] - query_start[r] == verify_lens[r] + 1 |
| in `draft_ids` | [R, γ] | int64 | drafted tokens (entries at j ≥ verify_lens[r] are ignored) |
| in `draft_logits` | [R, γ, V] | float32 | logits each draft was drawn from (before warping) |
| in `verify_lens` | [R] | int64 | drafts to verify per request, 0 ≤ verify_lens[r] ≤ γ |
| in `temperature` | [R] | float32 | 0 = greedy |
| in `top_k` | [R] | int64 | 0 = off |
| in `top_p` | [R] | float32 | 1 = off |
| in `uniforms` | [R, γ+1] | float32 | u[r, j] for the acceptance test of draft j; u[r, γ] for the residual or bonus sample |
| out `num_accepted` | [R] | int64 | length of the leading accepted run (≤ verify_lens[r]) |
| out `next_ids` | [R] | int64 | recovered (residual) or bonus token, the next anchor |
"""

from __future__ import annotations

import numpy as np

from dspark_export.plugins.common import DOMAIN, OPSET_VERSION
from dspark_export.plugins.common.contract import OpSchema, TensorSpec

F32, I64 = np.float32, np.int64

SCHEMA = OpSchema(
    op_type="SpeculativeVerify",
    domain=DOMAIN,
    version=OPSET_VERSION,
    inputs=(
        TensorSpec("target_logits", ("M", "V"), F32,
                   "target logits; request r owns rows query_start[r] .. query_start[r]+verify_lens[r]"),
        TensorSpec("query_start", ("R+1",), I64,
                   "cumulative verify widths: query_start[r+1] - query_start[r] == verify_lens[r] + 1"),
        TensorSpec("draft_ids", ("R", "γ"), I64, "drafted tokens (entries at j ≥ verify_lens[r] are ignored)"),
        TensorSpec("draft_logits", ("R", "γ", "V"), F32, "logits each draft was drawn from (before warping)"),
        TensorSpec("verify_lens", ("R",), I64, "drafts to verify per request, 0 ≤ verify_lens[r] ≤ γ"),
        TensorSpec("temperature", ("R",), F32, "0 = greedy"),
        TensorSpec("top_k", ("R",), I64, "0 = off"),
        TensorSpec("top_p", ("R",), F32, "1 = off"),
        TensorSpec("uniforms", ("R", "γ+1"), F32,
                   "u[r, j] for the acceptance test of draft j; u[r, γ] for the residual or bonus sample"),
    ),
    outputs=(
        TensorSpec("num_accepted", ("R",), I64, "length of the leading accepted run (≤ verify_lens[r])"),
        TensorSpec("next_ids", ("R",), I64, "recovered (residual) or bonus token, the next anchor"),
    ),
    doc=__doc__.split("\n\n")[1],
)
