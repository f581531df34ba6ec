#!/usr/bin/env python
"""Train, calibrate and ship the DSpark drafter of a target (default: the embedded SmolLM2-135M-Instruct).

Stages (each resumable; each reads the previous one's output):

    data       prompts of the committed split (dspark_export/training/data_split.json) answered by the
               target: <run>/data/{train,calibration}.jsonl; with --engine, by the project's runtime at
               --concurrency, and the training data grows with prompts the target writes itself
               (--self-prompts K: <run>/data/self_prompts.jsonl) and multi-turn continuations (--multi-turn K:
               <run>/data/follow_ups.jsonl), both answered into train.jsonl (`training.selfdata`)
    features   the target's tapped hidden states and final hidden per token: <run>/features/{train,calibration};
               with --engine, from the engine directory's target graph (`engines.target_features`), in
               --workers W single-threaded processes if asked (each on every W-th part of 64 sequences)
    train      a drafter (--variant dspark | dflash) over the draft vocabulary (--draft-vocab N | full):
               <run>/<name>/ (training_state.pt, metrics.jsonl, checkpoints.jsonl (offline τ per checkpoint on
               the calibration features), draft_vocab.json, drafter/ in DeepSpec layout, fp32, with its
               draft_vocab.json)
    calibrate  offline rounds on the calibration features → τ per dataset, per-position acceptance,
               STS temperatures, ECE before/after, reliability diagram: <run>/<name>/calibration/
    export     drafter-owned tensors in fp16 + calibration.json → --out (the shipped drafter folder)
    draft-vocab  token ranking of the target's training responses (<run>/data/train.jsonl) →
               <--out>/draft_vocab.json (`dspark_export.training.draft_vocab`; the d2t of `build --draft-vocab N`)
    pack       <run>/data's lines written since the last pack → a new xz shard in --out (a folder committed to the
               repository: the data stage's hours survive a new machine; `dspark_export.training.snapshot`)
    unpack     the shards of --from → <run>/data, where they hold more than it; the data stage then resumes

Usage:
    python scripts/train_drafter.py data --run runs/smollm2 --limit 1400
    python scripts/train_drafter.py data --run runs/smollm2 --engine /tmp/eng/default --concurrency 16 \
        --limit 100000 --self-prompts 6000 --multi-turn 2000      # the whole split + self-written + turn 2
    python scripts/train_drafter.py features --run runs/smollm2 --engine /tmp/eng/default   # as the engines compute them
    python scripts/train_drafter.py features --run runs/smollm2 --engine /tmp/eng/default --workers 2  # 2 processes
    python scripts/train_drafter.py train --run runs/smollm2 --name dspark --steps 1500   # --draft-vocab 4096
    python scripts/train_drafter.py train --run runs/smollm2 --name dspark-fullv --draft-vocab full --steps 1500
    python scripts/train_drafter.py train --run runs/smollm2 --name v2 --block-size 5 --layers 2 --markov-rank 32 \
        --init-from src/dspark_export/assets/drafters/smollm2-135m-instruct   # warm start from the shipped drafter
    python scripts/train_drafter.py train --run runs/smollm2 --name deep --block-size 5 --layers 3 --markov-rank 32 \
        --init-from src/dspark_export/assets/drafters/smollm2-135m-instruct   # grow the shipped drafter by a layer
    python scripts/train_drafter.py train --run runs/smollm2 --name dflash --variant dflash --steps 1500
    python scripts/train_drafter.py train --run runs/smollm2 --name dflash --variant dflash --steps 2300 \
        --lr-from runs/smollm2/dspark/metrics.jsonl      # same lr path as a resumed DSpark run
    python scripts/train_drafter.py calibrate --run runs/smollm2 --name dspark
    python scripts/train_drafter.py export --run runs/smollm2 --name dspark \
        --out src/dspark_export/assets/drafters/smollm2-135m-instruct
    python scripts/train_drafter.py draft-vocab --run runs/smollm2 --out src/dspark_export/assets/drafters/smollm2-135m-instruct
    python scripts/train_drafter.py pack --run runs/smollm2 --out training-data/smollm2-135m-instruct
    python scripts/train_drafter.py unpack --run runs/smollm2 --from training-data/smollm2-135m-instruct
    python scripts/train_drafter.py calibrate --run runs/smollm2 \
        --drafter src/dspark_export/assets/drafters/smollm2-135m-instruct --draft-vocab 4096   # recalibrate in place
Exit codes: 0 done, 2 an error (one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from functools import partial
from pathlib import Path

from dspark_export.errors import DsparkExportError


#: `train --draft-vocab` default: the N of the shipped build (`pipeline.SHIPPED_DRAFTER_BUILD`), so the loss is over
#: the distribution the exported block drafts from (training/objective.py, "Draft vocabulary").
DEFAULT_TRAIN_DRAFT_VOCAB = 4096


def _log(t0):
    return lambda line: print(f"[{time.perf_counter() - t0:7.1f} s] {line}", file=sys.stderr, flush=True)


def _target(args):
    from dspark_export.modeling.target import default_target_path, load_target

    path = Path(args.target) if args.target else default_target_path()
    return path, load_target(path)


class RuntimeResponder:
    """`training.selfdata.Responder` over the project's runtime: every prompt of a call in flight at once
    (continuous batching over the engine directory's request buckets)."""

    def __init__(self, engine_dir: str, policy: str, threads: int = 0):
        from dspark_export.runtime.api import Runtime

        self.runtime = Runtime.open(engine_dir, policy=policy, threads=threads)
        self.tokenizer = self.runtime.tokenizer
        self.name = f"engine:{Path(engine_dir).name}:{policy}"

    def generate(self, prompts, temperatures, seeds, max_new_tokens, top_p=1.0, on_result=None):
        from dspark_export.runtime.request import SamplingParams

        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=t, top_p=top_p if t else 1.0, seed=s)
                  for t, s in zip(temperatures, seeds)]
        done = None if on_result is None else (lambda i, r: on_result(i, (list(r.token_ids), r.finish_reason)))
        return [(list(r.token_ids), r.finish_reason) for r in self.runtime.generate_ids(prompts, params, done)]


