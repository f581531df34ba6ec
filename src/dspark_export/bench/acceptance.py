"""Offline acceptance benchmark over an engine directory (DSpark paper Table 1 and Fig. 2).

The DeepSpec offline protocol (reference §4): for each dataset, the first user turn of each row with
the chat template, a FIXED verification block (default `fixed:γ`, γ = the engine's block size; any
`fixed:K` with K ≤ γ is allowed; `ar` is allowed as the speed baseline (τ = 1 by definition); scheduling
policies are refused), no scheduler. If a file has more rows
than `samples`, its rows are shuffled with `random.Random(seed).shuffle` and the first `samples`
are taken (seed default 980406, as in DeepSpec). All requests of a dataset run through one
`Generator` (continuous batching; results are per request), at most `max_concurrency` at a time
(1 = one user at a time: `tokens_per_s` is then single-user speed).

Per dataset:

- `acceptance_length` τ = Σ committed_in_rounds / Σ rounds over its requests (bonus token included);
- `conditional_acceptance[j]` = Σ accepted[j] / Σ reached[j] for draft position j = 0..γ-1 (paper
  Fig. 2; None where no round reached j, e.g. positions ≥ K under `fixed:K`);
- `tokens_per_s` = output tokens / wall time of the dataset's generator run.

Per domain (math = gsm8k, math500, aime25; code = mbpp, humaneval, livecodebench; chat = mt-bench,
arena-hard-v2; any other dataset is in "other"): the macro average of τ over the datasets of that
domain that were run (None when none was). `macro` = mean of the domain values present.

Greedy identity spot check (temperature 0): the first request of each dataset is compared with an
`ar` solo run of the same prompt.

Usage:
    from dspark_export.bench.acceptance import AcceptanceBenchConfig, run_acceptance_bench, write_reports
    result = run_acceptance_bench(AcceptanceBenchConfig("engines/smollm2", samples=20), progress=print)
    write_reports(result, "reports/acceptance")
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, RequestError
from ..progress import Eta
from ..runtime.generator import Generator
from ..runtime.policies import parse_policy
from ..runtime.request import SamplingParams
from ..datasets import DEFAULT_DATASETS, DEFAULT_SEED, DOMAINS, read_dataset, select_rows
from .common import check_datasets, check_engine_dir, check_generation, is_int

__all__ = ["AcceptanceBenchConfig", "run_acceptance_bench", "write_reports", "markdown_table",
           "DEFAULT_DATASETS", "DOMAINS", "DEFAULT_SEED", "domain_of"]

WARMUP_TOKENS = 4


def domain_of(dataset: str) -> str:
    """The paper's domain of a dataset name ("math", "code", "chat"), or "other"."""
    for domain, names in DOMAINS.items():
        if dataset in names:
            return domain
    return "other"


