"""Numpy reference of ``dspark::MarkovDraft``: the spec the ONNX function is held to.

Paper §3.1 (Eq. 5, 7); DeepSpec ``VanillaMarkov.sample_block_tokens`` and ``AcceptRatePredictor``
(deepspec_reference.md §1.6, §1.7, §2.4). Pure: no globals, no RNG (the uniforms are inputs), inputs
never modified. Greedy is the temperature-0 case of the same code (``warp_probs`` gives a one-hot).
Dimension letters: R requests, γ draft slots, V vocab, Vd draft vocabulary (= V without d2t), H hidden
size, r Markov rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from dspark_export.errors import PluginError
from dspark_export.plugins.common.sampling import SamplingBatch, check_sampling_values, sample_from_probs, warp_probs
from dspark_export.plugins.markov_draft.schema import SCHEMA


@dataclasses.dataclass(frozen=True)
class MarkovDraftWeights:
    """The optional weight inputs; leave a pair as None when the drafter has no such head.

    Attributes:
        markov_w1: [V, r] float32 or None.
        markov_w2: [V, r] float32 or None.
        confidence_weight: [H+r] float32 (length H without Markov weights) or None.
        confidence_bias: [1] float32 or None.
        d2t: [Vd] int64 draft vocabulary (strictly ascending target ids) or None; needs the Markov pair,
            whose ``markov_w2`` then holds the Vd rows of W2 at d2t.
    """

    markov_w1: np.ndarray | None = None
    markov_w2: np.ndarray | None = None
    confidence_weight: np.ndarray | None = None
    confidence_bias: np.ndarray | None = None
    d2t: np.ndarray | None = None


class MarkovDraftOutputs(NamedTuple):
    """draft_ids: [R, γ] int64; draft_logits: [R, γ, Vd] float32 (before warping; over d2t when given, Vd = V
    without); confidence: [R, γ] float32."""

    draft_ids: np.ndarray
    draft_logits: np.ndarray
    confidence: np.ndarray


def markov_draft(
    base_logits: np.ndarray,
    hidden: np.ndarray,
    anchor_ids: np.ndarray,
    sampling: SamplingBatch,
    uniforms: np.ndarray,
    confidence_temperature: np.ndarray,
    weights: MarkovDraftWeights = MarkovDraftWeights(),
) -> MarkovDraftOutputs:
    """Draft γ tokens left to right, each conditioned on the one before (anchor for slot 0).

    Args:
        base_logits: [R, γ, Vd] float32, drafter LM-head logits U_k (over d2t when ``weights.d2t`` is given).
        hidden: [R, γ, H] float32, post-final-norm drafter hidden h_k.
        anchor_ids: [R] int64, last committed token x_{-1}.
        sampling: temperature/top_k/top_p, each [R] (see ``SamplingBatch``).
        uniforms: [R, γ] float32 in [0, 1), one per slot.
        confidence_temperature: [γ] float32, STS temperature per slot.
        weights: the optional Markov and confidence weights.

    Returns:
        ``MarkovDraftOutputs`` (draft_ids, draft_logits, confidence).

    Raises:
        PluginError: an input breaks the schema (shape, dtype, value range, a half-given weight pair).
    """
    feeds = _feeds(base_logits, hidden, anchor_ids, sampling, uniforms, confidence_temperature, weights)
    check_arguments(feeds, sampling, uniforms)
    w1, w2, d2t = weights.markov_w1, weights.markov_w2, weights.d2t
    has_markov = w1 is not None
    ids, logits, prev = [], [], anchor_ids
    for k in range(base_logits.shape[1]):
        logits_k = base_logits[:, k] + (w1[prev] @ w2.T if has_markov else np.float32(0))  # [R, Vd]
        rows_k = sample_from_probs(warp_probs(logits_k, *sampling.as_tuple()), uniforms[:, k])
        ids_k = rows_k if d2t is None else d2t[rows_k]  # target ids
        ids.append(ids_k)
        logits.append(logits_k)
        prev = ids_k
    draft_ids = np.stack(ids, axis=1)
    prev_ids = np.concatenate([anchor_ids[:, None], draft_ids[:, :-1]], axis=1)
    confidence = _confidence(hidden, prev_ids, confidence_temperature, weights)
    draft_logits = np.stack(logits, axis=1).astype(np.float32)  # [R, γ, Vd]: over d2t when given
    return MarkovDraftOutputs(draft_ids, draft_logits, confidence)


def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``markov_draft`` over a feed keyed by the schema's input names (absent optional inputs omitted).

    Returns:
        {"draft_ids": [R, γ] int64, "draft_logits": [R, γ, Vd] float32, "confidence": [R, γ] float32}.
    """
    SCHEMA.check_inputs(feeds, preset_dims(feeds))
    sampling = SamplingBatch(feeds["temperature"], feeds["top_k"], feeds["top_p"])
    weights = MarkovDraftWeights(*(feeds.get(name) for name in SCHEMA.optional_input_names))
    outputs = markov_draft(
        feeds["base_logits"], feeds["hidden"], feeds["anchor_ids"], sampling, feeds["uniforms"],
        feeds["confidence_temperature"], weights,
    )
    return outputs._asdict()