def cmd_data(args, say):
    from dspark_export.datasets import default_datasets_dir
    from dspark_export.errors import ConfigError
    from dspark_export.training.data import generate_responses
    from dspark_export.training.split import load_split

    folder = Path(args.datasets_dir) if args.datasets_dir else default_datasets_dir()
    split = load_split(datasets_dir=folder)
    out = Path(args.run) / "data"
    out.mkdir(parents=True, exist_ok=True)
    if (args.self_prompts or args.multi_turn) and not args.engine:
        raise ConfigError("--self-prompts / --multi-turn: the target writes them through the runtime; give --engine DIR")
    if args.engine:
        _data_with_runtime(args, split, folder, out, say)
        return
    path, _ = _target(args)
    for part, limit, frac in (("train", args.limit, args.sampled_fraction),
                              ("calibration", args.calibration_limit, 0.0)):
        generate_responses(path, split, part, folder, out / f"{part}.jsonl", max_new_tokens=args.max_new_tokens,
                           max_prompt_tokens=args.max_prompt_tokens, sampled_fraction=frac, limit=limit,
                           batch=args.batch, seed=args.seed, progress=say)


def _data_with_runtime(args, split, folder: Path, out: Path, say):
    from dspark_export.training import selfdata

    responder = RuntimeResponder(args.engine, args.policy, args.threads)
    kw = dict(max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens, temperature=1.0,
              seed=args.seed, concurrency=args.concurrency, progress=say)
    for part, limit, frac in (("train", args.limit, args.sampled_fraction),
                              ("calibration", args.calibration_limit, 0.0)):
        selfdata.answer_split(responder, split, part, folder, out / f"{part}.jsonl", limit=limit,
                              sampled_fraction=frac, **kw)
    kw["sampled_fraction"] = args.sampled_fraction
    if args.self_prompts:
        stats = selfdata.write_self_prompts(responder, split, folder, out / "self_prompts.jsonl", args.self_prompts,
                                            seed=args.seed, concurrency=args.concurrency, progress=say)
        say(f"self-written prompts: {stats}")
        selfdata.answer_self_prompts(responder, out / "self_prompts.jsonl", out / "train.jsonl", **kw)
    if args.multi_turn:
        stats = selfdata.write_follow_ups(responder, split, folder, out / "train.jsonl", out / "follow_ups.jsonl",
                                          args.multi_turn, seed=args.seed, concurrency=args.concurrency,
                                          max_prompt_tokens=args.max_turn_tokens, progress=say)
        say(f"follow-ups: {stats}")
        selfdata.answer_follow_ups(responder, out / "follow_ups.jsonl", out / "train.jsonl",
                                   **{**kw, "max_prompt_tokens": args.max_turn_tokens})


