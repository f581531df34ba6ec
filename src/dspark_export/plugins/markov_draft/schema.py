"""``dspark::MarkovDraft`` (version 1): the single source of truth of its contract.

The sequential stage of DSpark (paper §3.1, Eq. 5 and 7; DeepSpec ``markov_head.py`` and
``AcceptRatePredictor``, deepspec_reference.md §1.6, §1.7, §2.4). Left to right over the γ slots,
``L_k = U_k + W2·W1[x_{k-1}]`` (x_{-1} = anchor), ``x_k = sample(warp(L_k), u_k)`` and
``conf_k = σ(([h_k ; W1[x_{k-1}]]·w + b) / T_k)``. Without Markov weights the bias is 0 and the
confidence input is h_k alone (r = 0); without confidence weights the confidence is 1.
With a draft vocabulary ``d2t`` (Vd target ids, strictly ascending; FR-Spec, EAGLE-3's d2t; needs the
Markov weights, whose W1 carries V) the slots are computed over the Vd draft rows only: U_k and W2 hold
those rows, the sampling and argmax run over them, ``x_k = d2t[j_k]`` is a target id, and ``draft_logits``
stays over the Vd draft rows (column j is target id d2t[j]; the target tokens outside d2t have q = 0). Without
``d2t``, Vd = V. Scattering ``draft_logits`` to V with ``OUTSIDE_DRAFT_VOCAB`` everywhere else
(``scatter_draft_logits``) gives, id for id under the same uniforms, what the op gives without ``d2t`` on
U_k scattered to V first (fill + bias rounds to the fill; ties and the sampling's cumulative sums meet the
tokens in the same order). Why not scattered in the op: a greedy verification never reads q, and writing
[R, γ, V] was the largest node of the CPU drafter block (reports/drafter/compact-draft-logits/).
``d2t`` is a trailing optional input, so the op stays at version 1: a node without it means what it meant
before, and a graph carries its own function body (graphs exported before this contract return the
scattered [R, γ, V]; the runtime takes either width).

| name | shape | dtype | meaning |
| --- | --- | --- | --- |
| in `base_logits` | [R, γ, Vd] | float32 | drafter LM-head logits U_k of each slot (over d2t when given; Vd = V without d2t) |
| in `hidden` | [R, γ, H] | float32 | post-final-norm drafter hidden h_k of each slot |
| in `anchor_ids` | [R] | int64 | last committed token (x_{-1}) |
| in `temperature` | [R] | float32 | 0 = greedy |
| in `top_k` | [R] | int64 | 0 = off |
| in `top_p` | [R] | float32 | 1 = off |
| in `uniforms` | [R, γ] | float32 | one uniform in [0, 1) per draft slot |
| in `confidence_temperature` | [γ] | float32 | STS temperature T_k per slot (ones when uncalibrated) |
| in `markov_w1` (optional) | [V, r] | float32 | Markov embedding W1 |
| in `markov_w2` (optional) | [Vd, r] | float32 | Markov output projection W2 (nn.Linear(r, V) weight; its rows at d2t when given) |
| in `confidence_weight` (optional) | [H+r] | float32 | confidence head weight w (length H without Markov weights) |
| in `confidence_bias` (optional) | [1] | float32 | confidence head bias b |
| in `d2t` (optional) | [Vd] | int64 | draft vocabulary: target id of each draft row, strictly ascending, in [0, V) |
| out `draft_ids` | [R, γ] | int64 | drafted tokens x_k (target ids) |
| out `draft_logits` | [R, γ, Vd] | float32 | Markov-corrected logits L_k each draft was drawn from (before warping; over d2t when given) |
| out `confidence` | [R, γ] | float32 | calibrated conditional acceptance probability σ(z_k / T_k) |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from dspark_export.errors import PluginError
from dspark_export.plugins.common import DOMAIN, OPSET_VERSION
from dspark_export.plugins.common.contract import OpSchema, TensorSpec

F32, I64 = np.float32, np.int64

SCHEMA = OpSchema(
    op_type="MarkovDraft",
    domain=DOMAIN,
    version=OPSET_VERSION,
    inputs=(
        TensorSpec("base_logits", ("R", "γ", "Vd"), F32,
                   "drafter LM-head logits U_k of each slot (over d2t when given; Vd = V without d2t)"),
        TensorSpec("hidden", ("R", "γ", "H"), F32, "post-final-norm drafter hidden h_k of each slot"),
        TensorSpec("anchor_ids", ("R",), I64, "last committed token (x_{-1})"),
        TensorSpec("temperature", ("R",), F32, "0 = greedy"),
        TensorSpec("top_k", ("R",), I64, "0 = off"),
        TensorSpec("top_p", ("R",), F32, "1 = off"),
        TensorSpec("uniforms", ("R", "γ"), F32, "one uniform in [0, 1) per draft slot"),
        TensorSpec("confidence_temperature", ("γ",), F32, "STS temperature T_k per slot (ones when uncalibrated)"),
        TensorSpec("markov_w1", ("V", "r"), F32, "Markov embedding W1", optional=True),
        TensorSpec("markov_w2", ("Vd", "r"), F32,
                   "Markov output projection W2 (nn.Linear(r, V) weight; its rows at d2t when given)", optional=True),
        TensorSpec("confidence_weight", ("H+r",), F32,
                   "confidence head weight w (length H without Markov weights)", optional=True),
        TensorSpec("confidence_bias", ("1",), F32, "confidence head bias b", optional=True),
        TensorSpec("d2t", ("Vd",), I64,
                   "draft vocabulary: target id of each draft row, strictly ascending, in [0, V)", optional=True),
    ),
    outputs=(
        TensorSpec("draft_ids", ("R", "γ"), I64, "drafted tokens x_k (target ids)"),
        TensorSpec("draft_logits", ("R", "γ", "Vd"), F32,
                   "Markov-corrected logits L_k each draft was drawn from (before warping; over d2t when given)"),
        TensorSpec("confidence", ("R", "γ"), F32, "calibrated conditional acceptance probability σ(z_k / T_k)"),
    ),
    doc="\n\n".join(__doc__.split("\n\n")[1:3]),
)

MARKOV_INPUTS = ("markov_w1", "markov_w2")
DRAFT_VOCAB_INPUTS = ("d2t",)
OUTSIDE_DRAFT_VOCAB = -1e30
"""Logit of a target token outside d2t once draft logits are scattered to V (``scatter_draft_logits``):
finite, so a finiteness check on draft_logits still means
"the drafter broke", and exp(fill - max) is exactly 0 in float32 for any temperature up to 1e28, so the
draft distribution q is exactly 0 there. Adding a Markov bias (|bias| far below ulp(1e30) = 2^76) leaves it
unchanged, which is why the scatter may come before or after the bias."""
CONFIDENCE_INPUTS = ("confidence_weight", "confidence_bias")
D2T_INITIALIZER = "draft_vocab.d2t"
"""Name exported drafter block graphs give the d2t they use ([N] int64, ascending; with or without a Markov
head), so an engine directory's manifest can be checked against it (`Manifest.check_graph_d2t`)."""