def _confidence(
    hidden: np.ndarray, prev_ids: np.ndarray, confidence_temperature: np.ndarray, weights: MarkovDraftWeights
) -> np.ndarray:
    """σ(([h_k ; W1[x_{k-1}]]·w + b) / T_k): [R, γ] float32; ones without confidence weights."""
    if weights.confidence_weight is None:
        return np.ones(prev_ids.shape, np.float32)
    features = hidden
    if weights.markov_w1 is not None:
        features = np.concatenate([hidden, weights.markov_w1[prev_ids]], axis=-1)
    logit = (features @ weights.confidence_weight + weights.confidence_bias) / confidence_temperature
    return (1 / (1 + np.exp(-logit))).astype(np.float32)


def _feeds(base_logits, hidden, anchor_ids, sampling, uniforms, confidence_temperature, weights) -> dict:
    named = dict(zip(("base_logits", "hidden", "anchor_ids", "uniforms", "confidence_temperature"),
                     (base_logits, hidden, anchor_ids, uniforms, confidence_temperature)))
    named.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    named.update(dataclasses.asdict(weights))
    return named


def preset_dims(feeds: Mapping[str, np.ndarray | None]) -> dict[str, int]:
    """Without Markov weights the confidence input is h_k alone: r = 0."""
    return {} if feeds.get("markov_w1") is not None else {"r": 0}


def check_arguments(feeds: dict, sampling: SamplingBatch, uniforms: np.ndarray) -> dict[str, int]:
    """Raise PluginError unless the feeds meet the schema, the optional weights come in pairs, the sampling
    values and uniforms are in range, the anchor ids are inside the vocabulary and a ``d2t`` comes with the
    Markov weights and holds strictly ascending ids in [0, V) (shared with the Triton path).

    Returns:
        The bound dimension letters, V and Vd always among them (Vd = V without d2t).
    """
    name = SCHEMA.qualified_name
    for pair in (("markov_w1", "markov_w2"), ("confidence_weight", "confidence_bias")):
        if (feeds.get(pair[0]) is None) != (feeds.get(pair[1]) is None):
            raise PluginError(f"{name}: give both or neither of {pair}, found only one")
    d2t = feeds.get("d2t")
    if d2t is not None and feeds.get("markov_w1") is None:
        raise PluginError(f"{name} input 'd2t': a draft vocabulary needs markov_w1/markov_w2 (markov_w1 [V, r] "
                          "carries V), found no Markov weights")
    dims = SCHEMA.check_inputs(feeds, preset_dims(feeds))
    dims.setdefault("V", dims["Vd"])
    if d2t is None and dims["V"] != dims["Vd"]:
        raise PluginError(f"{name} input 'markov_w1': expected [V, r] float32 with V = Vd = {dims['Vd']} from "
                          f"'base_logits' (no d2t: the op runs over the full vocabulary), found shape "
                          f"{tuple(feeds['markov_w1'].shape)}")
    check_sampling_values(name, sampling, uniforms)
    anchors = feeds["anchor_ids"]
    if np.any((anchors < 0) | (anchors >= dims["V"])):
        raise PluginError(f"{name} input 'anchor_ids': expected ids in [0, V={dims['V']}), "
                          f"found {anchors[(anchors < 0) | (anchors >= dims['V'])][:4].tolist()}")
    if d2t is not None:
        bad = np.flatnonzero((d2t < 0) | (d2t >= dims["V"]))
        if bad.size:
            raise PluginError(f"{name} input 'd2t': expected target ids in [0, V={dims['V']}), found "
                              f"d2t[{bad[0]}] = {int(d2t[bad[0]])} ({bad.size} out of range)")
        down = np.flatnonzero(np.diff(d2t) <= 0)
        if down.size:
            raise PluginError(f"{name} input 'd2t': expected strictly ascending ids, found d2t[{down[0]}] = "
                              f"{int(d2t[down[0]])} >= d2t[{down[0] + 1}] = {int(d2t[down[0] + 1])}")
    return dims
