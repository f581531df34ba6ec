"""What the benchmarks share: config validation, the eval-dataset reader, and their CLI plumbing."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

from ..datasets import default_datasets_dir
from ..errors import ConfigError
from ..runtime.request import MAX_NEW_TOKENS_LIMIT

__all__ = ["is_int", "as_tuple", "dedupe", "check_engine_dir",
           "check_datasets", "check_generation", "add_common_arguments", "write_outputs"]


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def as_tuple(value, name: str) -> tuple:
    if isinstance(value, (str, bytes)) or is_int(value):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise ConfigError(f"{name}: expected a list, found {value!r}") from None


def dedupe(items) -> tuple:
    return tuple(dict.fromkeys(items))


def check_engine_dir(value) -> Path:
    """A built engine directory (holds manifest.json). Raises ConfigError otherwise."""
    engine_dir = Path(value)
    if not (engine_dir / "manifest.json").is_file():
        raise ConfigError(f"engine_dir: expected a built engine directory with a manifest.json, found "
                          f"{engine_dir} ({'no manifest.json' if engine_dir.is_dir() else 'no such directory'}); "
                          f"build one with `dspark-export build --out {engine_dir}`")
    return engine_dir


def check_datasets(datasets, datasets_dir) -> tuple[tuple[str, ...], Path]:
    """(dataset names, folder) with every `<folder>/<name>.jsonl` present. Raises ConfigError naming the
    missing files and the ones that exist."""
    names = as_tuple(datasets, "datasets")
    if not names or not all(isinstance(d, str) and d.strip() for d in names):
        raise ConfigError(f"datasets: expected a non-empty list of dataset names, found {list(names)}")
    names = dedupe(d.strip().removesuffix(".jsonl") for d in names)
    folder = datasets_dir if datasets_dir is not None else default_datasets_dir()
    if folder is None:
        raise ConfigError("datasets_dir: required (no eval_datasets folder found at ../shared/eval_datasets "
                          "relative to the repository root)")
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"datasets_dir: expected a folder of <name>.jsonl files, found {folder} "
                          f"(no such directory)")
    missing = [d for d in names if not (folder / f"{d}.jsonl").is_file()]
    if missing:
        available = sorted(p.stem for p in folder.glob("*.jsonl"))
        raise ConfigError(f"datasets: no file {', '.join(str(folder / f'{d}.jsonl') for d in missing)}; "
                          f"available in {folder}: {available or 'none'}")
    return names, folder


def check_generation(max_new_tokens, temperature, **non_negative_ints) -> float:
    """Validate max_new_tokens, temperature and integer fields that must be >= 0; returns the temperature
    as a float. Raises ConfigError naming the field."""
    if not is_int(max_new_tokens) or not 1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
        raise ConfigError(f"max_new_tokens: expected an integer in [1, {MAX_NEW_TOKENS_LIMIT}], "
                          f"found {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"temperature: expected a finite number >= 0, found {temperature!r}")
    for name, value in non_negative_ints.items():
        if not is_int(value) or value < 0:
            raise ConfigError(f"{name}: expected an integer >= 0, found {value!r}")
    return float(temperature)


# -- CLI plumbing ------------------------------------------------------------------------------
def csv_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def int_list(text: str) -> list[int]:
    try:
        return [int(item) for item in csv_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, found {text!r}") from None


def add_common_arguments(parser: argparse.ArgumentParser, *, datasets: tuple[str, ...], max_new_tokens: int,
                         seed: int, warmup_help: str, out_help: str) -> None:
    """Flags every benchmark takes: engine dir, datasets, generation settings, threads, outputs."""
    parser.add_argument("--engine-dir", required=True, type=Path, help="a built engine directory")
    parser.add_argument("--datasets", type=csv_list, default=list(datasets),
                        help=f"comma-separated dataset names (default {','.join(datasets)})")
    parser.add_argument("--datasets-dir", type=Path, default=None,
                        help="folder of <name>.jsonl files (default ../shared/eval_datasets from the repo root)")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                        help=f"tokens per request (default {max_new_tokens})")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=seed, help=f"prompt shuffle and sampling seed (default {seed})")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--no-warmup", action="store_true", help=warmup_help)
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = ORT's choice)")
    parser.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    parser.add_argument("--out-dir", type=Path, default=None, help=out_help)


def write_outputs(result: dict, args: argparse.Namespace, write_reports: Callable[[dict, Path], dict],
                  progress: Callable[[str], None]) -> None:
    """Write --json and --out-dir reports of a benchmark result."""
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        progress(f"wrote {args.json}")
    if args.out_dir is not None:
        for path in write_reports(result, args.out_dir).values():
            progress(f"wrote {path}")