def cmd_features(args, say):
    import torch

    from dspark_export.errors import ConfigError
    from dspark_export.modeling.config import default_target_layer_ids
    from dspark_export.training.data import read_records
    from dspark_export.training.features import build_feature_cache, build_feature_cache_parallel

    if args.workers > 1 and not args.engine:
        raise ConfigError(f"--workers {args.workers}: parallel feature processes need --engine (each opens "
                          "its own ONNX Runtime session)")
    if args.engine:
        from dspark_export.engines.target_features import EngineFeatures

        threads = args.threads or (1 if args.workers > 1 else 0)
        target = EngineFeatures(args.engine, threads=threads)
        taps = target.target_layer_ids
        if args.taps and list(args.taps) != taps:
            raise ConfigError(f"--taps {list(args.taps)}: the engine's target graph taps {taps}")
    else:
        target = _target(args)[1].model
        taps = args.taps or default_target_layer_ids(target.config.num_hidden_layers)
    for part in ("train", "calibration"):
        records = read_records(Path(args.run) / "data" / f"{part}.jsonl")
        if args.limit is not None and len(records) > args.limit:
            say(f"{part}: the first {args.limit} of {len(records)} records (--limit); a later call grows the cache")
            records = records[:args.limit]
        say(f"{part}: {len(records)} records, taps {list(taps)}")
        if args.workers > 1:
            build_feature_cache_parallel(partial(EngineFeatures, args.engine, threads=threads), records,
                                         Path(args.run) / "features" / part, workers=args.workers, progress=say,
                                         source=target)
        else:
            build_feature_cache(target, records, taps, Path(args.run) / "features" / part,
                                dtype=getattr(torch, args.dtype), progress=say)


def _train_d2t(args, target, out: Path, say):
    """(N or None, d2t or None) of `train --draft-vocab`; the ranking is fixed in <out>/draft_vocab.json at the
    run's first call, so a resumed run keeps its d2t while the data grows."""
    from dspark_export.errors import ConfigError
    from dspark_export.training.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab_source, select_d2t, write_ranking

    if args.draft_vocab == "full":
        return None, None
    try:
        size = int(args.draft_vocab)
    except ValueError:
        raise ConfigError(f"--draft-vocab: expected 'full' or a size N, found {args.draft_vocab!r}") from None
    vocab = int(target.config.vocab_size)
    if size >= vocab:
        say(f"draft vocabulary: N = {size} >= the vocabulary ({vocab}): training over the full vocabulary")
        return None, None
    fixed = out / DRAFT_VOCAB_FILE
    source = fixed if fixed.is_file() else Path(args.draft_vocab_from or Path(args.run) / "data" / "train.jsonl")
    ranking = load_draft_vocab_source(source, vocab, target.eos_token_ids)
    if not fixed.is_file():
        out.mkdir(parents=True, exist_ok=True)
        write_ranking(fixed, ranking)
    say(f"draft vocabulary: N = {size} of {vocab} (ranking {source})")
    return size, select_d2t(ranking["ranking"], size, vocab)


def _domain_weights(text: str | None) -> dict | None:
    """--domain-weights "code=2.5,chat=1.2" -> {"code": 2.5, "chat": 1.2}; None or "" -> None. Checked before
    anything loads or is written: each domain once, one of `record_domain`'s, a weight `TrainConfig` accepts."""
    from dspark_export.training.selfdata import RECORD_DOMAINS
    from dspark_export.training.trainer import check_domain_weights

    if not text:
        return None
    out = {}
    for part in text.split(","):
        name, eq, value = (x.strip() for x in part.partition("="))
        try:
            weight = float(value)
        except ValueError:
            weight = None
        if not eq or not name or weight is None:
            raise DsparkExportError(f"--domain-weights: expected DOMAIN=WEIGHT[,DOMAIN=WEIGHT...], found {part!r} "
                                    f"in {text!r}")
        if name not in RECORD_DOMAINS or name in out:
            raise DsparkExportError(f"--domain-weights: {'repeated' if name in out else 'unknown'} domain {name!r}; "
                                    f"expected each of {', '.join(RECORD_DOMAINS)} at most once")
        out[name] = weight
    check_domain_weights(out, "--domain-weights")
    return out


