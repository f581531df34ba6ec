"""Drafter training loop: seeded, resumable, with progress and per-position metrics (paper §4.1;
DeepSpec reference §3: AdamW, lr 6e-4, 4 % linear warmup then cosine to 0, grad clip 1.0).

The shared embedding and LM head are copied from the target and frozen (`init_drafter`); every other
drafter tensor trains. State (drafter, optimizer, step, data RNG) is saved to
``<out>/training_state.pt`` every ``save_every`` steps and at the end, and a run started again with
the same ``out`` resumes from it. Metrics go to ``<out>/metrics.jsonl`` (one line per logged step).

Usage:
    cfg = TrainConfig(out_dir="runs/dspark", steps=1000)
    drafter = train_drafter(target, FeatureCache("cache/train"), cfg, progress=print)
"""

from __future__ import annotations

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
from .features import FeatureCache
from .objective import LossWeights, dspark_loss, make_batch

__all__ = ["TrainConfig", "train_drafter", "drafter_config_for", "lr_path_from_metrics"]


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
    bf16: bool = True
    save_every: int = 100
    log_every: int = 10
    threads: int = 0

    def __post_init__(self):
        if self.variant not in ("dspark", "dflash"):
            raise ConfigError(f"TrainConfig.variant: expected 'dspark' or 'dflash', found {self.variant!r}")
        for name in ("steps", "seqs_per_step", "anchors_per_seq", "num_draft_layers", "block_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"TrainConfig.{name}: expected an integer >= 1, found {value!r}")


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


def train_drafter(target, cache: FeatureCache, cfg: TrainConfig, progress: Callable[[str], None] | None = None,
                  *, stop_at: int | None = None, time_budget_s: float | None = None,
                  lr_schedule: Callable[[int], float] | None = None) -> DSparkDrafter:
    """Train (or resume) a drafter on a feature cache; returns it in eval mode with is_trained=True.

    `stop_at` (a step) and `time_budget_s` (wall seconds of this call) end the call early, with the
    state saved, as an interruption would; calling again with the same config continues the run
    (the learning-rate schedule always follows `cfg.steps`). `lr_schedule` (step index → lr, e.g.
    `lr_path_from_metrics`) replaces the warmup-cosine schedule for this call.

    Raises:
        ConfigError: the cache's taps differ from the drafter's, or the state file is from another config.
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
    drafter = init_drafter(target, dcfg, seed=cfg.seed).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    step = 0
    state_path = out / "training_state.pt"
    cfg_dict = dataclasses.asdict(cfg)
    if state_path.is_file():
        state = torch.load(state_path, weights_only=True)
        saved = {k: v for k, v in state["config"].items() if k not in ("steps", "save_every", "log_every", "threads")}
        mine = {k: v for k, v in cfg_dict.items() if k not in ("steps", "save_every", "log_every", "threads")}
        if saved != mine:
            raise ConfigError(f"{state_path}: saved for another config; differing fields "
                              f"{sorted(k for k in mine if saved.get(k) != mine[k])}")
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        step = state["step"]
        say(f"resumed {out} at step {step}")
    lengths = np.array([len(cache[i].tokens) for i in range(len(cache))])
    usable = np.nonzero(lengths - np.array([cache[i].prompt_len for i in range(len(cache))]) >= 2)[0]
    say(f"{len(usable)} sequences, {int(lengths[usable].sum())} tokens; {cfg.steps} steps × "
        f"{cfg.seqs_per_step} seqs × {cfg.anchors_per_seq} anchors; variant {cfg.variant}")

    def save():
        tmp = state_path.with_suffix(".tmp")
        torch.save({"config": cfg_dict, "drafter": drafter.state_dict(), "optimizer": opt.state_dict(),
                    "rng": rng.bit_generator.state, "step": step}, tmp)
        os.replace(tmp, state_path)

    t0, seen = time.perf_counter(), 0
    eta = Eta(cfg.steps, start=step)
    with (out / "metrics.jsonl").open("a", encoding="utf-8") as log:
        rng_at_step_start = None
        try:
            while step < min(cfg.steps, stop_at or cfg.steps):
                if time_budget_s is not None and time.perf_counter() - t0 > time_budget_s:
                    say(f"time budget of {time_budget_s:.0f} s reached at step {step}")
                    break
                rng_at_step_start = rng.bit_generator.state
                picks = rng.choice(usable, size=cfg.seqs_per_step, replace=False)
                seqs = []
                for i in picks:
                    s = cache[int(i)]
                    if len(s.tokens) > cfg.max_seq_len:
                        s.tokens, s.aux, s.last = (a[:cfg.max_seq_len] for a in (s.tokens, s.aux, s.last))
                    seqs.append(s)
                batch = make_batch(seqs, cfg.anchors_per_seq, dcfg.block_size, rng)
                for g in opt.param_groups:
                    g["lr"] = lr_at(step)
                loss, metrics = dspark_loss(drafter, batch, cfg.loss, bf16=cfg.bf16)
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
                           "elapsed_s": round(el, 1), **metrics}
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
            save()
            say(f"interrupted at step {step}; state saved")
            raise
        if step % cfg.save_every or step == 0:  # an early stop keeps its state too
            save()
    drafter.config = dcfg.replace(is_trained=True)
    return drafter.eval()
