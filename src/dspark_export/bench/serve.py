"""Closed-loop serving benchmark over an engine directory (DSpark paper §5, Fig. 7 and Fig. 8).

For each policy and concurrency C, ONE `Generator` serves a closed loop: C requests are submitted at
once, and each time one finishes a new one is submitted (before the next step), until `requests`
have completed. Prompts are the first turns of the eval datasets (chat template), each dataset
shuffled with the seed, drawn round-robin across datasets; every (policy, C) run sees the same
prompt sequence. With `repeats` > 1 each (policy, C) runs that many times, interleaved with the other
policies at the same C (see `ServeBenchConfig.repeats`); a row then reports medians over its runs.

Measurements (wall clock, `time.perf_counter`):

- steady window: from the first submission to the end of the first step after which a finished
  request could not be replaced (the loop has run out of requests); until then exactly C requests
  are in flight at every step (queued in the generator when C exceeds its slots). The drain tail
  is excluded. `throughput_tokens_per_s` = output tokens committed in the window / its wall time;
  `mean_step_ms` and `scheduler_ms` are per step in the window. The window ends at a completion: requests
  that finish together (ar at equal lengths) owe nothing then, requests that drift apart (speculation)
  owe part of their tokens after paying their prefill, which reads them low by O(C / requests): ~0.8 % at
  C = 4 and 32 requests, ~0.5 % at 64 (reports/serve/window-bias.md).
- per user: each request's completion tokens / its own latency from submission to finish (queueing,
  prefill and first token included); mean, p50, p90 over all requests of the run.
- `mean_verify_len` = Σ draft_tokens / Σ rounds (drafts verified per request per step; the anchor
  row is not counted), `acceptance_length` τ = Σ committed_in_rounds / Σ rounds (bonus included),
  both over all requests of the run.
- `drafter_steps_skipped`: steps whose drafter block was skipped: by `dspark-async` because the capacity
  K* from earlier confidences was 0 under the drafter cost (`SkipController.draft_count`), by both it and
  `dspark` where not even drafts that all survive would pay (`DraftController.can_pay`).
- `scheduler_ms`: time inside `Policy.verify_lengths` per step, measured by a timing subclass of
  the policy handed to the generator (the runtime is not modified); 0 for `ar`, which never calls it.
- `throughput_ratio_to_ar`, `per_user_ratio_to_ar` (when `ar` is among the policies): the row's number
  over `ar`'s in the same repeat at the same C, median over repeats; `*_runs` lists each repeat's ratio.
  A CPU's speed drifts by ±10-15 % between runs a minute apart (SmolLM2, 2 cores); a paired ratio
  over several repeats is what to compare policies by, not one run's tokens/s.

Before each measured run the engines are warmed up (C short requests, not measured) so lazily
initialised ONNX Runtime sessions do not count, and the KV caches' arenas are written once at the size
the run reaches (`KVCache.prefault`), so no measured step pays first touch of fresh pages. Greedy identity spot check: the first
`identity_checks` completed requests of every run are compared with an `ar` solo run of the same
prompt (temperature 0 only).

Usage:
    from dspark_export.bench import ServeBenchConfig, run_serve_bench, write_reports
    result = run_serve_bench(ServeBenchConfig("engines/smollm2", concurrency=(1, 4)), progress=print)
    write_reports(result, "reports/serve")
"""

from __future__ import annotations

import gc
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import ConfigError, RequestError
from ..progress import Eta
from ..runtime.generator import Generator
from ..runtime.policies import Policy, parse_policy
from ..runtime.request import SamplingParams
from ..datasets import read_dataset
from .common import as_tuple, check_datasets, check_engine_dir, check_generation, dedupe, is_int

