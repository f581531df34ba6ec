"""The TensorRT plugin form of ``dspark::SpeculativeVerify``, as data (``common/tensorrt_spec.py`` says how
TensorRT's ONNX parser reaches it). Pure Python: nothing here imports tensorrt, triton or torch.
Dimension letters: R requests, γ draft slots, V vocab.
"""

from __future__ import annotations

import numpy as np

from dspark_export.plugins.common.tensorrt_spec import BLOCK_FIELDS, OutputRule, PluginSpec
from dspark_export.plugins.speculative_verify.schema import SCHEMA

PLUGIN_SPEC = PluginSpec(
    SCHEMA,
    fields=BLOCK_FIELDS,
    outputs=(
        OutputRule("num_accepted", np.dtype(np.int64), (("verify_lens", 0),)),
        OutputRule("next_ids", np.dtype(np.int64), (("verify_lens", 0),)),
    ),
    placeholders={},
)

SCALARS: tuple[tuple[str, tuple[str, int]], ...] = (("GAMMA", ("draft_ids", 1)), ("V", ("target_logits", 1)))
"""The int32 scalar arguments TensorRT passes between inputs and outputs, each from (input name, axis)."""
GRID_SOURCE = ("verify_lens", 0)
"""The plugin input whose axis 0 is the request count R (one program per request)."""