def _loss_weights(text: str | None):
    """--loss-weights "ce=1,l1=0.9" -> LossWeights(ce=1.0, l1=0.9, ...); terms not named keep DeepSpec's defaults.
    Checked before anything loads or is written."""
    from dspark_export.errors import ConfigError
    from dspark_export.training.objective import LossWeights

    if not text:
        return LossWeights()
    names = ("ce", "l1", "bce", "decay")
    out = {}
    for part in text.split(","):
        name, eq, value = (x.strip() for x in part.partition("="))
        try:
            weight = float(value)
        except ValueError:
            weight = None
        if not eq or weight is None or name not in names or name in out:
            raise DsparkExportError(f"--loss-weights: expected TERM=WEIGHT[,TERM=WEIGHT...] with each of "
                                    f"{', '.join(names)} at most once, found {part!r} in {text!r}")
        out[name] = weight
    try:
        return LossWeights(**out)
    except ConfigError as e:
        raise DsparkExportError(f"--loss-weights {text!r}: {e}") from None


def cmd_train(args, say):
    from dspark_export.modeling.checkpoint import save_drafter
    from dspark_export.training.draft_vocab import DRAFT_VOCAB_FILE
    from dspark_export.training.features import FeatureCache
    from dspark_export.training.selfdata import record_domain
    from dspark_export.training.trainer import TrainConfig, lr_path_from_metrics, train_drafter

    domain_weights = _domain_weights(args.domain_weights)   # bad input refused before anything loads
    loss_weights = _loss_weights(args.loss_weights)
    _, target = _target(args)
    out = Path(args.run) / args.name
    size, d2t = _train_d2t(args, target, out, say)
    cfg = TrainConfig(out_dir=str(out), variant=args.variant, num_draft_layers=args.layers, markov_rank=args.markov_rank,
                      target_layer_ids=tuple(args.taps) if args.taps else None, steps=args.steps,
                      seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq, lr=args.lr,
                      seed=args.seed, threads=args.threads, save_every=args.save_every, draft_vocab=size, bf16=args.bf16,
                      block_size=args.block_size, init_from=str(Path(args.init_from).resolve()) if args.init_from else None,
                      domain_weights=domain_weights, loss=loss_weights,
                      ce_labels=args.ce_labels, target_head=args.target_head)
    t0 = time.perf_counter()
    schedule = lr_path_from_metrics(args.lr_from) if args.lr_from else None
    eval_dir = Path(args.run) / "features" / "calibration"
    eval_cache = FeatureCache(eval_dir) if args.eval_limit and (eval_dir / "meta.json").is_file() else None
    if eval_cache is not None and not len(eval_cache):
        eval_cache = None
    if eval_cache is None and args.eval_limit:
        say(f"no calibration features in {eval_dir}: no τ per checkpoint")
    cache = FeatureCache(Path(args.run) / "features" / "train")
    domains = [record_domain(cache.source(i)) for i in range(len(cache))] if cfg.domain_weights else None
    drafter = train_drafter(target, cache, cfg, progress=say, time_budget_s=args.time_budget, lr_schedule=schedule,
                            d2t=d2t, eval_cache=eval_cache, eval_stride=args.eval_stride, eval_limit=args.eval_limit,
                            domains=domains)
    import torch

    step = torch.load(out / "training_state.pt", weights_only=True)["step"]
    if step < cfg.steps:
        say(f"stopped at step {step} of {cfg.steps} (state saved); run the same command again to continue")
        return
    state = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    save_drafter(drafter, out / "drafter")
    if d2t is not None:  # beside the checkpoint, as `draft-vocab` writes it (build --draft-vocab N reads it)
        shutil.copy2(out / DRAFT_VOCAB_FILE, out / "drafter" / DRAFT_VOCAB_FILE)
    (out / "train_summary.json").write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                                        "wall_s_this_call": round(time.perf_counter() - t0, 1),
                                                        "final": state}, indent=1))
    say(f"saved {out / 'drafter'}")