__all__ = ["ServeBenchConfig", "run_serve_bench", "write_reports",
           "DEFAULT_CONCURRENCY", "DEFAULT_POLICIES", "DEFAULT_DATASETS"]

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
DEFAULT_POLICIES = ("ar", "fixed:1", "dspark", "dspark-async")   # fixed:K needs K ≤ the engines' γ
DEFAULT_DATASETS = ("gsm8k", "humaneval", "mt-bench")
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class ServeBenchConfig:
    """What to measure. Validated on construction (ConfigError names the field, expected vs found).

    Attributes:
        engine_dir: a built engine directory (holds manifest.json).
        concurrency: the concurrency levels C (requests kept in flight), each ≥ 1.
        policies: policy texts ("ar", "fixed:K", "threshold:C", "dspark", "dspark-async").
        requests: completed requests per (policy, C); None = max(4, 2·C). Must be ≥ every C.
        datasets: dataset names, read from `<datasets_dir>/<name>.jsonl` ({"turns": [...]} per line).
        datasets_dir: folder of the datasets; None = `default_datasets_dir()` (required if that is None).
        max_new_tokens: tokens per request (exactly this many unless EOS comes first).
        temperature: 0 = greedy (the identity spot check runs only then).
        seed: seeds the prompt shuffle and the requests' sampling.
        chat: apply the tokenizer's chat template to each prompt.
        warmup: run C short unmeasured requests before each measured run.
        identity_checks: completed requests per run compared with an `ar` solo run (greedy only).
        threads: ONNX Runtime intra-op threads per session; 0 = ORT's choice.
        repeats: measured runs per (policy, C), ≥ 1. At each C the policies run in turn, repeat after
            repeat (the order rotated by one each repeat), so a machine whose speed drifts slows every
            policy alike; each row reports medians over its repeats and every run's throughput.
    """

    engine_dir: str | Path
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    policies: tuple[str, ...] = DEFAULT_POLICIES
    requests: int | None = None
    datasets: tuple[str, ...] = DEFAULT_DATASETS
    datasets_dir: str | Path | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    chat: bool = True
    warmup: bool = True
    identity_checks: int = 2
    threads: int = 0
    repeats: int = 1

    def __post_init__(self):
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        put("engine_dir", check_engine_dir(self.engine_dir))

        concurrency = as_tuple(self.concurrency, "concurrency")
        if not concurrency or not all(is_int(c) and c >= 1 for c in concurrency):
            raise ConfigError(f"concurrency: expected a non-empty list of integers >= 1, found {list(concurrency)}")
        put("concurrency", dedupe(int(c) for c in concurrency))

        policies = as_tuple(self.policies, "policies")
        if not policies:
            raise ConfigError("policies: expected at least one policy, found none")
        parsed = []
        for p in policies:
            try:
                parsed.append(str(parse_policy(p)))
            except RequestError as e:
                raise ConfigError(str(e)) from None
        put("policies", dedupe(parsed))

        if self.requests is not None:
            if not is_int(self.requests) or self.requests < 1:
                raise ConfigError(f"requests: expected an integer >= 1 or None (= max(4, 2·C)), "
                                  f"found {self.requests!r}")
            if self.requests < max(self.concurrency):
                raise ConfigError(f"requests: a closed loop of C requests needs at least C of them; expected >= "
                                  f"{max(self.concurrency)} (the largest concurrency), found {self.requests}")
            put("requests", int(self.requests))

        if not is_int(self.repeats) or self.repeats < 1:
            raise ConfigError(f"repeats: expected an integer >= 1, found {self.repeats!r}")
        put("repeats", int(self.repeats))

        datasets, folder = check_datasets(self.datasets, self.datasets_dir)
        put("datasets", datasets)
        put("datasets_dir", folder)
        put("temperature", check_generation(self.max_new_tokens, self.temperature, seed=self.seed,
                                            identity_checks=self.identity_checks, threads=self.threads))

    def requests_for(self, concurrency: int) -> int:
        """Completed requests of the (policy, C) run: `requests`, or max(4, 2·C)."""
        return self.requests if self.requests is not None else max(4, 2 * concurrency)

    def to_dict(self) -> dict:
        return {"engine_dir": str(self.engine_dir), "concurrency": list(self.concurrency),
                "policies": list(self.policies), "requests": self.requests,
                "requests_per_run": {str(c): self.requests_for(c) for c in self.concurrency},
                "datasets": list(self.datasets), "datasets_dir": str(self.datasets_dir),
                "max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "seed": self.seed,
                "chat": self.chat, "warmup": self.warmup, "identity_checks": self.identity_checks,
                "threads": self.threads, "repeats": self.repeats}


