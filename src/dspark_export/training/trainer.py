"""Drafter training loop: seeded, resumable, with progress and per-position metrics (paper §4.1;
DeepSpec reference §3: AdamW, lr 6e-4, 4 % linear warmup then cosine to 0, grad clip 1.0).

The shared embedding and LM head are copied from the target and frozen (`init_drafter`); every other
drafter tensor trains. State (the trained drafter tensors, optimizer, step, data RNG, d2t) is saved to
``<out>/training_state.pt`` every ``save_every`` steps and at the end, and a run started again with
the same ``out`` resumes from it. The frozen shared tensors are left out of the state (they are the
target's, copied again on resume): for SmolLM2 they are 2 × 113 MB of a ~250 MB state. Metrics go to
``<out>/metrics.jsonl`` (one line per logged step); with an evaluation cache, the offline τ of every saved
checkpoint (`calibration.replay_rounds`, T = 0, bonus included) goes to ``<out>/checkpoints.jsonl``.

Draft vocabulary (`TrainConfig.draft_vocab`, ``d2t``): the loss is computed over the N rows of d2t plus the
pooled bucket (`objective` module docstring); the target's full-vocabulary logsumexp per token, which the
bucket needs, is computed once per sequence (the target is frozen) and kept in memory.

Usage:
    cfg = TrainConfig(out_dir="runs/dspark", steps=1000)
    drafter = train_drafter(target, FeatureCache("cache/train"), cfg, progress=print)
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import ConfigError
from ..modeling.config import DrafterConfig
from ..modeling.drafter import DSparkDrafter, init_drafter
from ..progress import Eta
from .calibration import replay_rounds
from .features import FeatureCache
from .objective import CE_LABELS, LossWeights, dspark_loss, make_batch, response_targets

__all__ = ["TrainConfig", "train_drafter", "drafter_config_for", "lr_path_from_metrics", "target_head_weight", "TARGET_HEADS"]


#: The weights `TrainConfig.domain_weights` accepts: within it no draw probability underflows to 0 and no sum
#: of weights overflows.
DOMAIN_WEIGHT_RANGE = (1e-6, 1e6)


def check_domain_weights(weights, name: str) -> None:
    """Raise ConfigError (naming `name`, e.g. a flag) unless `weights` is a non-empty {domain: number} with every
    weight in DOMAIN_WEIGHT_RANGE."""
    low, high = DOMAIN_WEIGHT_RANGE
    if not isinstance(weights, dict) or not weights or not all(isinstance(k, str) for k in weights):
        raise ConfigError(f"{name}: expected a non-empty {{domain: weight}}, found {weights!r}")
    for domain, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not low <= w <= high:
            raise ConfigError(f"{name}: {domain}'s weight {w!r} is outside [{low:g}, {high:g}]")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one run. `variant` "dspark" (Markov + confidence heads) or "dflash"
    (both off: the ablation; same objective minus the BCE term, same budget)."""

    out_dir: str
    variant: str = "dspark"
    num_draft_layers: int = 1
    markov_rank: int = 64
    target_layer_ids: tuple | None = None  #: None = the default taps
    block_size: int = 7
    steps: int = 1000
    seqs_per_step: int = 4
    anchors_per_seq: int = 64
    max_seq_len: int = 768
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss: LossWeights = field(default_factory=LossWeights)
    seed: int = 0
    #: bfloat16 autocast for the matmuls. Off by default: on the 2-core machines this project runs on (AVX-512
    #: BF16, no usable AMX) an fp32 step is ~1.5x faster (reports/drafter/train-step-fp32.md)
    bf16: bool = False
    save_every: int = 100
    log_every: int = 10
    threads: int = 0
    draft_vocab: int | None = None  #: N of the d2t passed to `train_drafter`; None = the full vocabulary
    init_from: str | None = None  #: a trained drafter folder to start from (warm start); None = `init_drafter`
    #: sampling weight per record domain ({"code": 2.5}: a code record is drawn 2.5 times as often; domains not
    #: named weigh 1); None = every record alike. `train_drafter` then needs each record's domain.
    domain_weights: dict | None = None
    #: CE's label per draft slot (`objective.CE_LABELS`): "token", the record's next token, or "argmax", the target's
    #: own argmax there (what greedy verification accepts; differs from the token on records sampled at T > 0)
    ce_labels: str = "token"
    #: the LM head the target's distribution, logsumexp and argmax are computed with (`target_head_weight`): "fp32"
    #: (the shared float head) or the engines' `--weights` format, whose quantized head verifies the drafts
    target_head: str = "fp32"

    def __post_init__(self):
        if self.variant not in ("dspark", "dflash"):
            raise ConfigError(f"TrainConfig.variant: expected 'dspark' or 'dflash', found {self.variant!r}")
        for name in ("steps", "seqs_per_step", "anchors_per_seq", "num_draft_layers", "block_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"TrainConfig.{name}: expected an integer >= 1, found {value!r}")
        if self.draft_vocab is not None and (isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int)
                                             or self.draft_vocab < 1):
            raise ConfigError(f"TrainConfig.draft_vocab: expected None (full vocabulary) or an integer N >= 1, "
                              f"found {self.draft_vocab!r}")
        if self.domain_weights is not None:
            check_domain_weights(self.domain_weights, "TrainConfig.domain_weights")
        if self.target_head not in TARGET_HEADS:
            raise ConfigError(f"TrainConfig.target_head: expected one of {list(TARGET_HEADS)}, found {self.target_head!r}")
        if self.ce_labels not in CE_LABELS:
            raise ConfigError(f"TrainConfig.ce_labels: expected one of {list(CE_LABELS)}, found {self.ce_labels!r}")


