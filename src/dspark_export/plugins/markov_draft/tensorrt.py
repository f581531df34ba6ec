"""The TensorRT plugin form of ``dspark::MarkovDraft``, as data (``common/tensorrt_spec.py`` says how
TensorRT's ONNX parser reaches it). Pure Python: nothing here imports tensorrt, triton or torch.
Dimension letters: R requests, γ draft slots, V vocab, H hidden size, r Markov rank.
"""

from __future__ import annotations

import numpy as np

from dspark_export.plugins.common.tensorrt_spec import BLOCK_FIELDS, OutputRule, PluginField, PluginSpec
from dspark_export.plugins.markov_draft.schema import SCHEMA

PLUGIN_SPEC = PluginSpec(
    SCHEMA,
    fields=(
        PluginField("has_markov", "1: markov_w1/markov_w2 are real inputs; 0: placeholders (no bias)",
                    None, (0, 1)),
        PluginField("has_confidence", "1: confidence_weight/bias are real inputs; 0: placeholders "
                                      "(confidence 1)", None, (0, 1)),
        *BLOCK_FIELDS,
    ),
    outputs=(
        OutputRule("draft_ids", np.dtype(np.int64), (("base_logits", 0), ("base_logits", 1))),
        OutputRule("draft_logits", np.dtype(np.float32),
                   (("base_logits", 0), ("base_logits", 1), ("base_logits", 2))),
        OutputRule("confidence", np.dtype(np.float32), (("base_logits", 0), ("base_logits", 1))),
    ),
    placeholders={"markov_w1": 2, "markov_w2": 2, "confidence_weight": 1, "confidence_bias": 1},
)

SCALARS: tuple[tuple[str, tuple[str, int]], ...] = (
    ("GAMMA", ("base_logits", 1)), ("V", ("base_logits", 2)), ("H", ("hidden", 2)), ("RANK", ("markov_w1", 1)))
"""The int32 scalar arguments TensorRT passes between inputs and outputs, each from (input name, axis)."""
GRID_SOURCE = ("base_logits", 0)
"""The plugin input whose axis 0 is the request count R (one program per request)."""