# -- prompts -----------------------------------------------------------------------------------
class _Prompts:
    """The seeded round-robin prompt sequence, encoded lazily; prompts that cannot fit
    prompt + max_new_tokens in the engine's context are skipped (counted)."""

    def __init__(self, cfg: ServeBenchConfig, encode: Callable[[str], list[int]], max_context: int):
        self.names = list(cfg.datasets)
        self.texts = {}
        for i, name in enumerate(self.names):
            texts = read_dataset(cfg.datasets_dir / f"{name}.jsonl")
            order = np.random.default_rng([cfg.seed, i]).permutation(len(texts))
            self.texts[name] = [(int(j), texts[j]) for j in order]   # (line index among prompts, text)
        self.encode, self.limit = encode, max_context - cfg.max_new_tokens
        self.sequence: list[tuple[str, int, list[int]]] = []     # (dataset, prompt index in its file, ids)
        self._cursor = {name: 0 for name in self.names}
        self.skipped = Counter()

    def _next_from(self, name: str) -> tuple[str, int, list[int]]:
        texts = self.texts[name]
        for _ in range(len(texts)):
            k, text = texts[self._cursor[name] % len(texts)]
            self._cursor[name] += 1
            ids = self.encode(text)
            if 1 <= len(ids) <= self.limit:
                return name, k, ids
            self.skipped[name] += 1
        raise ConfigError(f"dataset {name}: no prompt fits the engine's context ({self.limit} prompt tokens "
                          f"left after max_new_tokens); lower max_new_tokens or pick other datasets")

    def first(self, n: int) -> list[tuple[str, int, list[int]]]:
        while len(self.sequence) < n:
            self.sequence.append(self._next_from(self.names[len(self.sequence) % len(self.names)]))
        return self.sequence[:n]


