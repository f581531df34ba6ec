#!/usr/bin/env python
"""`dspark::MarkovDraft` alone on ONNX Runtime: the full-vocabulary form against the draft-vocabulary (d2t) form.

At the shipped SmolLM2 drafter's sizes (V 49152, d2t of Vd 8192 sorted ids, Markov rank 32, γ 7, H 576), random
weights held as initializers (as in the exported block graph, so ONNX Runtime folds what is constant), the op's
single-node model (`plugins.graph.make_op_model`) is timed in two forms with the same logits on the d2t columns:
"full" (no d2t: base logits scattered to V with OUTSIDE_DRAFT_VOCAB, W2 [V, r], the form the exporter fed the op
before it took d2t) and "d2t" (base logits [R, γ, Vd], W2's rows at d2t, the d2t input). One intra-op thread, the
process's CPU time, interleaved round by round; median and interquartile range of the per-round means.

Usage:
    python scripts/bench_markov_draft_op.py --rounds 7 --out reports/drafter/markov-draft-op-cost.json
Exit codes: 0 done.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _session(has_d2t: bool, weights: dict, block_size: int):
    import onnxruntime as ort
    from onnx import numpy_helper

    from dspark_export.plugins.graph import make_op_model

    model = make_op_model("MarkovDraft", dict(block_size=block_size, has_markov=True, has_confidence=True,
                                              has_d2t=has_d2t), check=False)
    inits = {k: v for k, v in weights.items() if has_d2t or k != "d2t"}
    if has_d2t:
        inits["markov_w2"] = np.ascontiguousarray(weights["markov_w2"][weights["d2t"]])
    keep = [i for i in model.graph.input if i.name not in inits]
    del model.graph.input[:]
    model.graph.input.extend(keep)
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in inits.items())
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--requests", default="1,4")
    p.add_argument("--temperatures", default="0,1", help="0 = greedy (the If's argmax branch), > 0 = sampling")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from dspark_export.plugins.markov_draft.schema import OUTSIDE_DRAFT_VOCAB

    V, Vd, G, H = args.vocab, args.draft_vocab, args.block_size, args.hidden
    rng = np.random.default_rng(0)
    d2t = np.sort(rng.choice(V, Vd, replace=False)).astype(np.int64)
    weights = dict(markov_w1=rng.normal(size=(V, args.rank)).astype(np.float32),
                   markov_w2=rng.normal(size=(V, args.rank)).astype(np.float32),
                   confidence_weight=rng.normal(size=H + args.rank).astype(np.float32),
                   confidence_bias=np.zeros(1, np.float32), d2t=d2t)
    sessions = {"full": _session(False, weights, G), "d2t": _session(True, weights, G)}
    feeds = {}
    for R in (int(x) for x in args.requests.split(",")):
        for t in (float(x) for x in args.temperatures.split(",")):
            base = rng.normal(size=(R, G, Vd)).astype(np.float32)
            full = np.full((R, G, V), OUTSIDE_DRAFT_VOCAB, np.float32)
            full[..., d2t] = base
            common = dict(hidden=rng.normal(size=(R, G, H)).astype(np.float32), anchor_ids=rng.integers(0, V, R),
                          temperature=np.full(R, t, np.float32), top_k=np.zeros(R, np.int64),
                          top_p=np.ones(R, np.float32), uniforms=rng.random((R, G), dtype=np.float32),
                          confidence_temperature=np.ones(G, np.float32))
            feeds[("full", R, t)] = dict(common, base_logits=full)
            feeds[("d2t", R, t)] = dict(common, base_logits=base)
    first = {}
    for (form, R, t), feed in feeds.items():
        first[(form, R, t)] = sessions[form].run(None, feed)[0]
    for form, R, t in feeds:  # same drafts in both forms (the contract's equivalence)
        if form == "d2t" and not np.array_equal(first[("d2t", R, t)], first[("full", R, t)]):
            print(f"error: draft ids differ between the forms at R={R} T={t}", file=sys.stderr)
            return 1
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for (form, R, t), feed in feeds.items():
            sessions[form].run(None, feed)
            t0 = time.process_time()
            for _ in range(args.reps):
                sessions[form].run(None, feed)
            times.setdefault(f"{form}:R={R}:T={t:g}", []).append((time.process_time() - t0) / args.reps * 1e3)
    stats = {k: {"median_ms": round(float(np.median(v)), 3), "q25_ms": round(float(np.percentile(v, 25)), 3),
                 "q75_ms": round(float(np.percentile(v, 75)), 3)} for k, v in times.items()}
    result = {"command": " ".join(sys.argv), "sizes": dict(V=V, Vd=Vd, r=args.rank, gamma=G, H=H),
              "clock": "cpu", "threads": 1, "rounds": args.rounds, "reps": args.reps, "stats": stats,
              "note": "machine shared with other jobs during the run; forms interleaved in one run"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for k, v in stats.items():
        print(k, json.dumps(v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