@dataclass(frozen=True)
class AcceptanceBenchConfig:
    """What to measure. Validated on construction (ConfigError names the field, expected vs found).

    Attributes:
        engine_dir: a built engine directory (holds manifest.json).
        datasets: dataset names, read from `<datasets_dir>/<name>.jsonl` ({"turns": [...]} per line).
        datasets_dir: folder of the datasets; None = `default_datasets_dir()` (required if that is None).
        samples: rows per dataset (seeded shuffle + first `samples` when the file has more).
        temperature: 0 = greedy (the identity spot check runs only then).
        policy: "fixed:K" (K ≤ the engine's block size γ); None = fixed:γ. Other policies are refused.
        max_new_tokens: tokens per request (exactly this many unless EOS comes first).
        seed: seeds the row shuffle (random.Random(seed)) and the requests' sampling.
        chat: apply the tokenizer's chat template to each prompt.
        warmup: run one short unmeasured request before the first dataset (ORT lazy init).
        threads: ONNX Runtime intra-op threads per session; 0 = ORT's choice.
        max_concurrency: requests decoded at once; None = the engine's largest request bucket.
    """

    engine_dir: str | Path
    datasets: tuple[str, ...] = DEFAULT_DATASETS
    datasets_dir: str | Path | None = None
    samples: int = 20
    temperature: float = 0.0
    policy: str | None = None
    max_new_tokens: int = 256
    seed: int = DEFAULT_SEED
    chat: bool = True
    warmup: bool = True
    threads: int = 0
    max_concurrency: int | None = None

    def __post_init__(self):
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        put("engine_dir", check_engine_dir(self.engine_dir))

        if self.policy is not None:
            try:
                pol = parse_policy(self.policy)
            except RequestError as e:
                raise ConfigError(str(e)) from None
            if pol.name not in ("fixed", "ar"):
                raise ConfigError(f"policy: the offline acceptance protocol verifies a FIXED block; expected "
                                  f"fixed:K (default fixed:γ) or ar (the speed baseline), found {self.policy!r} "
                                  "(no scheduler)")
            put("policy", str(pol))

        datasets, folder = check_datasets(self.datasets, self.datasets_dir)
        put("datasets", datasets)
        put("datasets_dir", folder)
        if self.max_concurrency is not None and (not is_int(self.max_concurrency) or self.max_concurrency < 1):
            raise ConfigError(f"max_concurrency: expected an integer >= 1 or None, found {self.max_concurrency!r}")
        if not is_int(self.samples) or self.samples < 1:
            raise ConfigError(f"samples: expected an integer >= 1, found {self.samples!r}")
        put("temperature", check_generation(self.max_new_tokens, self.temperature, seed=self.seed,
                                            threads=self.threads))

    def to_dict(self) -> dict:
        return {"engine_dir": str(self.engine_dir), "datasets": list(self.datasets),
                "datasets_dir": str(self.datasets_dir), "samples": self.samples, "temperature": self.temperature,
                "policy": self.policy, "max_new_tokens": self.max_new_tokens, "seed": self.seed,
                "chat": self.chat, "warmup": self.warmup, "threads": self.threads,
                "max_concurrency": self.max_concurrency}


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 4) if values else None


def _run_dataset(name: str, cfg: AcceptanceBenchConfig, engines, policy, encode, limit: int,
                 block_size: int, solo: Generator | None) -> dict:
    texts = read_dataset(cfg.datasets_dir / f"{name}.jsonl")
    rows, prompts, skipped = [], [], []
    for k in select_rows(texts, cfg.samples, cfg.seed):
        ids = encode(texts[k])
        if 1 <= len(ids) <= limit:
            rows.append(k)
            prompts.append(ids)
        else:
            skipped.append(k)
    if not prompts:
        raise ConfigError(f"dataset {name}: no selected prompt fits the engine's context ({limit} prompt tokens "
                          f"left after max_new_tokens); lower max_new_tokens")
    params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    gen = Generator(engines, policy, max_slots=cfg.max_concurrency)
    t0 = time.perf_counter()
    results = gen.generate(prompts, [params] * len(prompts))
    wall = time.perf_counter() - t0
    failed = [(k, r.error) for k, r in zip(rows, results) if r.finish_reason == "error"]
    if failed:
        raise RequestError(f"acceptance bench: {name} prompt #{failed[0][0]} failed: {failed[0][1]}")

    rounds = sum(r.stats.rounds for r in results)
    committed = sum(r.stats.committed_in_rounds for r in results)
    drafts = sum(r.stats.draft_tokens for r in results)
    reached, accepted = [0] * block_size, [0] * block_size
    for r in results:
        for j, (n_reached, n_accepted) in enumerate(zip(r.stats.reached_per_position, r.stats.accepted_per_position)):
            if j < block_size:
                reached[j] += n_reached
                accepted[j] += n_accepted
    output_tokens = sum(len(r.token_ids) for r in results)
    identical = None
    if solo is not None:
        identical = solo.generate([prompts[0]], [params])[0].token_ids == results[0].token_ids
    return {
        "domain": domain_of(name),
        "samples": len(results),
        "rows": rows,
        "skipped_too_long": skipped,
        "acceptance_length": round(committed / rounds, 4) if rounds else 0.0,
        "rounds": rounds,
        "committed_in_rounds": committed,
        "mean_verify_len": round(drafts / rounds, 4) if rounds else 0.0,
        "conditional_acceptance": [_ratio(a, n) for a, n in zip(accepted, reached)],
        "reached_per_position": reached,
        "accepted_per_position": accepted,
        "output_tokens": output_tokens,
        "mean_prompt_tokens": round(sum(len(p) for p in prompts) / len(prompts), 1),
        "wall_s": round(wall, 4),
        "tokens_per_s": round(output_tokens / wall, 3) if wall > 0 else 0.0,
        "finish_reasons": dict(Counter(r.finish_reason for r in results)),
        "identical": identical,
    }