# -- timing ------------------------------------------------------------------------------------
class _TimedPolicy(Policy):
    """The same policy; `verify_lengths` adds its wall time to `self.clock[0]` (seconds)."""

    def verify_lengths(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return super().verify_lengths(*args, **kwargs)
        finally:
            self.clock[0] += time.perf_counter() - t0


def _timed(policy: Policy) -> _TimedPolicy:
    timed = _TimedPolicy(policy.name, policy.k, policy.threshold)
    object.__setattr__(timed, "clock", [0.0])   # Policy is frozen
    return timed


@dataclass
class _Req:
    key: tuple[str, int]
    prompt: list[int]
    t_submit: float
    t_first: float | None = None
    t_finish: float | None = None
    tokens: int = 0


@dataclass
class _Run:
    """Raw measurements of one (policy, C) closed loop."""

    records: dict[int, _Req] = field(default_factory=dict)
    completed: list[int] = field(default_factory=list)
    window_s: float = 0.0
    window_steps: int = 0
    window_tokens: int = 0
    window_step_s: float = 0.0
    window_sched_s: float = 0.0
    wall_s: float = 0.0
    max_in_flight: int = 0


def _warm_up(gen: Generator, prompts: list, concurrency: int, params: SamplingParams, past_prompt: int) -> None:
    """Run the first `concurrency` prompts on `gen` (unmeasured), then prefault its KV caches' arenas at the
    layout the closed loop reaches: the slot bucket of C requests × (longest prompt + `past_prompt` entries),
    so that no measured step grows into fresh pages (`KVCache.prefault`). The arenas pass to the next
    generator on these engines through their pool once `gen` is collected."""
    gen.generate([ids for _, _, ids in prompts[:concurrency]], [params] * min(concurrency, len(prompts)))
    gen.batch.prefault_kv(max(len(ids) for _, _, ids in prompts) + past_prompt, concurrency)


def _closed_loop(gen: Generator, prompts: list, concurrency: int, params: SamplingParams) -> _Run:
    """Keep `concurrency` requests in flight on `gen` until len(prompts) have completed."""
    run = _Run()
    just_finished: list[int] = []
    tokens = [0]

    def on_token(rid, new_tokens, result):
        rec = run.records.get(rid)
        if rec is None:                 # failed inside submit; reported there
            return
        now = time.perf_counter()
        tokens[0] += len(new_tokens)
        rec.tokens += len(new_tokens)
        if new_tokens and rec.t_first is None:
            rec.t_first = now
        if result.finish_reason is not None:
            rec.t_finish = now
            just_finished.append(rid)

    def submit_next():
        name, k, ids = prompts[len(run.records)]
        rec = _Req((name, k), ids, time.perf_counter())
        rid = gen.submit(ids, params, on_token)     # tokens come only from step(), after this returns
        run.records[rid] = rec
        result = gen.result(rid)
        if result.finish_reason == "error":
            raise RequestError(f"serve bench: request on {name} prompt #{k} failed: {result.error}")

    t_start = time.perf_counter()
    for _ in range(concurrency):
        submit_next()
    steady = True
    while gen.has_work():
        run.max_in_flight = max(run.max_in_flight, len(run.records) - len(run.completed))
        tok0, sched0 = tokens[0], gen.policy.clock[0]
        t0 = time.perf_counter()
        gen.step()
        t1 = time.perf_counter()
        if steady:
            run.window_steps += 1
            run.window_tokens += tokens[0] - tok0
            run.window_step_s += t1 - t0
            run.window_sched_s += gen.policy.clock[0] - sched0
        done, just_finished[:] = list(just_finished), []
        for rid in done:
            run.completed.append(rid)
            if len(run.records) < len(prompts):
                submit_next()
            elif steady:
                steady, run.window_s = False, t1 - t_start
    run.wall_s = time.perf_counter() - t_start
    if steady:                          # unreachable: the last completion is never replaced
        run.window_s = run.wall_s
    return run


def _percentile(values, q) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def _summarise(policy: str, concurrency: int, gen: Generator, run: _Run) -> dict:
    recs = [run.records[rid] for rid in run.completed]
    results = [gen.result(rid) for rid in run.completed]
    latency = [r.t_finish - r.t_submit for r in recs]
    per_user = [r.tokens / lat if lat > 0 else 0.0 for r, lat in zip(recs, latency)]
    ttft = [r.t_first - r.t_submit for r in recs if r.t_first is not None]
    rounds = sum(r.stats.rounds for r in results)
    drafts = sum(r.stats.draft_tokens for r in results)
    committed = sum(r.stats.committed_in_rounds for r in results)
    output_tokens = sum(r.tokens for r in recs)
    step_ms = 1e3 * run.window_step_s / run.window_steps if run.window_steps else 0.0
    sched_ms = 1e3 * run.window_sched_s / run.window_steps if run.window_steps else 0.0
    return {
        "policy": policy,
        "concurrency": concurrency,
        "requests": len(recs),
        "throughput_tokens_per_s": round(run.window_tokens / run.window_s, 3) if run.window_s > 0 else 0.0,
        "per_user_tokens_per_s": round(float(np.mean(per_user)), 3),
        "per_user_tokens_per_s_p50": round(_percentile(per_user, 50), 3),
        "per_user_tokens_per_s_p90": round(_percentile(per_user, 90), 3),
        "mean_verify_len": round(drafts / rounds, 4) if rounds else 0.0,
        "acceptance_length": round(committed / rounds, 4) if rounds else 0.0,
        "mean_step_ms": round(step_ms, 3),
        "scheduler_ms": round(sched_ms, 4),
        "scheduler_ratio": round(sched_ms / step_ms, 5) if step_ms > 0 else 0.0,
        "ttft_ms_mean": round(1e3 * float(np.mean(ttft)), 2) if ttft else None,
        "latency_s_mean": round(float(np.mean(latency)), 4),
        "output_tokens": output_tokens,
        "window_tokens": run.window_tokens,
        "window_steps": run.window_steps,
        "window_s": round(run.window_s, 4),
        "wall_s": round(run.wall_s, 4),
        "throughput_overall_tokens_per_s": round(output_tokens / run.wall_s, 3) if run.wall_s > 0 else 0.0,
        "mean_prompt_tokens": round(float(np.mean([len(r.prompt) for r in recs])), 1),
        "max_in_flight": run.max_in_flight,
        "slots": gen.max_slots,
        "finish_reasons": dict(Counter(r.finish_reason for r in results)),
        "drafter_steps_skipped": gen.drafts_skipped,
    }


#: per-run numbers a row reports as the median over its repeats
_MEDIAN_KEYS = ("throughput_tokens_per_s", "per_user_tokens_per_s", "per_user_tokens_per_s_p50",
                "per_user_tokens_per_s_p90", "mean_verify_len", "acceptance_length", "mean_step_ms", "scheduler_ms",
                "scheduler_ratio", "ttft_ms_mean", "latency_s_mean", "throughput_overall_tokens_per_s")
#: per-run numbers a row reports as the sum over its repeats
_SUM_KEYS = ("requests", "output_tokens", "window_tokens", "window_steps", "window_s", "wall_s",
             "drafter_steps_skipped", "identity_checked")


def _combine(runs: list[dict], ar_runs: list[dict] | None) -> dict:
    """One result row from the repeats of a (policy, C): medians of the per-run numbers (`_MEDIAN_KEYS`),
    sums of the counts (`_SUM_KEYS`), every run's throughput and per-user speed, and, when `ar` ran at
    the same C, the median over repeats of throughput / `ar`'s throughput in the same repeat
    (`throughput_ratio_to_ar`, paired so a drifting machine cancels out) and likewise per user."""
    row = dict(runs[0])
    row["repeats"] = len(runs)
    for key in _MEDIAN_KEYS:
        values = [r[key] for r in runs if r.get(key) is not None]
        row[key] = round(float(np.median(values)), 4) if values else None
    for key in _SUM_KEYS:
        row[key] = sum(r[key] for r in runs)
    row["identical"] = None if any(r["identical"] is None for r in runs) else all(r["identical"] for r in runs)
    row["finish_reasons"] = dict(sum((Counter(r["finish_reasons"]) for r in runs), Counter()))
    row["throughput_tokens_per_s_runs"] = [r["throughput_tokens_per_s"] for r in runs]
    row["per_user_tokens_per_s_runs"] = [r["per_user_tokens_per_s"] for r in runs]
    if ar_runs is not None and len(ar_runs) == len(runs):
        for key, out in (("throughput_tokens_per_s", "throughput_ratio_to_ar"),
                         ("per_user_tokens_per_s", "per_user_ratio_to_ar")):
            ratios = [r[key] / a[key] for r, a in zip(runs, ar_runs) if a[key] > 0]
            row[out] = round(float(np.median(ratios)), 4) if ratios else None
            row[out + "_runs"] = [round(x, 4) for x in ratios]
    return row


# -- the benchmark -----------------------------------------------------------------------------
def run_serve_bench(cfg: ServeBenchConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Run the closed-loop benchmark for every (policy, concurrency) of `cfg`.

    Args:
        cfg: what to measure.
        progress: called with one line of text per event (run start/end, identity check); None = quiet.
    Returns:
        {"config", "engine_dir", "profile_context", "block_size", "max_context", "drafter_trained",
         "prompts", "identity", "warnings" (one line per C run with fewer than 2·C requests, whose steady
         window is a single wave), "results": [one row per (policy, C), see the module docstring]}.
    Raises:
        ConfigError: a policy the engine directory cannot run, an unreadable dataset, no prompt that fits.
        EngineDirError: the engine directory does not load.
        RequestError: a request failed.
    """
    from ..runtime.api import Runtime

    say = progress or (lambda line: None)
    rt = Runtime.open(cfg.engine_dir, policy="ar", threads=cfg.threads)
    engines = rt.engines
    info = engines.manifest.runtime
    block_size, max_context = int(info["block_size"]), int(info["max_context"])
    policies = {p: parse_policy(p) for p in cfg.policies}
    for text, pol in policies.items():
        if pol.name == "fixed" and pol.k > block_size:
            raise ConfigError(f"policies: {text} verifies K={pol.k} drafts but this engine directory drafts "
                              f"{block_size} per block; use fixed:1..fixed:{block_size}")
        if pol.needs_profile and not engines.manifest.data.get("profile", {}).get("path"):
            raise ConfigError(f"policies: {text} needs the engine directory's throughput profile; run "
                              f"`dspark-export profile --engine-dir {cfg.engine_dir}`")
    source = _Prompts(cfg, lambda text: rt.encode(text, cfg.chat), max_context)
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    warm = SamplingParams(max_new_tokens=min(WARMUP_TOKENS, cfg.max_new_tokens), temperature=cfg.temperature,
                          seed=cfg.seed)
    solo = Generator(engines, parse_policy("ar"))
    solo_cache: dict[tuple[str, int], list[int]] = {}
    greedy = cfg.temperature == 0.0

    def measure(text: str, c: int, prompts: list, tag: str) -> dict:
        """One measured closed loop of policy `text` at C = c, with its greedy identity spot check."""
        pol = policies[text]
        gc.collect()    # a dead Generator's KV arenas return to the engines' pool only when its cycles are freed
        if cfg.warmup:
            _warm_up(Generator(engines, pol), prompts, c, warm, cfg.max_new_tokens + block_size + 1)
            gc.collect()      # the warm-up's arenas go back to the pool, for the measured generator
        gen = Generator(engines, _timed(pol))
        run = _closed_loop(gen, prompts, c, params)
        row = _summarise(text, c, gen, run)
        row["identical"], row["identity_checked"] = None, 0
        if greedy and cfg.identity_checks:
            same = []
            for rid in run.completed[:cfg.identity_checks]:
                rec = run.records[rid]
                if rec.key not in solo_cache:
                    solo_cache[rec.key] = solo.generate([rec.prompt], [params])[0].token_ids
                same.append(gen.result(rid).token_ids == solo_cache[rec.key])
            row["identical"], row["identity_checked"] = all(same), len(same)
        say(f"{tag} throughput {row['throughput_tokens_per_s']:.1f} tok/s, per-user "
            f"{row['per_user_tokens_per_s']:.1f} tok/s, verify {row['mean_verify_len']:.2f}, "
            f"τ {row['acceptance_length']:.2f}, step {row['mean_step_ms']:.1f} ms "
            f"(scheduler {row['scheduler_ms']:.3f} ms), identical {row['identical']}, "
            f"{row['wall_s']:.1f} s")
        return row

    warnings = [f"C={c}: {cfg.requests_for(c)} requests < 2·C; the steady window ends at the first completion, "
                f"so it holds one wave (its prefill and the decode steps before any request finishes) and "
                f"rewards a policy that finishes no request early; use --requests {2 * c} or more"
                for c in cfg.concurrency if cfg.requests_for(c) < 2 * c]
    for line in warnings:
        say(f"warning: {line}")
    runs: dict[tuple[str, int], list[dict]] = {}
    eta = Eta(len(policies) * len(cfg.concurrency) * cfg.repeats)
    for c in cfg.concurrency:
        n = cfg.requests_for(c)
        prompts = source.first(n)
        for rep in range(cfg.repeats):
            order = list(policies)[rep % len(policies):] + list(policies)[:rep % len(policies)]
            for text in order:
                tag = f"[{text} C={c}" + (f" run {rep + 1}/{cfg.repeats}]" if cfg.repeats > 1 else "]")
                say(f"{tag} {n} requests × {cfg.max_new_tokens} tokens (run {eta.text(sum(map(len, runs.values())))})")
                runs.setdefault((text, c), []).append(measure(text, c, prompts, tag))
    rows = [_combine(runs[(text, c)], runs.get(("ar", c))) for text in policies for c in cfg.concurrency]

    identity = {}
    for text in policies:
        mine = [r for r in rows if r["policy"] == text]
        checked = sum(r["identity_checked"] for r in mine)
        identity[text] = {"identical": all(r["identical"] for r in mine) if greedy and checked else None,
                          "checked": checked}
    profile = engines.manifest.data.get("profile", {})
    return {
        "config": cfg.to_dict(),
        "engine_dir": str(cfg.engine_dir),
        "profile_context": profile.get("context_len"),
        "block_size": block_size,
        "max_context": max_context,
        "drafter_trained": bool(info.get("drafter_trained", False)),
        "prompts": {"sequence": [f"{name}#{k}" for name, k, _ in source.sequence],
                    "skipped_too_long": dict(source.skipped)},
        "identity": identity,
        "warnings": warnings,
        "results": rows,
    }


# -- reports -----------------------------------------------------------------------------------
_COLUMNS = [("policy", "policy", "{}"), ("concurrency", "C", "{}"), ("requests", "req", "{}"),
            ("throughput_tokens_per_s", "throughput tok/s", "{:.1f}"),
            ("per_user_tokens_per_s", "per-user tok/s", "{:.1f}"),
            ("per_user_tokens_per_s_p50", "p50", "{:.1f}"), ("per_user_tokens_per_s_p90", "p90", "{:.1f}"),
            ("throughput_ratio_to_ar", "×ar", "{:.2f}"),
            ("throughput_ratio_to_ar_runs", "×ar runs", lambda v: f"{min(v):.2f}–{max(v):.2f}"),
            ("per_user_ratio_to_ar", "per-user ×ar", "{:.2f}"),
            ("per_user_ratio_to_ar_runs", "per-user ×ar runs", lambda v: f"{min(v):.2f}–{max(v):.2f}"),
            ("mean_verify_len", "verify len", "{:.2f}"), ("acceptance_length", "τ", "{:.2f}"),
            ("mean_step_ms", "step ms", "{:.1f}"), ("scheduler_ms", "sched ms", "{:.3f}"),
            ("scheduler_ratio", "sched %", "{:.2%}"), ("identical", "identical", "{}")]


def markdown_table(result: dict) -> str:
    """The results as a markdown table (one row per policy and concurrency)."""
    lines = ["| " + " | ".join(h for _, h, _ in _COLUMNS) + " |",
             "|" + "|".join("---" if k == "policy" else "---:" for k, _, _ in _COLUMNS) + "|"]
    for row in result["results"]:
        cells = []
        for key, _, fmt in _COLUMNS:
            v = row.get(key)
            cells.append("–" if v is None or v == [] else fmt(v) if callable(fmt) else fmt.format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _markdown(result: dict) -> str:
    cfg = result["config"]
    trained = "trained" if result.get("drafter_trained") else "UNTRAINED (speculative policies are expected to lose)"
    return "\n".join([
        "# Serving benchmark (closed loop)", "",
        f"- engine directory: `{result['engine_dir']}` (block size γ = {result.get('block_size')}, "
        f"max context {result.get('max_context')}, SPS(B) profiled at context {result.get('profile_context')})",
        f"- drafter: {trained}",
        f"- datasets: {', '.join(cfg['datasets'])} (first turn{', chat template' if cfg.get('chat') else ''}); "
        f"max_new_tokens {cfg['max_new_tokens']}, temperature {cfg['temperature']}, seed {cfg['seed']}",
        "- throughput: output tokens in the steady window (exactly C in flight) / its wall time; per-user: "
        "completion tokens / latency from submission; verify len: drafts verified per request per step; "
        "τ: tokens committed per round incl. bonus; sched: time in Policy.verify_lengths per step",
        "- identity: the first completed requests of each run equal an `ar` solo run (greedy)",
        f"- repeats: {cfg.get('repeats', 1)} run(s) per row, policies interleaved at each C; numbers are medians "
        "over the runs; ×ar: throughput / `ar`'s in the same repeat (median); ×ar runs: the lowest and highest "
        "of those per-repeat ratios (this spread is the run-to-run noise a difference must exceed)",
        *[f"- **warning**: {w}" for w in result.get("warnings", [])], "",
        markdown_table(result), ""])


def _by_policy(result: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in result["results"]:
        out.setdefault(row["policy"], []).append(row)
    return {p: sorted(rows, key=lambda r: r["concurrency"]) for p, rows in out.items()}


def _plot_pareto(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for policy, rows in _by_policy(result).items():
        x = [r["per_user_tokens_per_s"] for r in rows]
        y = [r["throughput_tokens_per_s"] for r in rows]
        (line,) = ax.plot(x, y, marker="o", label=policy)
        for r, xi, yi in zip(rows, x, y):
            ax.annotate(f"C={r['concurrency']}", (xi, yi), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color=line.get_color())
    ax.set_xlabel("per-user generation speed (tokens/s/user, mean)")
    ax.set_ylabel("aggregate throughput (output tokens/s)")
    trained = "" if result.get("drafter_trained") else " — untrained drafter"
    ax.set_title(f"Throughput vs per-user speed (cf. DSpark Fig. 7){trained}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def _plot_verify(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 7), dpi=120)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    levels = sorted({r["concurrency"] for r in result["results"]})
    for policy, rows in _by_policy(result).items():
        c = [r["concurrency"] for r in rows]
        top.plot(c, [r["throughput_tokens_per_s"] for r in rows], marker="o", label=policy)
        bottom.plot(c, [r["mean_verify_len"] for r in rows], marker="o", label=policy)
    if len(levels) > 1:
        bottom.set_xscale("log", base=2)
    bottom.set_xticks(levels)
    bottom.set_xticklabels([str(c) for c in levels])
    top.set_ylabel("throughput (output tokens/s)")
    bottom.set_ylabel("mean verification length\n(drafts per request per step)")
    bottom.set_xlabel("concurrent requests C")
    top.set_title("Throughput and verification budget vs concurrency (cf. DSpark Fig. 8)", fontsize=10)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def write_reports(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write serve_bench.json, serve_bench.md and two PNG plots into `out_dir` (created if needed).

    Returns:
        {"json", "markdown", "throughput_vs_per_user", "verify_len_vs_concurrency"}: the written paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "serve_bench.json", "markdown": out / "serve_bench.md",
             "throughput_vs_per_user": out / "serve_throughput_vs_per_user.png",
             "verify_len_vs_concurrency": out / "serve_verify_len_vs_concurrency.png"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    paths["markdown"].write_text(_markdown(result))
    _plot_pareto(result, paths["throughput_vs_per_user"])
    _plot_verify(result, paths["verify_len_vs_concurrency"])
    return paths
