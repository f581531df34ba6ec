"""The committed, seeded split of the evaluation prompt files into drafter training, calibration and
evaluation rows.

The acceptance benchmark (`dspark_export.bench.acceptance`, rows from `datasets.select_rows`) runs the first `samples` rows of
`random.Random(980406).shuffle(rows)` of each dataset. This split reserves the first
`EVAL_ROWS_PER_DATASET` of that same shuffle as evaluation rows, so a benchmark with
`--samples <= EVAL_ROWS_PER_DATASET` never sees a prompt the drafter was trained or calibrated on.
Datasets in `EVAL_ONLY` (mt-bench, aime25, humaneval) are evaluation-only: none of their rows is
used for training. Of the remaining rows, `CALIBRATION_ROWS` drawn with `random.Random(SPLIT_SEED)`
are held out for Sequential Temperature Scaling and validation; the rest are training rows.

The split is written once by `make_split` and committed as `data_split.json` with the sha256 of
every file, so a changed prompt file is detected (`load_split` raises) instead of silently
reshuffling.

Usage:
    split = load_split()                       # the committed split
    split["datasets"]["gsm8k"]["train"]        # row indices (0-based, non-empty prompt rows)
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from ..datasets import DEFAULT_DATASETS, DEFAULT_SEED, read_dataset, select_rows
from ..errors import ConfigError

__all__ = ["make_split", "load_split", "split_rows", "SPLIT_PATH", "EVAL_ONLY", "EVAL_ROWS_PER_DATASET",
           "CALIBRATION_ROWS", "SPLIT_SEED"]

SPLIT_PATH = Path(__file__).with_name("data_split.json")
EVAL_ONLY = ("mt-bench", "aime25", "humaneval")
EVAL_ROWS_PER_DATASET = 50
CALIBRATION_ROWS = 160
SPLIT_SEED = 20261129
#: Prompt files not in the benchmark's default datasets that may still feed training.
EXTRA_TRAINING_DATASETS = ("aime24", "lbpp", "swe-bench")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_split(datasets_dir: str | Path) -> dict:
    """Compute the split of every `<name>.jsonl` of DEFAULT_DATASETS + EXTRA_TRAINING_DATASETS.

    Returns:
        {"seed", "eval_seed", "eval_rows_per_dataset", "eval_only", "datasets": {name: {"sha256",
         "rows", "eval", "calibration", "train"}}}; index lists are sorted row indices into
        `read_dataset(file)` (first turns of the non-blank lines).
    Raises:
        ConfigError: a dataset file is missing or malformed.
    """
    folder = Path(datasets_dir)
    names = list(DEFAULT_DATASETS) + [n for n in EXTRA_TRAINING_DATASETS if n not in DEFAULT_DATASETS]
    out = {"seed": SPLIT_SEED, "eval_seed": DEFAULT_SEED, "eval_rows_per_dataset": EVAL_ROWS_PER_DATASET,
           "eval_only": list(EVAL_ONLY), "datasets": {}}
    pool: list[tuple[str, int]] = []
    for name in names:
        path = folder / f"{name}.jsonl"
        if not path.is_file():
            raise ConfigError(f"make_split: expected {path} (DeepSpec prompt file), found none")
        texts = read_dataset(path)
        if name in EVAL_ONLY:
            evaluation = list(range(len(texts)))
        elif name in DEFAULT_DATASETS:
            evaluation = sorted(select_rows(texts, EVAL_ROWS_PER_DATASET, DEFAULT_SEED))
        else:
            evaluation = []
        held = set(evaluation)
        rest = [k for k in range(len(texts)) if k not in held]
        pool += [(name, k) for k in rest]
        out["datasets"][name] = {"sha256": _sha256(path), "rows": len(texts), "eval": evaluation,
                                 "calibration": [], "train": rest}
    calibration = set(random.Random(SPLIT_SEED).sample(pool, min(CALIBRATION_ROWS, len(pool))))
    for name, entry in out["datasets"].items():
        entry["calibration"] = sorted(k for k in entry["train"] if (name, k) in calibration)
        entry["train"] = sorted(k for k in entry["train"] if (name, k) not in calibration)
    return out


def load_split(path: str | Path = SPLIT_PATH, datasets_dir: str | Path | None = None) -> dict:
    """Read a split JSON; with `datasets_dir`, check every file's sha256 against the recorded one.

    Raises:
        ConfigError: the split file is missing/malformed, or a prompt file changed since the split.
    """
    path = Path(path)
    try:
        split = json.loads(path.read_text(encoding="utf-8"))
        entries = split["datasets"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: expected a data split JSON with a 'datasets' object ({e})") from None
    if datasets_dir is not None:
        for name, entry in entries.items():
            file = Path(datasets_dir) / f"{name}.jsonl"
            if file.is_file() and _sha256(file) != entry.get("sha256"):
                raise ConfigError(f"{file}: sha256 differs from the one recorded in {path} (the prompt file "
                                  f"changed since the split was made; re-run make_split and retrain)")
    return split


def split_rows(split: dict, part: str) -> list[tuple[str, int]]:
    """(dataset, row) pairs of one part ("train", "calibration" or "eval"), in dataset then row order."""
    if part not in ("train", "calibration", "eval"):
        raise ConfigError(f"split part: expected 'train', 'calibration' or 'eval', found {part!r}")
    return [(name, k) for name, entry in split["datasets"].items() for k in entry[part]]
