"""Prompt files shared by the benchmarks, drafter training and `generate`: the evaluation datasets
(DeepSpec's {"turns": [...]} JSONL, one prompt per row), the benchmark's row selection (which training
must leave out), and `generate`'s prompts files ({"prompt": ...} JSONL).

A base module (like errors.py): it imports nothing of the package but errors.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from .errors import ConfigError, RequestError

__all__ = ["DOMAINS", "DEFAULT_DATASETS", "DEFAULT_SEED", "default_datasets_dir", "read_dataset", "select_rows",
           "read_prompts"]

#: the acceptance benchmark's datasets, by domain (math, code, chat)
DOMAINS = {"math": ("gsm8k", "math500", "aime25"),
           "code": ("mbpp", "humaneval", "livecodebench"),
           "chat": ("mt-bench", "arena-hard-v2")}
DEFAULT_DATASETS = tuple(d for names in DOMAINS.values() for d in names)
#: the shuffle seed of `select_rows` (as in DeepSpec)
DEFAULT_SEED = 980406


def default_datasets_dir() -> Path | None:
    """`../shared/eval_datasets` relative to the repository root (the project's layout), if it exists."""
    candidate = Path(__file__).resolve().parents[2].parent / "shared" / "eval_datasets"
    return candidate if candidate.is_dir() else None


def read_dataset(path: Path) -> list[str]:
    """First turns of a {"turns": [...]} JSONL file (DeepSpec eval format).

    Raises:
        ConfigError: a line that is not such an object (file:line named), or an empty file.
    """
    texts = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                turns = json.loads(line)["turns"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"{path}:{n}: expected a JSON object with a 'turns' list ({e!r})") from None
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
                raise ConfigError(f"{path}:{n}: expected 'turns' to be a list whose first item is a non-empty "
                                  f"string, found {str(turns)[:80]!r}")
            texts.append(turns[0])
    if not texts:
        raise ConfigError(f"{path}: expected at least one prompt, found an empty file")
    return texts


def select_rows(texts: list[str], samples: int, seed: int) -> list[int]:
    """Indices (among the file's prompts) of the rows to run: all of them in file order when the file
    has at most `samples` rows, else random.Random(seed).shuffle of all rows and the first `samples`."""
    order = list(range(len(texts)))
    if len(order) > samples:
        random.Random(seed).shuffle(order)
        order = order[:samples]
    return order


def read_prompts(path: Path) -> list[tuple[str | None, str | None]]:
    """(prompt, error) per non-empty line; a bad line (not UTF-8, not JSON, no string 'prompt')
    becomes an error for that prompt only, naming file and line."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError as e:
        raise RequestError(f"{path}: prompts file not found") from e
    except OSError as e:
        raise RequestError(f"{path}: cannot read the prompts file ({e.strerror})") from e
    out = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if n == 1 and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]  # UTF-8 byte-order mark
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            out.append((None, f"{path}:{n}: not valid UTF-8"))
            continue
        except json.JSONDecodeError:
            obj = None
        prompt = obj.get("prompt") if isinstance(obj, dict) else None
        if not isinstance(prompt, str):
            out.append((None, f"{path}:{n}: expected a JSON object with a string 'prompt' field"))
        elif not prompt:
            out.append((prompt, f"{path}:{n}: 'prompt' is empty (expected text)"))
        else:
            out.append((prompt, None))
    if not out:
        raise RequestError(f"{path}: no prompts (expected one JSON object with a 'prompt' field per line)")
    return out
