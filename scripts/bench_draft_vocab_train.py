#!/usr/bin/env python
"""Training step time over the draft vocabulary (d2t of N rows, pooled bucket) against the full vocabulary.

A random Llama target of the given width and vocabulary (SmolLM2-135M's by default: H 576, V 49,152) and a
one-layer DSpark drafter; random cached features (`training.features.Sequence_`) of `--seq-len` tokens. One
step = `dspark_loss` (fused, bf16, as `trainer.train_drafter` runs it) + backward + AdamW, at the trainer's
default shape (4 sequences × 64 anchors × γ 7 = 1,792 predictions). The target's full-vocabulary logsumexp per
token, which the pooled bucket needs, is computed once per sequence before timing (the trainer keeps it per
sequence); its one-time cost is reported apart. Configurations are timed interleaved, round after round, so
a change in machine load falls on all alike; reported: median and [25 %, 75 %] of the step seconds and of the
per-round ratio to the full vocabulary.

Usage:
    python scripts/bench_draft_vocab_train.py --sizes full,8192,4096 --rounds 5 --out reports/drafter/train-step.json
    python scripts/bench_draft_vocab_train.py --hidden 64 --vocab 49152   # tiny but wide
Exit codes: 0 done, 2 an error (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def _target(hidden: int, vocab: int, layers: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark_export.modeling.target import wrap_target

    heads = max(1, hidden // 64)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 3), head_dim=hidden // heads,
                      max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                      pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    return wrap_target(model, source="random llama (bench)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--target-layers", type=int, default=4)
    ap.add_argument("--sizes", default="full,8192,4096", help="comma-separated N values, 'full' = no d2t")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=8, help="random cached sequences to draw batches from")
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--seqs-per-step", type=int, default=4)
    ap.add_argument("--anchors-per-seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", help="JSON result file")
    args = ap.parse_args(argv)

    import torch

    from dspark_export.modeling.config import DrafterConfig
    from dspark_export.modeling.drafter import init_drafter
    from dspark_export.training.features import Sequence_
    from dspark_export.training.objective import dspark_loss, make_batch, target_logsumexp

    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    try:
        ns = [None if s == "full" else int(s) for s in sizes]
    except ValueError:
        print(f"error: --sizes: expected 'full' or integers, found {args.sizes!r}", file=sys.stderr)
        return 2
    if any(n is not None and not 1 <= n <= args.vocab for n in ns):
        print(f"error: --sizes: every N must be in [1, --vocab = {args.vocab}]", file=sys.stderr)
        return 2
    target = _target(args.hidden, args.vocab, args.target_layers, 0)
    dcfg = DrafterConfig.from_target(target.config, num_draft_layers=1, block_size=7, markov_rank=64)
    F = args.hidden * len(dcfg.target_layer_ids)
    rng = np.random.default_rng(0)
    seqs = [Sequence_(tokens=rng.integers(3, args.vocab, args.seq_len), aux=rng.standard_normal((args.seq_len, F),
                      np.float32), last=rng.standard_normal((args.seq_len, args.hidden), np.float32),
                      prompt_len=args.seq_len // 4, source={}) for _ in range(args.seqs)]
    t0 = time.perf_counter()
    W = target.model.get_output_embeddings().weight.detach()
    for s in seqs:
        s.t_lse = target_logsumexp(torch.from_numpy(s.last), W).numpy()
    lse_s_per_token = (time.perf_counter() - t0) / (args.seqs * args.seq_len)
    runs = {}
    for size, n in zip(sizes, ns):
        drafter = init_drafter(target, dcfg, seed=0).train()
        params = [p for p in drafter.parameters() if p.requires_grad]
        d2t = None if n is None else torch.from_numpy(np.sort(rng.permutation(args.vocab)[:n]))
        runs[size] = dict(drafter=drafter, opt=torch.optim.AdamW(params, lr=1e-4), d2t=d2t, times=[])

    def step(run, seed):
        picks = np.random.default_rng(seed).choice(args.seqs, args.seqs_per_step, replace=False)
        batch = make_batch([seqs[i] for i in picks], args.anchors_per_seq, 7, np.random.default_rng(seed))
        t = time.perf_counter()
        loss, _ = dspark_loss(run["drafter"], batch, d2t=run["d2t"])
        run["opt"].zero_grad(set_to_none=True)
        loss.backward()
        run["opt"].step()
        return time.perf_counter() - t

    for run in runs.values():  # warm-up
        step(run, 0)
    for r in range(args.rounds):
        for size, run in runs.items():
            run["times"].append(step(run, r + 1))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v['times'][-1]:.2f} s" for k, v in runs.items()),
              file=sys.stderr, flush=True)
    base = runs[sizes[0]]["times"]
    q = lambda xs: [round(float(np.percentile(xs, p)), 4) for p in (50, 25, 75)]  # noqa: E731
    result = {"hidden": args.hidden, "vocab": args.vocab, "rows_per_step": args.seqs_per_step * args.anchors_per_seq * 7,
              "threads": torch.get_num_threads(), "rounds": args.rounds, "baseline": sizes[0],
              "target_lse_once_ms_per_token": round(1e3 * lse_s_per_token, 4),
              "steps": {k: {"seconds_median_q25_q75": q(v["times"]),
                            "ratio_to_baseline_median_q25_q75": q(np.asarray(v["times"]) / np.asarray(base))}
                        for k, v in runs.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
