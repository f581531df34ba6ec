"""Shared inputs and runners for the plugin tests: sampling cases, random feeds, cached ORT sessions."""

from __future__ import annotations

import functools

import numpy as np
import onnxruntime as ort

from dspark_export.plugins import cpu_ops
from dspark_export.plugins.common.sampling import SamplingBatch, sample_from_probs, warp_probs
from dspark_export.plugins.graph import make_op_model

F32, I64 = np.float32, np.int64

# Tag -> per-row (temperature, top_k, top_p) cycled over the requests of a batch.
SAMPLING_CASES = {
    "greedy": [(0.0, 0, 1.0)],
    "t0.7": [(0.7, 0, 1.0)],
    "t1.3": [(1.3, 0, 1.0)],
    "top_k": [(1.0, 3, 1.0), (0.7, 10, 1.0), (1.3, 1, 1.0), (1.0, 0, 1.0), (1.0, 1000, 1.0)],
    "top_p": [(1.0, 0, 0.5), (0.7, 0, 0.9), (1.3, 0, 0.0), (1.0, 0, 1.0), (1.0, 0, 0.95)],
    "mixed": [(0.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 0, 1.0), (0.5, 4, 0.6), (0.0, 3, 0.5)],
}

MARKOV_CONFIGS = {
    "markov_conf": dict(has_markov=True, has_confidence=True),
    "markov": dict(has_markov=True, has_confidence=False),
    "conf": dict(has_markov=False, has_confidence=True),
    "plain": dict(has_markov=False, has_confidence=False),
}


def sampling_feeds(case: str, num_requests: int) -> dict[str, np.ndarray]:
    """temperature [R] f32, top_k [R] i64, top_p [R] f32 for ``SAMPLING_CASES[case]``, cycled over R."""
    rows = [SAMPLING_CASES[case][i % len(SAMPLING_CASES[case])] for i in range(num_requests)]
    temperature, top_k, top_p = zip(*rows) if rows else ((), (), ())
    return dict(temperature=np.array(temperature, F32), top_k=np.array(top_k, I64), top_p=np.array(top_p, F32))


def random_logits(rng: np.random.Generator, shape: tuple[int, ...], has_ties: bool = False) -> np.ndarray:
    """Logits with real spread; ``has_ties`` rounds them to steps of 0.5 so many values tie."""
    logits = rng.normal(0.0, 2.0, size=shape).astype(F32)
    return (np.round(logits * 2) / 2).astype(F32) if has_ties else logits


def markov_feeds(rng, case: str, config: dict, num_requests=3, vocab=50, hidden=8, rank=5, has_ties=False) -> dict:
    """A MarkovDraft feed for ``config`` (MarkovDraftConfig fields), keyed by schema input names."""
    gamma = config["block_size"]
    feeds = dict(
        base_logits=random_logits(rng, (num_requests, gamma, vocab), has_ties),
        hidden=rng.normal(size=(num_requests, gamma, hidden)).astype(F32),
        anchor_ids=rng.integers(0, vocab, num_requests).astype(I64),
        **sampling_feeds(case, num_requests),
        uniforms=rng.random((num_requests, gamma), dtype=F32),
        confidence_temperature=rng.uniform(0.5, 2.0, gamma).astype(F32),
    )
    if config["has_markov"]:
        feeds["markov_w1"] = rng.normal(size=(vocab, rank)).astype(F32)
        feeds["markov_w2"] = rng.normal(size=(vocab, rank)).astype(F32)
    if config["has_confidence"]:
        width = hidden + (rank if config["has_markov"] else 0)
        feeds["confidence_weight"] = rng.normal(size=width).astype(F32) * 0.3
        feeds["confidence_bias"] = np.array([0.2], F32)
    return feeds


def verify_feeds(rng, case: str, verify_lens, gamma: int, vocab=50, extra_rows=2, has_ties=False) -> dict:
    """A ragged SpeculativeVerify feed: drafts drawn from logits near the target's, so some are accepted."""
    verify_lens = np.asarray(verify_lens, I64)
    num_requests = len(verify_lens)
    query_start = np.concatenate([[0], np.cumsum(verify_lens + 1)]).astype(I64)
    target_logits = random_logits(rng, (int(query_start[-1]) + extra_rows, vocab), has_ties)
    rows = np.minimum(query_start[:-1, None] + np.arange(gamma), (query_start[:-1] + verify_lens)[:, None])
    noise = random_logits(rng, (num_requests, gamma, vocab), has_ties) * 0.3
    draft_logits = (target_logits[rows] + noise).astype(F32)
    sampling = sampling_feeds(case, num_requests)
    params = SamplingBatch(sampling["temperature"], sampling["top_k"], sampling["top_p"])
    draft_probs = warp_probs(draft_logits, *params.expand(gamma))
    draft_ids = sample_from_probs(draft_probs, rng.random((num_requests, gamma), dtype=F32))
    draft_ids = np.where(np.arange(gamma) < verify_lens[:, None], draft_ids, -1)  # placeholders past the width
    return dict(target_logits=target_logits, query_start=query_start, draft_ids=draft_ids.astype(I64),
                draft_logits=draft_logits, verify_lens=verify_lens, **sampling,
                uniforms=rng.random((num_requests, gamma + 1), dtype=F32))


@functools.lru_cache(maxsize=None)
def _session(op_name: str, config_items: tuple) -> ort.InferenceSession:
    model = make_op_model(op_name, dict(config_items))
    so = ort.SessionOptions()
    cpu_ops.register_for(so, model)   # a cpu_greedy MarkovDraft's dspark.cpu node
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run_ort(op_name: str, config: dict, feeds: dict) -> dict[str, np.ndarray]:
    """Run the single-node model of ``op_name`` on ONNX Runtime (sessions cached per configuration)."""
    session = _session(op_name, tuple(sorted(config.items())))
    outputs = session.run(None, feeds)
    return {info.name: value for info, value in zip(session.get_outputs(), outputs)}


def freeze(feeds: dict) -> dict:
    """Read-only copies of ``feeds`` (an op that writes into an input then raises)."""
    frozen = {}
    for name, array in feeds.items():
        frozen[name] = array.copy()
        frozen[name].setflags(write=False)
    return frozen


def draft_vocab_feeds(feeds: dict, d2t: np.ndarray) -> tuple[dict, dict]:
    """The two forms of one MarkovDraft call with a draft vocabulary ``d2t`` (strictly ascending):

    - ``scattered``: the pre-d2t path: base logits kept at d2t and OUTSIDE_DRAFT_VOCAB elsewhere, full W2, no d2t;
    - ``draft``: base logits and W2 rows at d2t only, plus the ``d2t`` input.
    ``feeds`` is a full-vocabulary feed with Markov weights (``markov_feeds``).
    """
    from dspark_export.plugins.markov_draft.schema import OUTSIDE_DRAFT_VOCAB

    scattered_logits = np.full_like(feeds["base_logits"], OUTSIDE_DRAFT_VOCAB)
    scattered_logits[..., d2t] = feeds["base_logits"][..., d2t]
    scattered = dict(feeds, base_logits=scattered_logits)
    draft = dict(feeds, base_logits=np.ascontiguousarray(feeds["base_logits"][..., d2t]),
                 markov_w2=np.ascontiguousarray(feeds["markov_w2"][d2t]), d2t=np.asarray(d2t, I64))
    return scattered, draft
