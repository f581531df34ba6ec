"""Export verify.onnx: one `dspark::SpeculativeVerify` node (plugins/speculative_verify).

I/O contract (R requests, M = Σ(verify_lens+1) target rows, γ block size, V vocab): the op's
schema, `plugins/speculative_verify/schema.py`:

| name | shape | dtype | meaning |
| --- | --- | --- | --- |
| in `target_logits` | [M, V] | float32 | target logits of the verification rows, request after request |
| in `query_start` | [R+1] | int64 | cumulative rows per request (verify_lens + 1 each) |
| in `draft_ids` | [R, γ] | int64 | drafted tokens |
| in `draft_logits` | [R, γ, V] | float32 | logits each draft was drawn from |
| in `verify_lens` | [R] | int64 | drafts verified per request, 0..γ |
| in `temperature`, `top_p` | [R] | float32 | sampling parameters |
| in `top_k` | [R] | int64 | 0 = off |
| in `uniforms` | [R, γ+1] | float32 | acceptance uniforms, last one for the recovered/bonus sample |
| out `num_accepted` | [R] | int64 | leading accepted drafts |
| out `next_ids` | [R] | int64 | recovered (on rejection) or bonus token |
"""

from __future__ import annotations

from pathlib import Path

from ..plugins.graph import make_op_model
from .builder import save_model

__all__ = ["export_verify"]


def export_verify(block_size: int, path: Path) -> list[Path]:
    """Write verify.onnx for block size γ = `block_size`; returns the files written."""
    model = make_op_model("SpeculativeVerify", {}, dims={"γ": int(block_size)})
    return save_model(model, Path(path))
