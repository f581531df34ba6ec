"""The drafter's draft vocabulary: the N target tokens it may propose (FR-Spec, Zhao et al. 2025,
arXiv 2502.14856; EAGLE-3's ``d2t``).

The ranking is the frequency of each token in the target's own responses on the training side of the
committed split (`training.data` records; prompts are not counted: drafts continue responses). Ties,
and tokens never seen, are ordered by token id (a BPE tokenizer numbers earlier, i.e. more frequent,
merges lower). EOS ids always rank first, so a draft can end a response. ``d2t = ranking[:N]``.

File (``draft_vocab.json`` beside a drafter checkpoint; `write_ranking` / `read_ranking`)::

    {"method": "target-response-frequency", "vocab_size": V, "source": str, "records": int,
     "tokens_counted": int, "eos_token_ids": [int], "ranking": [int, ...] (tokens seen, most frequent first),
     "counts": [int, ...] (their counts)}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

from ..errors import ConfigError

__all__ = ["DRAFT_VOCAB_FILE", "count_response_tokens", "ranking_from_counts", "select_d2t", "ranking_object", "write_ranking",
           "read_ranking", "load_draft_vocab_source"]

DRAFT_VOCAB_FILE = "draft_vocab.json"
METHOD = "target-response-frequency"


def count_response_tokens(records: Iterable[dict], vocab_size: int) -> np.ndarray:
    """counts [V] int64 of every ``response_ids`` token of `records` (`training.data` format).

    Raises:
        ConfigError: a record holds a token id outside [0, V) (the record's dataset/row named).
    """
    counts = np.zeros(vocab_size, np.int64)
    for rec in records:
        ids = np.asarray(rec["response_ids"], np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ConfigError(f"draft vocabulary: record {rec.get('dataset')}/{rec.get('row')} holds token ids outside "
                              f"[0, {vocab_size}) (another tokenizer?)")
        np.add.at(counts, ids, 1)
    return counts


def ranking_from_counts(counts: np.ndarray, eos_token_ids: Iterable[int] = ()) -> np.ndarray:
    """All V token ids, EOS first, then by count descending, ties by id ascending."""
    counts = np.asarray(counts, np.int64)
    key = -counts.astype(np.float64)
    eos = [int(e) for e in eos_token_ids if 0 <= int(e) < len(counts)]
    key[eos] = -np.inf
    return np.lexsort((np.arange(len(counts)), key)).astype(np.int64)


def select_d2t(ranking: np.ndarray, size: int, vocab_size: int) -> np.ndarray:
    """d2t = the first `size` ids of `ranking` completed by the unseen ids (ascending), sorted by id.

    Sorted by id so the LM head's d2t rows are read in memory order (the order of d2t does not change
    the drafts: the block's logits are indexed by d2t, and a scatter back to V puts each at its id).

    Raises:
        ConfigError: `size` is not in [1, vocab_size].
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not 1 <= size <= vocab_size:
        raise ConfigError(f"draft vocabulary size: expected an integer N with 1 <= N <= vocab_size = {vocab_size}, "
                          f"found {size!r}")
    ranking = np.asarray(ranking, np.int64)
    seen = np.zeros(vocab_size, bool)
    seen[ranking] = True
    full = np.concatenate([ranking, np.flatnonzero(~seen)])
    return np.sort(full[:size])


def ranking_object(counts: np.ndarray, eos_token_ids: Iterable[int], source: str, records: int) -> dict:
    """The ``draft_vocab.json`` object (module docstring) of token counts [V]; ``ranking`` holds the tokens
    seen (and EOS), as an int64 array."""
    counts = np.asarray(counts, np.int64)
    eos = sorted({int(e) for e in eos_token_ids})
    ranking = ranking_from_counts(counts, eos)
    seen = ranking[(counts[ranking] > 0) | np.isin(ranking, eos)]
    return {"method": METHOD, "vocab_size": int(len(counts)), "source": source, "records": int(records),
            "tokens_counted": int(counts.sum()), "eos_token_ids": eos, "ranking": seen,
            "counts": counts[seen].tolist()}


def write_ranking(path: str | Path, data: dict) -> Path:
    """Write a `ranking_object` as ``draft_vocab.json``."""
    path = Path(path)
    out = {**data, "ranking": np.asarray(data["ranking"]).tolist()}
    path.write_text(json.dumps(out, separators=(",", ":")) + "\n", encoding="utf-8")
    return path


def read_ranking(path: str | Path, vocab_size: int) -> dict:
    """Read and check a ``draft_vocab.json``.

    Returns:
        the file's object with ``ranking`` as an int64 array.
    Raises:
        ConfigError: unreadable, another vocabulary size, ids out of range or repeated (the file and field
            named).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        ranking = np.asarray(data["ranking"], np.int64)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: expected a draft vocabulary file with a 'ranking' list of token ids ({e!r})") \
            from None
    if data.get("vocab_size") != vocab_size:
        raise ConfigError(f"{path}: vocab_size: expected the drafter's {vocab_size}, found {data.get('vocab_size')!r}")
    if ranking.ndim != 1 or not ranking.size:
        raise ConfigError(f"{path}: ranking: expected a non-empty list of token ids")
    if ranking.min() < 0 or ranking.max() >= vocab_size:
        raise ConfigError(f"{path}: ranking: token ids must be in [0, {vocab_size}), found {int(ranking.min())}.."
                          f"{int(ranking.max())}")
    if np.unique(ranking).size != ranking.size:
        raise ConfigError(f"{path}: ranking: token ids must be distinct")
    data["ranking"] = ranking
    return data


def load_draft_vocab_source(path: str | Path, vocab_size: int, eos_token_ids: Iterable[int]) -> dict:
    """A ranking from `path`: a ``draft_vocab.json`` or a responses JSONL of `training.data` records
    (counted here). Returns the `read_ranking` object.

    Raises:
        ConfigError: the path does not exist or holds neither format.
    """
    from .data import read_records

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"draft vocabulary source {path}: no such file (expected {DRAFT_VOCAB_FILE} or a responses "
                          "JSONL written by `scripts/train_drafter.py data`)")
    if path.suffix == ".jsonl":
        records = read_records(path)
        if not records:
            raise ConfigError(f"draft vocabulary source {path}: no response records")
        return ranking_object(count_response_tokens(records, vocab_size), eos_token_ids, str(path), len(records))
    return read_ranking(path, vocab_size)