def cmd_calibrate(args, say):
    import numpy as np

    from dspark_export.modeling.checkpoint import load_drafter
    from dspark_export.training.calibration import (fit_calibration, reliability_bins, reliability_diagram,
                                                    replay_rounds, write_calibration)
    from dspark_export.training.features import FeatureCache

    _, target = _target(args)
    run = Path(args.run) / args.name
    folder = Path(args.drafter) if args.drafter else run / "drafter"
    drafter = load_drafter(folder, target).eval()
    d2t = None
    if args.draft_vocab:
        from dspark_export.training.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab_source, select_d2t

        ranking = load_draft_vocab_source(args.draft_vocab_from or folder / DRAFT_VOCAB_FILE,
                                          drafter.config.vocab_size, target.eos_token_ids)
        d2t = select_d2t(ranking["ranking"], args.draft_vocab, drafter.config.vocab_size)
    rounds = replay_rounds(drafter, FeatureCache(Path(args.run) / "features" / "calibration"), stride=args.stride,
                           d2t=d2t)
    out = Path(args.calibration_out) if args.calibration_out else run / "calibration"
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "rounds.npz", conf_logits=rounds.conf_logits, accepted=rounds.accepted,
                        valid=rounds.valid, sources=np.array(rounds.sources))
    per_dataset = {}
    for name in sorted(set(rounds.sources)):
        m = [s == name for s in rounds.sources]
        sub = type(rounds)(rounds.conf_logits[m], rounds.accepted[m], rounds.valid[m], [name] * sum(m))
        per_dataset[name] = {"rounds": int(sum(m)), "acceptance_length": round(sub.acceptance_length(), 4)}
    summary = {"acceptance_length": round(rounds.acceptance_length(), 4), "rounds": len(rounds.sources),
               "conditional_acceptance": [round(x, 4) for x in rounds.conditional_acceptance()],
               "datasets": per_dataset}
    if drafter.confidence_head is not None:
        fit = fit_calibration(rounds)
        summary["sts"] = fit
        fitted_on = "calibration split, greedy offline rounds" + (f", draft vocabulary N = {args.draft_vocab}"
                                                                   if args.draft_vocab else "")
        write_calibration(folder, fit, {"fitted_on": fitted_on,
                                                 "reliability": reliability_bins(rounds, fit["confidence_temperature"],
                                                                                 biases=fit["confidence_bias"])})
        reliability_diagram(rounds, fit["confidence_temperature"], out / "reliability.png", biases=fit["confidence_bias"])
        say(f"STS temperatures {fit['confidence_temperature']}, biases {fit['confidence_bias']}; ECE "
            f"{fit['mean_ece_before']:.4f} → {fit['mean_ece_after']:.4f}; temperature-only STS (σ(z/T) consumers) "
            f"{fit['temperature_only']['confidence_temperature']}, ECE → {fit['temperature_only']['mean_ece_after']:.4f}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    say(f"offline τ (T=0) {summary['acceptance_length']:.3f} over {summary['rounds']} rounds; per position "
        f"{summary['conditional_acceptance']}")


def cmd_export(args, say):
    import torch

    from dspark_export.modeling.checkpoint import load_drafter, save_drafter
    from dspark_export.training.calibration import CALIBRATION_FILE

    _, target = _target(args)
    src = Path(args.run) / args.name / "drafter"
    drafter = load_drafter(src, target)
    out = save_drafter(drafter, args.out, include_embeddings=False, dtype=torch.float16)
    from dspark_export.training.draft_vocab import DRAFT_VOCAB_FILE

    for name in (CALIBRATION_FILE, DRAFT_VOCAB_FILE):
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    size = sum(p.stat().st_size for p in out.iterdir())
    say(f"exported {out}: {size / 2**20:.2f} MiB")
    # `build --drafter DIR` treats any folder but the shipped asset as an imported checkpoint (fp32 target,
    # exact drafting); a candidate for the shipped drafter is compared on the shipped drafter's build.
    from dspark_export.pipeline import shipped_build_flags

    if args.target is None:                     # the embedded default, the target the shipped drafter serves
        say(f"to build it as the shipped drafter is built: dspark-export build --drafter {out} --out ENGINE_DIR "
            f"{shipped_build_flags()}")


