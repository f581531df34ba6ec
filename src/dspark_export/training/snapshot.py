"""Committable snapshots of a run's data folder: append-only JSONL files as xz-compressed shards.

Why: the data stage (`scripts/train_drafter.py data`) runs for hours on two cores and its run folder lives outside
the repository, so a new machine would start it again from nothing. The data files are append-only (each answer
is one line, written as it finishes: `training.selfdata`), so a snapshot only has to carry the lines written
since the last one: `pack` writes them as a new shard, `unpack` concatenates the shards back and the data stage
resumes from there. Features and checkpoints are not packed: they are recomputed from the data.

Layout of a snapshot folder: ``<name>.<k:03d>.jsonl.xz`` (shard k of ``<name>.jsonl``: whole lines only) and
``shards.json``: {"format": 1, "files": {"<name>.jsonl": [{"shard", "lines", "bytes", "sha256"}, ...]}}, where a
shard's ``lines``, ``bytes`` and ``sha256`` are those of the file's whole content up to the end of that shard
(cumulative), so both directions check that one side continues the other before anything is written. A
snapshot does not know which run it came from: packing another run's files of the same names is refused (they
do not continue the packed ones), files of other names are added beside them.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
from pathlib import Path

from ..errors import ConfigError

INDEX = "shards.json"
FORMAT = 1


def _whole_lines(path: Path) -> bytes:
    """The file's content up to its last newline (a line still being written is left for the next pack)."""
    data = path.read_bytes()
    return data[: data.rfind(b"\n") + 1]


def _read_index(folder: Path) -> dict:
    """shards.json, checked: the format, plain ``*.jsonl`` file names, shard entries with their fields."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{folder}: expected a snapshot folder, found a file")
    path = folder / INDEX
    if not path.is_file():
        return {"format": FORMAT, "files": {}}
    try:
        index = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ConfigError(f"{path}: expected snapshot format {FORMAT}, found "
                          f"{index.get('format') if isinstance(index, dict) else type(index).__name__!r}")
    files = index.get("files")
    if not isinstance(files, dict):
        raise ConfigError(f"{path}: expected a 'files' object")
    for name, shards in files.items():
        if Path(name).name != name or not name.endswith(".jsonl") or name.startswith("."):
            raise ConfigError(f"{path}: file name {name!r}: expected a plain '<name>.jsonl'")
        if not isinstance(shards, list) or not all(
                isinstance(x, dict) and {"shard", "lines", "bytes", "sha256"} <= x.keys()
                and Path(str(x["shard"])).name == x["shard"] for x in shards):
            raise ConfigError(f"{path}: {name}: expected a list of shards with 'shard' (a plain file name), "
                              "'lines', 'bytes' and 'sha256'")
    return index


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _packed(folder: Path, name: str, shards: list[dict]) -> bytes:
    """The concatenated content of a file's shards, checked against the index."""
    parts = []
    for s in shards:
        try:
            parts.append(lzma.decompress((folder / s["shard"]).read_bytes()))
        except FileNotFoundError:
            raise ConfigError(f"{folder / s['shard']}: missing ({INDEX} lists it as a shard of {name})") from None
        except lzma.LZMAError as e:
            raise ConfigError(f"{folder / s['shard']}: not a readable xz shard of {name} ({e})") from None
    data = b"".join(parts)
    if shards and (len(data) != shards[-1]["bytes"] or hashlib.sha256(data).hexdigest() != shards[-1]["sha256"]):
        raise ConfigError(f"{folder}: the shards of {name} do not match {INDEX} (expected {shards[-1]['bytes']} "
                          f"bytes with sha256 {shards[-1]['sha256'][:12]}…, found {len(data)} bytes)")
    return data


def pack(data_dir: Path, snapshot_dir: Path) -> dict[str, int]:
    """Append each ``data_dir/*.jsonl``'s lines not yet in ``snapshot_dir`` as a new shard.

    Returns {file name: new lines}. Raises `ConfigError` (and writes nothing) when there is no data file, a
    shard the index lists is missing, or a file does not begin with what the snapshot already holds of it."""
    data_dir, snapshot_dir = Path(data_dir), Path(snapshot_dir)
    index = _read_index(snapshot_dir)
    sources = sorted(data_dir.glob("*.jsonl")) if data_dir.is_dir() else []
    if not sources:
        raise ConfigError(f"{data_dir}: expected the data stage's *.jsonl files, found "
                          f"{'no such folder' if not data_dir.is_dir() else 'none'}")
    missing = [s["shard"] for shards in index["files"].values() for s in shards
               if not (snapshot_dir / s["shard"]).is_file()]
    if missing:
        raise ConfigError(f"{snapshot_dir}: shards listed in {INDEX} are missing: {missing}")
    plans = []
    for path in sources:
        content = _whole_lines(path)
        shards = index["files"].get(path.name, [])
        done = shards[-1]["bytes"] if shards else 0
        if len(content) < done:
            raise ConfigError(f"{path}: holds {len(content)} bytes of whole lines, fewer than the {done} the "
                              f"snapshot in {snapshot_dir} already has of it: a data file only grows")
        if shards and hashlib.sha256(content[:done]).hexdigest() != shards[-1]["sha256"]:
            raise ConfigError(f"{path}: does not continue the snapshot in {snapshot_dir} (its first {done} bytes "
                              "differ from the packed ones): pack another run into another folder")
        if len(content) > done:
            plans.append((path.name, shards, content, done))
    snapshot_dir.mkdir(parents=True, exist_ok=True)
    added = {}
    for name, shards, content, done in plans:
        shard = f"{name[: -len('.jsonl')]}.{len(shards):03d}.jsonl.xz"
        _write_atomic(snapshot_dir / shard, lzma.compress(content[done:], preset=9))
        added[name] = content[done:].count(b"\n")
        lines = (shards[-1]["lines"] if shards else 0) + added[name]
        index["files"][name] = shards + [{"shard": shard, "lines": lines, "bytes": len(content),
                                          "sha256": hashlib.sha256(content).hexdigest()}]
    if added:  # the index last: a shard it does not name yet is ignored and rewritten by the next pack
        _write_atomic(snapshot_dir / INDEX, (json.dumps(index, indent=1) + "\n").encode())
    return added


def unpack(snapshot_dir: Path, data_dir: Path) -> dict[str, int]:
    """Restore each packed file into ``data_dir`` where the snapshot holds more of it than the folder.

    A file already there that the snapshot continues is replaced; one that continues the snapshot (more lines
    written since) is kept. Returns {file name: lines restored}. Raises `ConfigError` before writing anything
    when a file there and the snapshot disagree on a common prefix."""
    snapshot_dir, data_dir = Path(snapshot_dir), Path(data_dir)
    index = _read_index(snapshot_dir)
    if not index["files"]:
        raise ConfigError(f"{snapshot_dir}: no {INDEX} with packed files (make one with `train_drafter.py pack`)")
    plans = []
    for name, shards in sorted(index["files"].items()):
        packed = _packed(snapshot_dir, name, shards)
        here = _whole_lines(data_dir / name) if (data_dir / name).is_file() else b""
        common = min(len(here), len(packed))
        if here[:common] != packed[:common]:
            raise ConfigError(f"{data_dir / name}: differs from the snapshot's {name} within the first {common} "
                              f"bytes: restore into an empty run folder")
        if len(packed) > len(here):
            plans.append((name, packed, shards[-1]["lines"]))
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, packed, lines in plans:
        _write_atomic(data_dir / name, packed)
    return {name: lines for name, _, lines in plans}