def run_acceptance_bench(cfg: AcceptanceBenchConfig, progress: Callable[[str], None] | None = None,
                         on_dataset: Callable[[dict], None] | None = None) -> dict:
    """Run the offline acceptance protocol on every dataset of `cfg`.

    Args:
        cfg: what to measure.
        progress: called with one line of text per dataset; None = quiet.
        on_dataset: called after each dataset with the result so far (same layout, `"complete": False`
            until the last dataset), so a long run that is interrupted keeps its finished datasets.
    Returns:
        {"config", "engine_dir", "policy", "block_size", "max_context", "drafter_trained",
         "datasets": {name: {acceptance_length, samples, conditional_acceptance, tokens_per_s, ...}},
         "domains": {"math", "code", "chat"[, "other"]: macro τ or None}, "macro",
         "conditional_acceptance": {name: list of γ values}, "identity": {"identical", "checked"}}.
    Raises:
        ConfigError: fixed:K with K > γ, an unreadable dataset, no prompt that fits.
        EngineDirError: the engine directory does not load.
        RequestError: a request failed.
    """
    from ..runtime.api import Runtime

    say = progress or (lambda line: None)
    rt = Runtime.open(cfg.engine_dir, policy="ar", threads=cfg.threads)
    engines = rt.engines
    info = engines.manifest.runtime
    block_size, max_context = int(info["block_size"]), int(info["max_context"])
    policy = parse_policy(cfg.policy or f"fixed:{block_size}")
    if policy.name == "fixed" and policy.k > block_size:
        raise ConfigError(f"policy: {policy} verifies K={policy.k} drafts but this engine directory drafts "
                          f"{block_size} per block; use fixed:1..fixed:{block_size}")
    limit = max_context - cfg.max_new_tokens
    encode = lambda text: rt.encode(text, cfg.chat)  # noqa: E731
    greedy = cfg.temperature == 0.0
    solo = Generator(engines, parse_policy("ar")) if greedy else None
    if cfg.warmup:
        first = read_dataset(cfg.datasets_dir / f"{cfg.datasets[0]}.jsonl")[0]
        ids = encode(first)[:max(1, min(limit, max_context - WARMUP_TOKENS))]
        Generator(engines, policy).generate([ids], [SamplingParams(max_new_tokens=WARMUP_TOKENS)])

    per_dataset = {}
    result: dict = {}
    eta = Eta(len(cfg.datasets))
    for name in cfg.datasets:
        say(f"[{name}] {policy}, up to {cfg.samples} samples × {cfg.max_new_tokens} tokens "
            f"(dataset {eta.text(len(per_dataset))})")
        row = per_dataset[name] = _run_dataset(name, cfg, engines, policy, encode, limit, block_size, solo)
        say(f"[{name}] τ {row['acceptance_length']:.3f} over {row['samples']} samples ({row['rounds']} rounds), "
            f"{row['tokens_per_s']:.1f} tok/s, identical {row['identical']}, {row['wall_s']:.1f} s")
        result = _assemble(cfg, policy, block_size, max_context, info, per_dataset)
        if on_dataset is not None:
            on_dataset(result)
    return result


def _assemble(cfg: AcceptanceBenchConfig, policy, block_size: int, max_context: int, info: dict,
              per_dataset: dict) -> dict:
    """The result layout of `run_acceptance_bench` over the datasets measured so far."""
    domains = {d: _mean(per_dataset[n]["acceptance_length"] for n in names if n in per_dataset)
               for d, names in DOMAINS.items()}
    others = [n for n in per_dataset if domain_of(n) == "other"]
    if others:
        domains["other"] = _mean(per_dataset[n]["acceptance_length"] for n in others)
    checked = [row["identical"] for row in per_dataset.values() if row["identical"] is not None]
    return {
        "config": cfg.to_dict(),
        "engine_dir": str(cfg.engine_dir),
        "policy": str(policy),
        "block_size": block_size,
        "max_context": max_context,
        "drafter_trained": bool(info.get("drafter_trained", False)),
        "datasets": per_dataset,
        "domains": domains,
        "macro": _mean(domains.values()),
        "conditional_acceptance": {n: row["conditional_acceptance"] for n, row in per_dataset.items()},
        "identity": {"identical": all(checked) if checked else None, "checked": len(checked)},
        "complete": len(per_dataset) == len(cfg.datasets),
    }