def cmd_draft_vocab(args, say):
    from dspark_export.training.data import read_records
    from dspark_export.training.draft_vocab import DRAFT_VOCAB_FILE, count_response_tokens, ranking_object, write_ranking

    path, target = _target(args)
    src = Path(args.run) / "data" / "train.jsonl"
    records = read_records(src)
    if not records:
        from dspark_export.errors import ConfigError

        raise ConfigError(f"{src}: no response records (run the data stage first)")
    vocab = int(target.config.vocab_size)
    data = ranking_object(count_response_tokens(records, vocab), target.eos_token_ids,
                          f"target responses on the training split ({len(records)} records of {src.name})", len(records))
    out = write_ranking(Path(args.out) / DRAFT_VOCAB_FILE, data)
    say(f"wrote {out}: {len(data['ranking'])} distinct tokens of {vocab} in {data['tokens_counted']} response tokens")


def cmd_pack(args, say):
    from dspark_export.training.snapshot import pack

    added = pack(Path(args.run) / "data", Path(args.out))
    say(f"packed into {args.out}: " + (", ".join(f"{n} +{k} lines" for n, k in added.items()) or "nothing new"))


def cmd_unpack(args, say):
    from dspark_export.training.snapshot import unpack

    restored = unpack(Path(args.source), Path(args.run) / "data")
    say(f"restored into {Path(args.run) / 'data'}: "
        + (", ".join(f"{n} ({k} lines)" for n, k in restored.items()) or "nothing (the run folder holds as much)"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--run", required=True, help="run folder (data, features, trained drafters)")
    common.add_argument("--target", help="target folder or .gguf (default: the embedded SmolLM2)")
    common.add_argument("--taps", type=int, nargs="*", help="tapped target layers (default: 5 spread over the depth)")
    p = sub.add_parser("data", parents=[common])
    p.add_argument("--datasets-dir")
    p.add_argument("--limit", type=int, default=1400, help="training prompts at most (seeded shuffle)")
    p.add_argument("--calibration-limit", type=int, default=None, help="calibration prompts at most (default all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--sampled-fraction", type=float, default=0.3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", help="engine directory: answer through the project's runtime (else transformers)")
    p.add_argument("--policy", default="dspark", help="runtime policy of --engine (greedy output equals ar's)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="prompts handed to the runtime per call (it keeps its request slots busy by continuous "
                        "batching; records are written per call)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = its choice)")
    p.add_argument("--self-prompts", type=int, default=0, help="meta-prompt requests for self-written prompts")
    p.add_argument("--multi-turn", type=int, default=0, help="answered records to continue with a second user turn")
    p.add_argument("--max-turn-tokens", type=int, default=768, help="multi-turn prompts longer than this are skipped")
    p = sub.add_parser("features", parents=[common])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="compute dtype of the transformers target (without --engine)")
    p.add_argument("--engine", help="engine directory: features from its target graph as the engines compute "
                                    "them (the default build's int4), instead of the transformers target")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads with --engine (per "
                                                         "worker; with --workers the default is 1)")
    p.add_argument("--workers", type=int, default=1, help="processes with --engine, each on every W-th part of "
                                                         "64 sequences (2 single-threaded beat 1 with 2 threads)")
    p.add_argument("--limit", type=int, help="the first N records of each part at most (train on a cache while the "
                                             "data still grows; the same command without it completes the cache). "
                                             "Records are in the order they finished, not prompt order")
    p = sub.add_parser("train", parents=[common])
    p.add_argument("--name", default="dspark")
    p.add_argument("--variant", default="dspark", choices=["dspark", "dflash"])
    p.add_argument("--layers", type=int, default=1, help="drafter decoder layers")
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--block-size", type=int, default=7,
                   help="γ, draft tokens per block (the drafter block runs γ rows: its cost grows with it)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--anchors-per-seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--time-budget", type=float, help="stop (resumably) after this many seconds")
    p.add_argument("--bf16", action="store_true",
                   help="bfloat16 autocast for the matmuls (default fp32: faster on CPUs without fast bf16 matmul, "
                        "such as the 2-core machines here; reports/drafter/train-step-fp32.md)")
    p.add_argument("--draft-vocab", default=str(DEFAULT_TRAIN_DRAFT_VOCAB), metavar="N|full",
                   help="train over the top N tokens of the ranking (the rest pooled into one bucket of the loss) "
                        f"or the full vocabulary (default {DEFAULT_TRAIN_DRAFT_VOCAB}: the N the shipped drafter "
                        "is built with, so training optimises the distribution it drafts from)")
    p.add_argument("--draft-vocab-from", help="ranking: a draft_vocab.json or a responses JSONL (default "
                                              "<run>/data/train.jsonl; fixed in <run>/<name>/draft_vocab.json)")
    p.add_argument("--eval-stride", type=int, default=4, help="τ per checkpoint: every k-th calibration position")
    p.add_argument("--eval-limit", type=int, default=64,
                   help="τ per checkpoint over the first N calibration sequences (0 = no τ log)")
    p.add_argument("--domain-weights", metavar="DOMAIN=W,...",
                   help="draw records of a domain (math, code, chat: training.selfdata.record_domain) W times as "
                        "often as weight 1, e.g. code=2.5 (default: every record alike)")
    p.add_argument("--loss-weights", metavar="TERM=W,...",
                   help="the objective's weights, e.g. ce=1,l1=0.9 (terms ce, l1, bce and the position decay; "
                        "default DeepSpec's ce=0.1,l1=0.9,bce=1,decay=4). A higher ce leans the drafter toward the "
                        "target's argmax, what greedy (T = 0) acceptance counts; ce=1 raised τ but calibrated "
                        "worse and drafted slower at one user (reports/drafter/v9-ce)")
    p.add_argument("--ce-labels", choices=("token", "argmax"), default="token",
                   help="CE's label per draft slot: the record's next token (default) or the target's own argmax "
                        "there, computed from the cached final hidden (what greedy verification accepts; the two "
                        "differ on records the target sampled at T > 0)")
    p.add_argument("--target-head", choices=("fp32", "int4", "int8", "w8a8"), default="fp32",
                   help="the LM head the target's distribution is computed with: fp32 (default) or the engines' "
                        "--weights format, whose quantized head (dequantized) is what verifies the drafts; use the "
                        "format of the engine that wrote the features")
    p.add_argument("--init-from", metavar="DRAFTER_DIR",
                   help="start the run from a trained drafter of the same architecture (e.g. the shipped one; "
                        "γ may differ; --layers may exceed its depth: the new layers start as no-ops) instead of a "
                        "random init")
    p.add_argument("--lr-from", metavar="METRICS_JSONL",
                   help="follow another run's learning rate step by step (its metrics.jsonl), instead of "
                        "warmup + cosine: an ablation at an equal budget")
    p = sub.add_parser("calibrate", parents=[common])
    p.add_argument("--name", default="dspark")
    p.add_argument("--stride", type=int, default=2, help="replay a round at every k-th assistant position")
    p.add_argument("--drafter", help="drafter folder to calibrate in place (default <run>/<name>/drafter)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="replay with the draft vocabulary of this size (build --draft-vocab N)")
    p.add_argument("--draft-vocab-from", help="its ranking (default <drafter>/draft_vocab.json)")
    p.add_argument("--calibration-out", help="folder of rounds, summary and diagram (default <run>/<name>/calibration)")
    p = sub.add_parser("draft-vocab", parents=[common])
    p.add_argument("--out", required=True, help="drafter folder to write draft_vocab.json into")
    p = sub.add_parser("export", parents=[common])
    p.add_argument("--name", default="dspark")
    p.add_argument("--out", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--run", required=True, help="run folder whose data/*.jsonl are packed")
    p.add_argument("--out", required=True, help="snapshot folder (shards + shards.json)")
    p = sub.add_parser("unpack")
    p.add_argument("--run", required=True, help="run folder to restore data/*.jsonl into")
    p.add_argument("--from", dest="source", required=True, help="snapshot folder written by pack")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    say = _log(time.perf_counter())
    try:
        {"data": cmd_data, "features": cmd_features, "train": cmd_train, "calibrate": cmd_calibrate,
         "export": cmd_export, "draft-vocab": cmd_draft_vocab, "pack": cmd_pack,
         "unpack": cmd_unpack}[args.stage](args, say)
    except DsparkExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (state is saved; run the same command again to resume)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
