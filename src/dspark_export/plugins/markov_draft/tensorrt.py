"""The TensorRT plugin form of ``dspark::MarkovDraft``, as data (``common/tensorrt_spec.py`` says how
TensorRT's ONNX parser reaches it). Pure Python: nothing here imports tensorrt, triton or torch.
Dimension letters: R requests, γ draft slots, V vocab, H hidden size, r Markov rank.

The plugin takes the full-vocabulary form of the op (``PLUGIN_SCHEMA``: the schema without ``d2t``, Vd = V).
A node with a draft vocabulary is lowered to that form by ``engines/trt/lowering.py``
(``expand_draft_vocab``): the base logits are scattered to V with ``OUTSIDE_DRAFT_VOCAB`` and W2's rows to
a zero [V, r] table before the plugin, which gives the same drafts, logits and confidence (the schema's
docstring says why ascending d2t makes the two forms equal) at the cost of the full W2 read on the GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dspark_export.plugins.common.tensorrt_spec import BLOCK_FIELDS, OutputRule, PluginField, PluginSpec
from dspark_export.plugins.common.contract import TensorSpec
from dspark_export.plugins.markov_draft.schema import DRAFT_VOCAB_INPUTS, SCHEMA


def _full_vocabulary(spec: TensorSpec) -> TensorSpec:
    return dataclasses.replace(spec, shape=tuple("V" if d == "Vd" else d for d in spec.shape))


PLUGIN_SCHEMA = dataclasses.replace(
    SCHEMA, inputs=tuple(_full_vocabulary(s) for s in SCHEMA.inputs if s.name not in DRAFT_VOCAB_INPUTS),
    outputs=tuple(_full_vocabulary(s) for s in SCHEMA.outputs))
"""The plugin's form: the op's inputs without ``d2t``, base_logits [R, γ, V] and markov_w2 [V, r], and
draft_logits [R, γ, V]."""

PLUGIN_SPEC = PluginSpec(
    PLUGIN_SCHEMA,
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