def drafter_config_for(target, cfg: TrainConfig) -> DrafterConfig:
    dspark = cfg.variant == "dspark"
    return DrafterConfig.from_target(
        target.config, num_draft_layers=cfg.num_draft_layers, target_layer_ids=cfg.target_layer_ids,
        block_size=cfg.block_size, markov_rank=cfg.markov_rank if dspark else 0,
        enable_confidence_head=dspark, confidence_head_with_markov=dspark, num_anchors=cfg.anchors_per_seq)


def _lr_at(step: int, cfg: TrainConfig) -> float:
    warm = max(1, int(round(cfg.warmup_ratio * cfg.steps)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    progress = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def lr_path_from_metrics(path: str | Path) -> Callable[[int], float]:
    """The learning rate of another run, step by step, read from its ``metrics.jsonl``: step index i
    (0-based) gets the lr logged with ``"step": i + 1`` (the lr that step used), linearly interpolated
    between logged steps and held flat past the ends. For ablations at an equal budget when the
    reference run was resumed under changing schedules.

    Raises:
        ConfigError: the file is missing, a line is not JSON with numeric "step" and "lr", or it has no rows.
    """
    path = Path(path)
    steps, lrs = [], []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the learning-rate path ({e})") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step, lr = float(row["step"]), float(row["lr"])
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}:{n}: expected a JSON object with numeric 'step' and 'lr', found {line[:80]!r}") from e
        steps.append(step)
        lrs.append(lr)
    if not steps:
        raise ConfigError(f"{path}: no metrics rows to take a learning-rate path from")
    order = np.argsort(steps, kind="stable")
    xs, ys = np.asarray(steps)[order], np.asarray(lrs)[order]
    return lambda i: float(np.interp(i + 1, xs, ys))


#: Drafter config fields a warm start may change: none of them shapes a trained tensor (the block runs γ rows of
#: the same weights; anchors are a training-batch size). `num_hidden_layers` may also grow (`_warm_start`).
_WARM_START_FREE = {"block_size", "num_anchors", "is_trained"}


def _warm_start(drafter: DSparkDrafter, target, folder: Path) -> None:
    """Copy a trained drafter's tensors (e.g. the shipped one, fp16 on disk) into ``drafter``, whose config
    must equal the checkpoint's up to `_WARM_START_FREE` and a deeper stack; the shared embedding and head stay
    the target's.

    Depth growth: when ``drafter`` has more decoder layers than the checkpoint, each new layer (appended after
    the checkpoint's last) starts as a copy of that last layer with its residual outputs (``o_proj``,
    ``down_proj``) zeroed, so the grown drafter drafts exactly as the checkpoint does at step 0 and training
    only adds to it (function-preserving growth, Net2Net's idea for depth). Its context K/V projections are
    the copied layer's, so its attention starts from a trained pattern.

    Raises:
        ConfigError: the checkpoint's architecture differs (the fields named, both values), or it is deeper
            than this run's drafter.
        CheckpointError: the folder is not a loadable drafter (`load_drafter`'s errors).
    """
    from ..modeling.checkpoint import load_drafter

    source = load_drafter(folder, target)
    have, want = source.config.num_hidden_layers, drafter.config.num_hidden_layers
    differ = [(f.name, getattr(source.config, f.name), getattr(drafter.config, f.name))
              for f in dataclasses.fields(drafter.config)
              if f.compare and f.name not in _WARM_START_FREE | {"num_hidden_layers"}
              and getattr(source.config, f.name) != getattr(drafter.config, f.name)]
    if want < have:
        differ.append(("num_hidden_layers", have, want))
    if differ:
        raise ConfigError(f"--init-from {folder}: the checkpoint's architecture differs from this run's in "
                          + ", ".join(f"{k} (checkpoint {a!r}, run {b!r})" for k, a, b in differ)
                          + ("; a warm start may add layers, not remove them" if want < have else ""))
    with torch.no_grad():
        shared = {n for n, p in drafter.named_parameters() if not p.requires_grad}
        mine = drafter.state_dict()
        for name, tensor in source.state_dict().items():
            if name not in shared:
                mine[name].copy_(tensor)
        for layer in drafter.layers[have:]:
            layer.load_state_dict(source.layers[-1].state_dict())
            for residual_out in (layer.self_attn.o_proj, layer.mlp.down_proj):
                for param in residual_out.parameters():
                    param.zero_()


def _pick_probabilities(cfg: TrainConfig, domains: list[str] | None, num_records: int,
                        usable: np.ndarray) -> np.ndarray | None:
    """The probability of drawing each usable record ([len(usable)], sums to 1), or None (uniform)."""
    if cfg.domain_weights is None:
        return None
    if domains is None or len(domains) != num_records:
        raise ConfigError(f"train_drafter: TrainConfig.domain_weights needs one domain per record "
                          f"({num_records}), found {None if domains is None else len(domains)}")
    unknown = sorted(set(cfg.domain_weights) - set(domains))
    if unknown:
        raise ConfigError(f"TrainConfig.domain_weights: no record has domain {unknown}; the records' domains are "
                          f"{sorted(set(domains))}")
    weights = np.array([float(cfg.domain_weights.get(domains[i], 1.0)) for i in usable])
    return weights / weights.sum()


#: `TrainConfig.target_head` values: the float head, or a target weight format (`exporter.quantize.WEIGHT_FORMATS`)
TARGET_HEADS = ("fp32", "int4", "int8", "w8a8")


def target_head_weight(W: torch.Tensor, fmt: str) -> torch.Tensor:
    """The LM head [V, H] float32 that a target built with `--weights fmt` verifies with: W itself for "fp32";
    for "int4" / "int8" MatMulNBits' blocks (`quantize_blocks`, ONNX Runtime's quantizer) dequantized; for
    "w8a8" the per-row int8 weights (`quantize_rows_int8`) times their scales. Why: a quantized engine's greedy
    token leaves the float head's argmax at near-ties (on SmolLM2's int4 default, 4.8 % of greedy response
    positions, against 0.5 % with this head; reports/drafter/v10-target-head/), so a drafter trained on the
    float head learns the wrong token there. The kernels' int8 activations are not modelled."""
    if fmt not in TARGET_HEADS:
        raise ConfigError(f"target head: expected one of {list(TARGET_HEADS)}, found {fmt!r}")
    if fmt == "fp32":
        return W
    from ..exporter.quantize import WeightFormat, dequantize_blocks, quantize_blocks, quantize_rows_int8

    w = W.detach().float().numpy()
    if fmt == "w8a8":
        w_q, scale = quantize_rows_int8(w)          # [H, V] int8, [V]
        return torch.from_numpy((w_q.T.astype(np.float32) * scale[:, None]).astype(np.float32))
    f = WeightFormat(fmt)
    return torch.from_numpy(np.ascontiguousarray(dequantize_blocks(*quantize_blocks(w.T, f), f, w.shape[1]).T))


def train_drafter(target, cache: FeatureCache, cfg: TrainConfig, progress: Callable[[str], None] | None = None,
                  *, stop_at: int | None = None, time_budget_s: float | None = None,
                  lr_schedule: Callable[[int], float] | None = None, d2t=None,
                  eval_cache: FeatureCache | None = None, eval_stride: int = 4,
                  eval_limit: int | None = None, domains: list[str] | None = None) -> DSparkDrafter:
    """Train (or resume) a drafter on a feature cache; returns it in eval mode with is_trained=True.

    `stop_at` (a step) and `time_budget_s` (wall seconds of this call) end the call early, with the
    state saved, as an interruption would; calling again with the same config continues the run
    (the learning-rate schedule always follows `cfg.steps`). `lr_schedule` (step index → lr, e.g.
    `lr_path_from_metrics`) replaces the warmup-cosine schedule for this call. `d2t` [N] (token ids,
    N = `cfg.draft_vocab`): train over the draft vocabulary. `eval_cache` (e.g. the calibration split's
    features): at every checkpoint, the offline τ over its first `eval_limit` sequences at every
    `eval_stride`-th position is appended to ``checkpoints.jsonl`` (drafts over d2t when given).
    `domains` [len(cache)] (e.g. `selfdata.record_domain` of each record): with `cfg.domain_weights`, each
    step draws its sequences (without replacement) with probability ∝ the weight of their domain.

    Raises:
        ConfigError: the cache's taps differ from the drafter's, the state file is from another config or
            another d2t, d2t does not match `cfg.draft_vocab`, or `domains` is missing (with domain weights)
            or not one per record.
    """
    say = progress or (lambda line: None)
    lr_at = lr_schedule or (lambda i: _lr_at(i, cfg))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dcfg = drafter_config_for(target, cfg)
    if list(dcfg.target_layer_ids) != cache.target_layer_ids:
        raise ConfigError(f"{cache.folder}: features were cached for taps {cache.target_layer_ids} but the drafter "
                          f"taps {list(dcfg.target_layer_ids)}")
    if (d2t is None) != (cfg.draft_vocab is None) or (d2t is not None and len(d2t) != cfg.draft_vocab):
        raise ConfigError(f"train_drafter: d2t of {None if d2t is None else len(d2t)} tokens does not match "
                          f"TrainConfig.draft_vocab = {cfg.draft_vocab!r}")
    if d2t is not None:
        d2t = torch.as_tensor(np.asarray(d2t), dtype=torch.long)
        if d2t.ndim != 1 or int(d2t.min()) < 0 or int(d2t.max()) >= dcfg.vocab_size or \
                torch.unique(d2t).numel() != d2t.numel():
            raise ConfigError(f"train_drafter: d2t: expected {cfg.draft_vocab} distinct token ids in "
                              f"[0, {dcfg.vocab_size})")
    if eval_cache is not None:
        n = len(eval_cache) if eval_limit is None else min(eval_limit, len(eval_cache))
        if not any((eval_cache[i].source.get("temperature") or 0) == 0 for i in range(n)):
            raise ConfigError(f"{eval_cache.folder}: the τ evaluation needs greedy (temperature 0) records among its "
                              f"first {n} sequences, found none")
    drafter = init_drafter(target, dcfg, seed=cfg.seed).train()
    state_path = out / "training_state.pt"
    warmed = bool(cfg.init_from) and not state_path.is_file()
    if warmed:
        _warm_start(drafter, target, Path(cfg.init_from))
        say(f"warm start from {cfg.init_from}")
    params = [p for p in drafter.parameters() if p.requires_grad]
    frozen = {n for n, p in drafter.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    step, prior_s, eval_s = 0, 0.0, 0.0
    cfg_dict = dataclasses.asdict(cfg)
    if state_path.is_file():
        state = torch.load(state_path, weights_only=True)
        saved = {k: v for k, v in state["config"].items() if k not in ("steps", "save_every", "log_every", "threads")}
        mine = {k: v for k, v in cfg_dict.items() if k not in ("steps", "save_every", "log_every", "threads")}
        saved.setdefault("draft_vocab", None)  # states written before the draft-vocabulary loss
        saved.setdefault("init_from", None)  # states written before warm starts
        saved.setdefault("domain_weights", None)  # states written before domain-weighted sampling
        saved.setdefault("ce_labels", "token")  # states written before argmax CE labels
        saved.setdefault("target_head", "fp32")  # states written before quantized target heads
        if saved != mine:
            raise ConfigError(f"{state_path}: saved for another config; differing fields "
                              f"{sorted(k for k in mine if saved.get(k) != mine[k])}")
        saved_d2t = state.get("d2t")
        if (saved_d2t is None) != (d2t is None) or (d2t is not None and not torch.equal(saved_d2t, d2t)):
            raise ConfigError(f"{state_path}: saved with another draft vocabulary (d2t); use another run folder")
        missing, unexpected = drafter.load_state_dict(state["drafter"], strict=False)
        if unexpected or set(missing) - frozen:
            raise ConfigError(f"{state_path}: drafter tensors do not match this config (missing "
                              f"{sorted(set(missing) - frozen)}, unexpected {sorted(unexpected)})")
        opt.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        step = state["step"]
        prior_s = float(state.get("train_s", 0.0))
        say(f"resumed {out} at step {step}")
    lengths = np.array([cache.length(i) for i in range(len(cache))])
    usable = np.nonzero(lengths - np.array([cache.prompt_len(i) for i in range(len(cache))]) >= 2)[0]
    say(f"{len(usable)} sequences, {int(lengths[usable].sum())} tokens; {cfg.steps} steps × "
        f"{cfg.seqs_per_step} seqs × {cfg.anchors_per_seq} anchors; variant {cfg.variant}")
    pick_p = _pick_probabilities(cfg, domains, len(cache), usable)
    if pick_p is not None:
        shares = collections.Counter()
        for i, p in zip(usable, pick_p):
            shares[domains[i]] += p
        say("sampling by domain: " + ", ".join(f"{d} {100 * v:.0f} %" for d, v in sorted(shares.items())))

    def save(evaluate: bool = True):
        nonlocal eval_s
        tmp = state_path.with_suffix(".tmp")
        trained = {k: v for k, v in drafter.state_dict().items() if k not in frozen}
        torch.save({"config": cfg_dict, "drafter": trained, "optimizer": opt.state_dict(),
                    "rng": rng.bit_generator.state, "step": step, "d2t": d2t, "train_s": train_s()}, tmp)
        os.replace(tmp, state_path)
        if evaluate and eval_cache is not None and step not in logged:
            e0 = time.perf_counter()
            drafter.eval()
            rounds = replay_rounds(drafter, eval_cache, stride=eval_stride, limit=eval_limit,
                                   d2t=None if d2t is None else d2t.numpy())
            drafter.train()
            row = {"step": step, "tau": round(rounds.acceptance_length(), 4), "rounds": len(rounds.sources),
                   "conditional_acceptance": [round(x, 4) for x in rounds.conditional_acceptance()],
                   "train_s": round(train_s(), 1), "eval_s": round(time.perf_counter() - e0, 1)}
            eval_s += time.perf_counter() - e0
            with checkpoints.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            logged.add(step)
            say(f"checkpoint at step {step}: offline τ {row['tau']:.3f} over {row['rounds']} rounds")

    def train_s() -> float:
        """Training wall seconds of the whole run (resumed calls added up; τ evaluations left out)."""
        return prior_s + time.perf_counter() - t0 - eval_s

    checkpoints = out / "checkpoints.jsonl"
    logged = {json.loads(line)["step"] for line in checkpoints.read_text(encoding="utf-8").splitlines()
              if line.strip()} if checkpoints.is_file() else set()

    W_head = target_head_weight(drafter.lm_head.weight.detach(), cfg.target_head)
    target_head = None if cfg.target_head == "fp32" else W_head
    lse_memo: dict[int, tuple] = {}  # sequence index → its response rows' (logsumexp [T], argmax [T]) over V

    t0, seen = time.perf_counter(), 0
    if cfg.init_from and step == 0 and (eval_cache is None or 0 not in logged):
        save()  # step 0: the starting point's τ on this run's features and γ, the baseline the run is read against
    eta = Eta(cfg.steps, start=step)
    with (out / "metrics.jsonl").open("a", encoding="utf-8") as log:
        rng_at_step_start = None
        try:
            while step < min(cfg.steps, stop_at or cfg.steps):
                if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                    say(f"time budget of {time_budget_s:.0f} s reached at step {step}")
                    break
                rng_at_step_start = rng.bit_generator.state
                picks = rng.choice(usable, size=cfg.seqs_per_step, replace=False, p=pick_p)
                seqs = []
                for i in picks:
                    s = cache[int(i)]
                    if len(s.tokens) > cfg.max_seq_len:
                        s.tokens, s.aux, s.last = (a[:cfg.max_seq_len] for a in (s.tokens, s.aux, s.last))
                    if d2t is not None or cfg.ce_labels == "argmax":
                        if int(i) not in lse_memo:
                            lse_memo[int(i)] = response_targets(s, W_head, bf16=cfg.bf16)
                        lse, top = lse_memo[int(i)]
                        s.t_lse = lse if d2t is not None else None
                        s.t_argmax = top if cfg.ce_labels == "argmax" else None
                    seqs.append(s)
                batch = make_batch(seqs, cfg.anchors_per_seq, dcfg.block_size, rng, ce_labels=cfg.ce_labels)
                for g in opt.param_groups:
                    g["lr"] = lr_at(step)
                loss, metrics = dspark_loss(drafter, batch, cfg.loss, bf16=cfg.bf16, d2t=d2t, target_head=target_head)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
                opt.step()
                step += 1   # the step is complete: drafter, optimizer and data RNG all moved past it
                rng_at_step_start = None
                seen += int(batch.keep.sum())
                if step % cfg.log_every == 0 or step == cfg.steps:
                    el = time.perf_counter() - t0
                    row = {"step": step, "lr": round(lr_at(step - 1), 7), "grad_norm": round(grad_norm, 4),
                           "elapsed_s": round(el, 1), "train_s": round(train_s(), 1), **metrics}
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    say(f"step {step}/{cfg.steps} loss {metrics['loss']:.4f} ce {metrics['ce']:.3f} "
                        f"l1 {metrics['l1']:.3f} τ_p {metrics['tau_probabilistic']:.2f} "
                        f"acc {metrics['accept_rate'][:4]} {seen / el:.0f} blocks/s, {el:.0f} s, {eta.text(step)}")
                if step % cfg.save_every == 0 or step == cfg.steps:
                    save()
        except KeyboardInterrupt:
            # A step cut short is redone on resume: its batch is drawn again from the data RNG as it was
            # when the step began. (Ctrl-C inside opt.step() itself may leave that step's update half
            # applied; better than losing up to save_every steps.)
            if rng_at_step_start is not None:
                rng.bit_generator.state = rng_at_step_start
            save(evaluate=False)
            say(f"interrupted at step {step}; state saved")
            raise
        if step % cfg.save_every or step == 0:  # an early stop keeps its state too
            save()
    drafter.config = dcfg.replace(is_trained=True)
    return drafter.eval()
