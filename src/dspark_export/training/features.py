"""Target feature cache for drafter training (DeepSpec reference §1.2, §3).

For every (prompt, response) record the target runs once over ``prompt + response`` and the cache
keeps, per token:

- ``aux``  [T, F] float16: the raw outputs of the tapped target layers (``hidden_states[l + 1]`` for
  l in ``target_layer_ids``, concatenated in tap order): the drafter's context features;
- ``last`` [T, H] float16: the target's final-normed hidden state. The target's next-token
  distribution at a position is ``softmax(lm_head(last))`` with the (frozen, shared) LM head, so the
  full [T, V] distribution is recovered exactly from H numbers per token instead of V.

plus ``tokens`` [T] int32 and the prompt length (tokens at ``>= prompt_len`` are assistant tokens).
A feature source computes them: the transformers target (`TransformersFeatures`, bfloat16) or, injected by
the caller, the engines' own target graph (`engines.target_features.EngineFeatures`: the features the
drafter reads at inference, int4 on the default build). Its name is kept in meta.json and a cache grows
only from the same source.

Layout of a cache folder (written in parts so an interrupted run resumes at the first missing part):

    meta.json                        {"format": 1, "target_layer_ids", "hidden_size", "feature_size",
                                      "dtype": "float16", "source", "parts": [...],
                                      "complete": bool}
    part-00000/tokens.npy            int32 [N]   (N tokens of the part's sequences, concatenated)
    part-00000/aux.npy               float16 [N, F]
    part-00000/last.npy              float16 [N, H]
    part-00000/index.json            {"offsets": [...], "prompt_lens": [...], "sources": [...]}

A part's folder is written under a temporary name and renamed when complete. When the records grow (the
responses JSONL is append-only), the parts already full are kept and a last part holding fewer sequences
than it now should is rebuilt, so the cache grows with the data.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import ConfigError
from ..progress import Eta

__all__ = ["build_feature_cache", "build_feature_cache_parallel", "FeatureCache", "Sequence_", "TransformersFeatures"]

FORMAT = 1
LEGACY_SOURCE = "transformers"  #: meta.json "source" of a cache written before sources were recorded


def _write_meta(folder: Path, meta: dict) -> None:
    tmp = folder / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, folder / "meta.json")


class TransformersFeatures:
    """The feature source over a transformers causal LM: one forward pass per sequence in `dtype`.

    Args:
        target_model: the target (eval mode); moved to `dtype`.
        target_layer_ids: tapped layers (0-based decoder layers, never the last).
        dtype: compute dtype (bfloat16 is ~3x faster on CPUs with bf16 matmul; the paper's targets run in
            bf16 too). Stored values are float16 either way.
    """

    def __init__(self, target_model, target_layer_ids: Sequence[int], dtype: torch.dtype = torch.bfloat16):
        self.model = target_model.to(dtype)
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self.hidden_size = int(target_model.config.hidden_size)
        self.name = f"transformers:{str(dtype).removeprefix('torch.')}"

    @torch.no_grad()
    def features(self, tokens) -> tuple[np.ndarray, np.ndarray]:
        """aux [T, F] and last [T, H] (`hidden_states[l + 1]` per tap, and the final-normed last one)."""
        hs = self.model(input_ids=torch.as_tensor(np.asarray(tokens, np.int64))[None],
                        output_hidden_states=True).hidden_states
        return (torch.cat([hs[l + 1][0] for l in self.target_layer_ids], dim=-1).float().numpy(),
                hs[-1][0].float().numpy())


def build_feature_cache(target, records: Sequence[dict], target_layer_ids: Sequence[int] | None, out_dir: str | Path,
                        *, part_size: int = 64, max_tokens: int = 1024, dtype: torch.dtype = torch.bfloat16,
                        progress: Callable[[str], None] | None = None, shard: tuple[int, int] | None = None) -> Path:
    """Run the target over each record and write the cache (resumable; see the module docstring).

    Args:
        target: a transformers causal LM (the target, eval mode; run through `TransformersFeatures` at
            `dtype` with `target_layer_ids`), or a feature source: an object with `features(tokens) ->
            (aux [T, F], last [T, H])`, `target_layer_ids`, `hidden_size` and `name`, such as
            `engines.target_features.EngineFeatures` (the engines' own features).
        records: response records (`training.data`): "prompt_ids", "response_ids", "dataset", "row".
        target_layer_ids: tapped layers of a transformers target; None (or the same list) with a source.
        out_dir: cache folder (created; existing complete parts are kept).
        part_size: sequences per part.
        max_tokens: sequences are cut to this many tokens.
        dtype: compute dtype of a transformers target.
        shard: (k, W): compute only the parts whose index is k mod W and leave meta.json alone (one of W
            processes of `build_feature_cache_parallel`; a last call without it completes meta.json);
            (0, 0): no part (the folder's checks only).
    Raises:
        ConfigError: the folder holds a cache made with other taps, hidden size or feature source, or
            `target_layer_ids` disagrees with the source's.
    """
    if callable(getattr(target, "features", None)):
        source = target
        if target_layer_ids is not None and [int(i) for i in target_layer_ids] != list(source.target_layer_ids):
            raise ConfigError(f"target_layer_ids: {source.name} taps {list(source.target_layer_ids)}, "
                              f"found {list(target_layer_ids)}")
    else:
        source = TransformersFeatures(target, target_layer_ids, dtype)
    say = progress or (lambda line: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    H, ids = source.hidden_size, list(source.target_layer_ids)
    meta = {"format": FORMAT, "target_layer_ids": ids, "hidden_size": H, "feature_size": H * len(ids),
            "dtype": "float16", "source": source.name, "parts": [], "complete": False,
            "num_records": len(records)}
    if (out / "meta.json").is_file():
        old = {"source": LEGACY_SOURCE, **json.loads((out / "meta.json").read_text(encoding="utf-8"))}
        if old["source"] == LEGACY_SOURCE and meta["source"].startswith("transformers:"):
            meta["source"] = LEGACY_SOURCE  # written before sources were recorded: transformers, dtype unknown
        for key in ("target_layer_ids", "hidden_size", "source"):
            if old.get(key) != meta[key]:
                raise ConfigError(f"{out}/meta.json: {key} is {old.get(key)!r} but this run uses {meta[key]!r}; "
                                  "use another folder")
        if len(records) < old.get("num_records", 0):
            raise ConfigError(f"{out}/meta.json: the cache holds {old['num_records']} records but this run gives "
                              f"{len(records)}; a cache only grows (records are append-only): give at least "
                              f"{old['num_records']}")
    if shard is None or not shard[1]:  # until the last part is in, the folder says "incomplete, this source"
        _write_meta(out, meta)
    t0, done_tokens = time.perf_counter(), 0
    starts = range(0, len(records), part_size)
    def complete(start: int) -> bool:
        index = out / f"part-{start // part_size:05d}" / "index.json"
        if not index.is_file():
            return False
        n = len(json.loads(index.read_text(encoding="utf-8"))["prompt_lens"])
        return n == min(part_size, len(records) - start)

    mine = {st for st in starts if shard is None or (shard[1] and (st // part_size) % shard[1] == shard[0])}
    already = sum(min(part_size, len(records) - st) for st in mine if complete(st))
    eta = Eta(sum(min(part_size, len(records) - st) for st in mine), start=already)  # parts on disk do not
    done_sequences = already                                                         # count towards the rate
    for start in starts:
        name = f"part-{start // part_size:05d}"
        meta["parts"].append(name)
        if start not in mine or complete(start):
            continue
        shutil.rmtree(out / name, ignore_errors=True)  # a part written when there were fewer records
        tmp = out / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        toks, auxs, lasts, offsets, prompt_lens, sources = [], [], [], [0], [], []
        for rec in records[start:start + part_size]:
            seq = (list(rec["prompt_ids"]) + list(rec["response_ids"]))[:max_tokens]
            try:
                aux, last = source.features(seq)
            except ConfigError as e:
                raise ConfigError(f"{name}: record {rec.get('dataset')!r} row {rec.get('row')!r}: {e}") from None
            auxs.append(np.asarray(aux, np.float16))
            lasts.append(np.asarray(last, np.float16))
            toks.append(np.asarray(seq, np.int32))
            offsets.append(offsets[-1] + len(seq))
            prompt_lens.append(min(len(rec["prompt_ids"]), len(seq)))
            sources.append({k: rec.get(k) for k in ("dataset", "row", "temperature")})
        np.save(tmp / "tokens.npy", np.concatenate(toks))
        np.save(tmp / "aux.npy", np.concatenate(auxs))
        np.save(tmp / "last.npy", np.concatenate(lasts))
        (tmp / "index.json").write_text(json.dumps({"offsets": offsets, "prompt_lens": prompt_lens,
                                                    "sources": sources}), encoding="utf-8")
        os.replace(tmp, out / name)
        done_tokens += offsets[-1]
        done_sequences += len(prompt_lens)
        say(f"{name}: {eta.text(done_sequences)} sequences, {done_tokens / (time.perf_counter() - t0):.0f} tok/s")
        if shard is None:
            _write_meta(out, {**meta, "parts": list(meta["parts"])})
    if shard is None:
        meta["complete"] = True
        _write_meta(out, meta)
    return out


def _cache_shard(open_source: Callable[[], object], records: Sequence[dict | None], out_dir: str, k: int,
                 workers: int, part_size: int, max_tokens: int, errors) -> None:
    """One process of `build_feature_cache_parallel`: its own feature source, the parts k mod `workers`
    (`records` holds None for the other processes' records). An error goes to `errors` as (k, message)."""
    import sys

    def say(line: str) -> None:
        print(f"[features worker {k + 1}/{workers}] {line}", file=sys.stderr, flush=True)

    try:
        build_feature_cache(open_source(), records, None, out_dir, part_size=part_size, max_tokens=max_tokens,
                            progress=say, shard=(k, workers))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which stops the others
        errors.put((k, f"{type(e).__name__}: {e}"))
        raise SystemExit(1)


def build_feature_cache_parallel(open_source: Callable[[], object], records: Sequence[dict], out_dir: str | Path,
                                 *, workers: int, part_size: int = 64, max_tokens: int = 1024,
                                 progress: Callable[[str], None] | None = None, source=None) -> Path:
    """`build_feature_cache` over `workers` processes, each with its own feature source (`open_source()`,
    picklable: e.g. ``functools.partial(EngineFeatures, engine_dir, threads=1)``) and every W-th part.

    Why: on a small CPU, W single-threaded ONNX Runtime sessions prefill more tokens per second than one
    session with W threads (its softmax and scatter nodes run on one thread; reports/drafter/features-workers.md).
    The cache is the same part for part: each sequence is computed alone, whichever process takes it.
    The folder's compatibility with the source (`source`, else one more `open_source()`) is checked and
    meta.json marked incomplete before any process starts; the first process to fail stops the others (parts
    they finished stay, a part in progress stays a temporary folder) and raises `ConfigError` naming it; a
    last pass here writes meta.json (and computes any part left undone).
    """
    import multiprocessing
    import queue

    source = source if source is not None else open_source()
    out = Path(out_dir)
    build_feature_cache(source, records, None, out, part_size=part_size, max_tokens=max_tokens, shard=(0, 0))
    workers = max(1, min(int(workers), -(-len(records) // part_size)))
    if workers > 1:
        ctx = multiprocessing.get_context("spawn")
        errors = ctx.Queue()
        procs = [ctx.Process(target=_cache_shard, name=f"features-worker-{k + 1}", daemon=True,
                             args=(open_source, [r if (i // part_size) % workers == k else None
                                                 for i, r in enumerate(records)],
                                   str(out), k, workers, part_size, max_tokens, errors))
                 for k in range(workers)]
        for proc in procs:
            proc.start()
        failure = None
        try:
            while failure is None:
                try:
                    failure = errors.get(timeout=1.0)
                except queue.Empty:
                    dead = [(k, proc.exitcode) for k, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
                    if dead:  # its own message, if it could send one, else how it ended
                        try:
                            failure = errors.get(timeout=2.0)
                        except queue.Empty:
                            failure = (dead[0][0], f"exited with code {dead[0][1]}")
                    elif not any(proc.is_alive() for proc in procs):
                        break
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
                proc.join()
        if failure is not None:
            k, message = failure
            raise ConfigError(f"{out}: features worker {k + 1}/{workers} failed: {message} (finished parts are "
                              "kept; the same command resumes)")
    return build_feature_cache(source, records, None, out, part_size=part_size, max_tokens=max_tokens,
                               progress=progress)


@dataclass
class Sequence_:
    """One cached sequence: tokens [T] int64, aux [T, F] float32, last [T, H] float32, prompt_len; t_lse [T]
    float32 or None (the target's full-vocabulary logsumexp, set by the trainer for the draft-vocabulary loss);
    t_argmax [T] int64 or None (the target's argmax per row, set by the trainer for argmax CE labels)."""

    tokens: np.ndarray
    aux: np.ndarray
    last: np.ndarray
    prompt_len: int
    source: dict
    t_lse: np.ndarray | None = None
    t_argmax: np.ndarray | None = None


class FeatureCache:
    """Read-only view of a complete cache folder (memory-mapped parts).

    Raises:
        ConfigError: the folder is missing, incomplete, or of another format.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        try:
            self.meta = json.loads((self.folder / "meta.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{self.folder}: expected a feature cache with meta.json ({e})") from None
        if self.meta.get("format") != FORMAT or not self.meta.get("complete"):
            raise ConfigError(f"{self.folder}/meta.json: expected a complete format-{FORMAT} cache, found "
                              f"format {self.meta.get('format')!r}, complete={self.meta.get('complete')!r}")
        self._index: list[tuple[int, int]] = []
        self._parts = []
        for p, name in enumerate(self.meta["parts"]):
            d = self.folder / name
            index = json.loads((d / "index.json").read_text(encoding="utf-8"))
            arrays = {k: np.load(d / f"{k}.npy", mmap_mode="r") for k in ("tokens", "aux", "last")}
            self._parts.append((arrays, index))
            self._index += [(p, i) for i in range(len(index["prompt_lens"]))]

    def __len__(self) -> int:
        return len(self._index)

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.meta["target_layer_ids"])

    def num_tokens(self) -> int:
        return sum(int(idx["offsets"][-1]) for _, idx in self._parts)

    def length(self, i: int) -> int:
        """Sequence i's token count T, from the index (no array is read)."""
        p, j = self._index[i]
        offsets = self._parts[p][1]["offsets"]
        return int(offsets[j + 1]) - int(offsets[j])

    def prompt_len(self, i: int) -> int:
        """Sequence i's prompt token count, from the index (no array is read)."""
        p, j = self._index[i]
        return int(self._parts[p][1]["prompt_lens"][j])

    def source(self, i: int) -> dict:
        """Sequence i's source ({"dataset", "row", "temperature"}) without reading its arrays."""
        p, j = self._index[i]
        return self._parts[p][1]["sources"][j]

    def __getitem__(self, i: int) -> Sequence_:
        p, j = self._index[i]
        arrays, index = self._parts[p]
        a, b = index["offsets"][j], index["offsets"][j + 1]
        return Sequence_(tokens=np.asarray(arrays["tokens"][a:b], np.int64),
                         aux=np.asarray(arrays["aux"][a:b], np.float32),
                         last=np.asarray(arrays["last"][a:b], np.float32),
                         prompt_len=self.prompt_len(i), source=index["sources"][j])