# -- reports -----------------------------------------------------------------------------------
def _fmt(value, spec: str = "{:.2f}") -> str:
    return "–" if value is None else spec.format(value)


def _groups(result: dict) -> list[tuple[str, list[str]]]:
    names = list(result["datasets"])
    groups = [(d, [n for n in ds if n in result["datasets"]]) for d, ds in DOMAINS.items()]
    groups.append(("other", [n for n in names if domain_of(n) == "other"]))
    return [(d, ns) for d, ns in groups if ns]


def markdown_table(result: dict) -> str:
    """τ per dataset and macro τ per domain, one row (cf. DSpark Table 1)."""
    head, cells = ["method"], [f"{result['policy']}"]
    for domain, names in _groups(result):
        for n in names:
            head.append(n)
            cells.append(_fmt(result["datasets"][n]["acceptance_length"]))
        head.append(f"{domain} avg")
        cells.append(f"**{_fmt(result['domains'].get(domain))}**")
    head.append("macro")
    cells.append(f"**{_fmt(result['macro'])}**")
    return "\n".join(["| " + " | ".join(head) + " |",
                      "|---|" + "|".join("---:" for _ in head[1:]) + "|",
                      "| " + " | ".join(cells) + " |"])


def _details_table(result: dict) -> str:
    lines = ["| dataset | domain | samples | τ | rounds | verify len | tok/s | identical | conditional acceptance |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for n, row in result["datasets"].items():
        cond = ", ".join(_fmt(v) for v in row["conditional_acceptance"])
        lines.append(f"| {n} | {row['domain']} | {row['samples']} | {row['acceptance_length']:.3f} | {row['rounds']} "
                     f"| {row['mean_verify_len']:.2f} | {row['tokens_per_s']:.1f} | {_fmt(row['identical'], '{}')} "
                     f"| {cond} |")
    return "\n".join(lines)


def _markdown(result: dict) -> str:
    cfg = result["config"]
    trained = "trained" if result.get("drafter_trained") else "UNTRAINED (τ ≈ 1 expected)"
    return "\n".join([
        "# Acceptance length (offline protocol, cf. DSpark Table 1 / Fig. 2)", "",
        f"- engine directory: `{result['engine_dir']}` (block size γ = {result['block_size']}, "
        f"max context {result['max_context']})",
        f"- drafter: {trained}; policy {result['policy']} (fixed block, no scheduler)",
        f"- {cfg['samples']} samples per dataset (random.Random({cfg['seed']}).shuffle when the file has more), "
        f"first turn{', chat template' if cfg.get('chat') else ''}; max_new_tokens {cfg['max_new_tokens']}, "
        f"temperature {cfg['temperature']}",
        "- τ = Σ committed / Σ rounds (bonus included); domain = macro average over its datasets; "
        "macro = mean of the domains",
        f"- greedy identity vs `ar` (first request per dataset): {result['identity']['identical']} "
        f"({result['identity']['checked']} checked)", "",
        markdown_table(result), "", _details_table(result), ""])


def _plot_conditional(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    positions = list(range(1, result["block_size"] + 1))
    for name, values in result["conditional_acceptance"].items():
        ax.plot(positions, [math.nan if v is None else v for v in values], marker="o", label=name)
    ax.set_xticks(positions)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("draft position")
    ax.set_ylabel("conditional acceptance rate")
    trained = "" if result.get("drafter_trained") else " — untrained drafter"
    ax.set_title(f"Conditional acceptance per position, {result['policy']} (cf. DSpark Fig. 2){trained}",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def write_reports(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write acceptance.json, acceptance.md and acceptance_conditional.png into `out_dir` (created if needed).

    Returns:
        {"json", "markdown", "conditional_acceptance"}: the written paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "acceptance.json", "markdown": out / "acceptance.md",
             "conditional_acceptance": out / "acceptance_conditional.png"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    paths["markdown"].write_text(_markdown(result))
    _plot_conditional(result, paths["conditional_acceptance"])
    return paths