def scatter_draft_logits(draft_logits: np.ndarray, d2t: np.ndarray, vocab_size: int) -> np.ndarray:
    """[..., Vd] draft logits over d2t -> [..., V]: column d2t[j] holds column j, OUTSIDE_DRAFT_VOCAB elsewhere
    (the full-vocabulary q a sampled verification needs; q is exactly 0 outside d2t)."""
    full = np.full(draft_logits.shape[:-1] + (vocab_size,), OUTSIDE_DRAFT_VOCAB, np.float32)
    full[..., d2t] = draft_logits
    return full


@dataclasses.dataclass(frozen=True)
class MarkovDraftConfig:
    """Static configuration of a MarkovDraft node; the ONNX function body depends on it.

    Attributes:
        block_size: γ, the number of draft slots (unrolled in the ONNX function), ≥ 1.
        has_markov: whether ``markov_w1``/``markov_w2`` are inputs (False: DFlash-style, no bias).
        has_confidence: whether ``confidence_weight``/``confidence_bias`` are inputs (False: confidence 1).
        has_d2t: whether ``d2t`` is an input (the slots run over the draft vocabulary); needs ``has_markov``.
        cpu_greedy: whether the all-greedy branch is one ``dspark.cpu::MarkovDraftGreedy`` node (the C++ kernel
            of ``plugins/cpu_ops``, ONNX Runtime's CPU provider) instead of standard ops; needs ``has_markov``.
            Same values to float rounding; the sampling branch is unchanged.
    """

    block_size: int
    has_markov: bool
    has_confidence: bool
    has_d2t: bool = False
    cpu_greedy: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise PluginError(f"MarkovDraft block_size: expected an int >= 1, found {self.block_size!r}")
        for name in ("has_markov", "has_confidence", "has_d2t", "cpu_greedy"):
            if not isinstance(getattr(self, name), bool):
                raise PluginError(f"MarkovDraft {name}: expected a bool, found {getattr(self, name)!r}")
        if self.has_d2t and not self.has_markov:
            raise PluginError("MarkovDraft has_d2t: a draft vocabulary needs the Markov weights (markov_w1 carries "
                              "V, the target ids the slots feed back), found has_markov=False; without them "
                              "scatter the logits to V before the op")
        if self.cpu_greedy and not self.has_markov:
            raise PluginError("MarkovDraft cpu_greedy: the C++ greedy slots compute the Markov bias, found "
                              "has_markov=False (without it the slots are one ArgMax each: keep the ONNX form)")

    @property
    def overload(self) -> str:
        """Function overload tag, e.g. ``"g7_markov_conf"``: distinct configurations coexist in one model."""
        parts = [f"g{self.block_size}"] + ["markov"] * self.has_markov + ["conf"] * self.has_confidence \
            + ["d2t"] * self.has_d2t + ["cpu"] * self.cpu_greedy
        return "_".join(parts)

    @classmethod
    def from_dict(cls, config: Mapping[str, object]) -> MarkovDraftConfig:
        """Build from keyword configuration; raises PluginError for missing or unknown keys (``has_d2t`` and
        ``cpu_greedy`` may be left out: False)."""
        names = [field.name for field in dataclasses.fields(cls)]
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        if not set(required) <= set(config) or not set(config) <= set(names):
            raise PluginError(f"{SCHEMA.qualified_name} configuration: expected keys {required} (and optionally "
                              f"{sorted(set(names) - set(required))}), found {sorted(config)}")
        return cls(**config)

    @property
    def present_inputs(self) -> tuple[str, ...]:
        """Schema inputs this configuration feeds, in schema order."""
        absent = set(() if self.has_markov else MARKOV_INPUTS) | set(() if self.has_confidence else CONFIDENCE_INPUTS) \
            | set(() if self.has_d2t else DRAFT_VOCAB_INPUTS)
        return tuple(name for name in SCHEMA.input_names if name not in absent)
