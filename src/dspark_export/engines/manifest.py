"""The engine directory's manifest: the embedding contract between build and run.

Schema versions (bump when a field's meaning changes):
    1: first version. Graphs under graphs/, ORT engine specs under engines/onnxruntime/, the
       throughput profile at profile/sps.json, tokenizer files under tokenizer/. Every file is
       listed in `files` with its size in bytes and sha256. Optional sections (readers must not require
       them): `calibration` {"path": "drafter/calibration.json", "method"} and `report` {"path":
       "report/index.html", "data", "generated_unix"}, whose files are listed like every other file;
       `draft_vocab` {"size": N, "d2t": [N target token ids], "method", "source", "records",
       "tokens_counted"} when the drafter block computes draft logits over N < V tokens only
       (`exporter.drafter.draft_vocab_head`; `graphs.drafter_block.spec.draft_vocab_size` is N).
    2: with `draft_vocab`, the drafter block's `draft_logits` may be [R, γ, N] over the d2t ids (builds since
       65e4309; earlier ones return [R, γ, V]); readers tell the two apart by the width, which a reader of
       schema 1 does not. Version 1 is still read. Re-sealing a manifest (`save`, `replace_file`: profile,
       report, TensorRT build) stamps it 2, which is true of both widths.

The manifest is written last and atomically (temp file, fsync, rename): a directory without a
valid manifest is not an engine directory, so an interrupted build never looks complete.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EngineDirError

#: the manifest schema this version writes (the module docstring says what each version means). Why 2: a reader
#: of schema 1 would feed [R, γ, Vd] draft logits to verification as V-wide ones.
SCHEMA_VERSION = 2
#: schemas this version reads (it tells the two draft-logits widths apart by their width)
READABLE_SCHEMA_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
REQUIRED_FIELDS = ("schema_version", "tool", "graphs", "engines", "runtime", "files")
REQUIRED_GRAPHS = ("target", "drafter_context", "drafter_block", "verify")
#: runtime fields the loop reads, with their JSON types
RUNTIME_FIELDS = {"block_size": int, "max_context": int, "vocab_size": int, "eos_token_ids": list,
                  "confidence_temperature": list}

__all__ = ["Manifest", "EngineKey", "SCHEMA_VERSION", "READABLE_SCHEMA_VERSIONS", "sha256_file", "resolve_inside",
           "write_json_atomic"]


@dataclass(frozen=True)
class EngineKey:
    """Identifies one engine: a graph specialised to one bucket on one backend.

    The engine's path is derived from the key (`path`), never parsed back from a file name.
    """

    graph: str       # "target", "drafter_block", "drafter_context", "verify"
    backend: str     # "onnxruntime" (or "tensorrt" where installed)
    dim: str         # the bucketed dimension: "N" packed tokens, "R" requests
    bucket: int

    @property
    def path(self) -> str:
        return f"engines/{self.backend}/{self.graph}.{self.dim}{self.bucket}.json"

    def to_dict(self) -> dict:
        return {"graph": self.graph, "backend": self.backend, "dim": self.dim, "bucket": self.bucket}

    @classmethod
    def from_dict(cls, d: dict) -> "EngineKey":
        return cls(str(d["graph"]), str(d["backend"]), str(d["dim"]), int(d["bucket"]))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def resolve_inside(root: Path, rel: str, what: str) -> Path:
    """Resolve manifest path `rel` under `root`; refuse absolute paths and paths that escape it.

    Raises:
        EngineDirError: `rel` is absolute or resolves outside `root`.
    """
    if not isinstance(rel, str) or not rel or os.path.isabs(rel):
        raise EngineDirError(f"{root / MANIFEST_NAME}: {what}: expected a relative path inside the "
                             f"engine directory, found {rel!r}")
    root_r = root.resolve()
    full = (root_r / rel).resolve()
    if full != root_r and root_r not in full.parents:
        raise EngineDirError(f"{root / MANIFEST_NAME}: {what}: path {rel!r} points outside the engine "
                             f"directory {root_r}")
    return full


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to `path` through a temp file in the same folder, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; engine directories are shared read-only
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


@dataclass
class Manifest:
    """In-memory manifest. `data` holds the JSON object; helpers give typed access."""

    root: Path
    data: dict = field(default_factory=dict)

    # -- access ------------------------------------------------------------------------------
    def path_of(self, rel: str, what: str = "path") -> Path:
        return resolve_inside(self.root, rel, what)

    def graph_path(self, graph: str) -> Path:
        try:
            rel = self.data["graphs"][graph]["path"]
        except KeyError as e:
            raise EngineDirError(f"{self.root / MANIFEST_NAME}: graphs.{graph}.path is missing") from e
        return self.path_of(rel, f"graphs.{graph}.path")

    def engine_keys(self, graph: str | None = None) -> list[EngineKey]:
        keys = [EngineKey.from_dict(e["key"]) for e in self.data["engines"]]
        return [k for k in keys if graph is None or k.graph == graph]

    @property
    def confidence_bias(self) -> list[float]:
        """runtime.confidence_bias [γ] (per-position calibration bias, `training.calibration`); all 0 when
        the manifest has none (temperature-only calibration, older builds)."""
        rt = self.data["runtime"]
        return [float(b) for b in rt.get("confidence_bias") or [0.0] * len(rt["confidence_temperature"])]

    @property
    def runtime(self) -> dict:
        return self.data["runtime"]

    @property
    def drafter_context_window(self) -> tuple[int, int] | None:
        """(sink, recent) rows of runtime.drafter_context_window (`build --drafter-context`,
        `runtime.stages.ContextWindow`), or None when absent (the drafter reads every committed row).

        Raises:
            EngineDirError: not {"sink": integer in [0, max_context], "recent": integer in [1, max_context]}.
        """
        entry = self.runtime.get("drafter_context_window")
        if entry is None:
            return None
        top = int(self.runtime["max_context"])
        ok = isinstance(entry, dict) and set(entry) == {"sink", "recent"} and all(
            type(entry[k]) is int and lo <= entry[k] <= top for k, lo in (("sink", 0), ("recent", 1)))
        if not ok:
            raise EngineDirError(f"{self.root / MANIFEST_NAME}: runtime.drafter_context_window: expected "
                                 f"{{\"sink\": integer 0..{top}, \"recent\": integer 1..{top}}}, found {entry!r:.80}")
        return entry["sink"], entry["recent"]

    def calibration(self) -> dict | None:
        """The drafter's calibration.json that the directory keeps (`calibration.path`; written by
        `scripts/train_drafter.py`, copied by `build`): STS temperatures, ECE, reliability bins. None when
        the manifest records none.

        Raises:
            EngineDirError: the manifest's `calibration` entry is malformed, or the file is missing, not JSON,
                or not a JSON object.
        """
        entry = self.data.get("calibration")
        if not entry:
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise EngineDirError(f"{self.root / MANIFEST_NAME}: calibration: expected an object with a string "
                                 f"'path', found {entry!r:.80}")
        path = self.path_of(entry["path"], "calibration.path")
        try:
            cal = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EngineDirError(f"{path}: calibration: not readable JSON ({e})") from e
        if not isinstance(cal, dict):
            raise EngineDirError(f"{path}: calibration: expected a JSON object, found {type(cal).__name__}")
        return cal

    # -- io ----------------------------------------------------------------------------------
    def record_files(self, rel_paths: list[str]) -> None:
        """List `rel_paths` in `files` with their size and sha256 (call before `save`)."""
        files = self.data.setdefault("files", {})
        for rel in sorted(set(rel_paths)):
            full = self.path_of(rel, "files")
            files[rel] = {"bytes": full.stat().st_size, "sha256": sha256_file(full)}

    def replace_file(self, rel: str, content: bytes) -> None:
        """Replace one listed file and re-seal the manifest with as small a window as renames allow.

        The new manifest (same entries, this file's new size and hash) is prepared first; then the
        file and the manifest are each swapped in by an atomic rename, back to back. Other files are
        not re-hashed (they were verified when the manifest was loaded).
        """
        full = self.path_of(rel, "files")
        self.data["files"][rel] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
        self.data["schema_version"] = SCHEMA_VERSION
        full.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{full.name}.", dir=full.parent)
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, full)
        write_json_atomic(self.root / MANIFEST_NAME, self.data)

    def replace_folder(self, rel_dir: str, files: dict[str, bytes], section: str | None = None,
                       entry: dict | None = None) -> None:
        """Replace everything under `rel_dir` with `files` ({name inside rel_dir: content}) and re-seal.

        The new folder is written beside the old one (`.<name>.new-<pid>`), then old and new are swapped by
        renames and the manifest (old entries under `rel_dir` dropped, the new ones listed with size and sha256,
        `data[section] = entry` when given) is rewritten atomically right after. Other files are not re-hashed.

        Raises:
            EngineDirError: `rel_dir` or a file name leaves the directory, or a name has a folder part.
        """
        rel_dir = rel_dir.strip("/")
        target = self.path_of(rel_dir, "folder")
        if target == self.root.resolve():
            raise EngineDirError(f"{self.root}: refusing to replace the engine directory itself")
        for name in files:
            if "/" in name or name in ("", ".", ".."):
                raise EngineDirError(f"{self.root}: {rel_dir}: expected plain file names, found {name!r}")
        pid = os.getpid()
        new, old = target.with_name(f".{target.name}.new-{pid}"), target.with_name(f".{target.name}.old-{pid}")
        for stale in (new, old):
            if stale.exists():
                shutil.rmtree(stale)
        new.mkdir(parents=True)
        listed = {}
        try:
            for name, content in sorted(files.items()):
                (new / name).write_bytes(content)
                (new / name).chmod(0o644)
                listed[f"{rel_dir}/{name}"] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
            new.chmod(0o755)
            if target.exists():
                os.replace(target, old)
            os.replace(new, target)
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            if old.exists() and not target.exists():
                os.replace(old, target)
            raise
        kept = {rel: info for rel, info in self.data["files"].items() if not rel.startswith(rel_dir + "/")}
        self.data["files"] = {**kept, **listed}
        if section is not None:
            self.data[section] = entry
        self.save()
        shutil.rmtree(old, ignore_errors=True)

    def save(self) -> Path:
        self.data["schema_version"] = SCHEMA_VERSION
        path = self.root / MANIFEST_NAME
        write_json_atomic(path, self.data)
        return path

    @classmethod
    def load(cls, root: Path, verify: bool = True) -> "Manifest":
        """Read and validate `<root>/manifest.json`.

        Args:
            root: the engine directory.
            verify: check every listed file's size and sha256 (defaults to True; ~1 s per GB).
        Raises:
            EngineDirError: no manifest, unreadable JSON, unknown schema version, missing fields,
                a path outside the directory, or a missing/altered file.
        """
        root = Path(root)
        path = root / MANIFEST_NAME
        if not root.is_dir():
            raise EngineDirError(f"{root}: expected an engine directory (built by `dspark-export build`), "
                                 + ("found a file" if root.exists() else "found no such directory"))
        if not path.is_file():
            raise EngineDirError(f"{path}: missing; {root} is not a complete engine directory "
                                 "(an interrupted build leaves no manifest)")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EngineDirError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(data, dict):
            raise EngineDirError(f"{path}: expected a JSON object, found {type(data).__name__}")
        version = data.get("schema_version")
        if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:
            raise EngineDirError(f"{path}: schema_version: expected one of {list(READABLE_SCHEMA_VERSIONS)}, found "
                                 f"{version!r} (rebuild the engine directory with this version of dspark-export)")
        missing = [k for k in REQUIRED_FIELDS if k not in data]
        if missing:
            raise EngineDirError(f"{path}: missing fields {missing}")
        manifest = cls(root, data)
        manifest.check_fields()
        manifest.check_files(verify)
        manifest.check_graph_d2t()
        return manifest

    def check_graph_d2t(self) -> None:
        """The manifest's `draft_vocab.d2t` is the drafter block graph's own (its `draft_vocab.d2t` initializer,
        ascending). Why: the runtime scatters a sampled request's draft logits to V at these ids; any other set
        would verify drafts against a q that is not the one they were drawn from (lossy, silently)."""
        entry = self.data.get("draft_vocab")
        if not entry:
            return
        import onnx
        from onnx import external_data_helper, numpy_helper

        from ..plugins.markov_draft.schema import D2T_INITIALIZER

        path = self.graph_path("drafter_block")
        try:
            model = onnx.load(str(path), load_external_data=False)
            found = [t for t in model.graph.initializer if t.name == D2T_INITIALIZER]
            if not found:   # graphs from before the initializer was named in every form
                return
            tensor = found[0]
            if external_data_helper.uses_external_data(tensor):
                external_data_helper.load_external_data_for_tensor(tensor, str(path.parent))
            graph_d2t = numpy_helper.to_array(tensor).reshape(-1).tolist()
        except Exception as e:   # protobuf, OS and external-data errors alike
            raise EngineDirError(f"{path}: cannot read the drafter block graph's {D2T_INITIALIZER} "
                                 f"({type(e).__name__}: {e}); rebuild the engine directory") from e
        if sorted(entry["d2t"]) != graph_d2t:
            diff = len(set(entry["d2t"]) ^ set(graph_d2t))
            raise EngineDirError(f"{self.root / MANIFEST_NAME}: draft_vocab.d2t differs from the drafter block "
                                 f"graph's {D2T_INITIALIZER} ({path.name}: {diff} ids in one but not the "
                                 f"other); rebuild the engine directory")

    def check_fields(self) -> None:
        """Types of the sections the runtime reads; graphs and engine paths agree with their keys."""
        where = self.root / MANIFEST_NAME
        for name, kind in (("graphs", dict), ("runtime", dict), ("files", dict), ("engines", list)):
            if not isinstance(self.data[name], kind):
                raise EngineDirError(f"{where}: {name}: expected a JSON {kind.__name__.replace('dict', 'object')}, "
                                     f"found {type(self.data[name]).__name__}")
        missing = [g for g in REQUIRED_GRAPHS if not isinstance(self.data["graphs"].get(g), dict)]
        if missing:
            raise EngineDirError(f"{where}: graphs: missing {missing}")
        for name, kind in RUNTIME_FIELDS.items():
            value = self.data["runtime"].get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise EngineDirError(f"{where}: runtime.{name}: expected a JSON {kind.__name__}, found {value!r}")
            if kind is int and value < 1:
                raise EngineDirError(f"{where}: runtime.{name}: expected an integer >= 1, found {value}")
        if not self.data["engines"]:
            raise EngineDirError(f"{where}: engines: expected at least one engine, found an empty list")
        graph_vocab = self.data["graphs"]["target"].get("spec", {}).get("vocab_size")
        if graph_vocab is not None and graph_vocab != self.data["runtime"]["vocab_size"]:
            raise EngineDirError(f"{where}: runtime.vocab_size {self.data['runtime']['vocab_size']} does not match "
                                 f"the target graph's vocab_size {graph_vocab} (graphs.target.spec)")
        block = self.data["graphs"]["drafter_block"].get("spec", {}).get("block_size")
        if self.data["runtime"]["block_size"] != block or len(self.data["runtime"]["confidence_temperature"]) != block:
            raise EngineDirError(f"{where}: runtime.block_size {self.data['runtime']['block_size']} and "
                                 f"confidence_temperature must match the drafter graph's block_size {block}")
        bias = self.data["runtime"].get("confidence_bias")
        if bias is not None and not (isinstance(bias, list) and len(bias) == block and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in bias)):
            raise EngineDirError(f"{where}: runtime.confidence_bias: expected {block} finite numbers (the drafter "
                                 f"graph's block_size), found {bias!r}")
        self._check_draft_vocab(where)
        for entry in self.data["engines"]:
            try:
                key = EngineKey.from_dict(entry["key"])
            except (KeyError, TypeError, ValueError) as e:
                raise EngineDirError(f"{where}: engines: malformed entry {entry!r}") from e
            if entry.get("path") != key.path:
                raise EngineDirError(f"{where}: engines: path {entry.get('path')!r} does not match its key "
                                     f"(expected {key.path!r})")

    def _check_draft_vocab(self, where: Path) -> None:
        """The optional `draft_vocab` section agrees with the drafter graph's draft_vocab_size (0 = none)."""
        size = self.data["graphs"]["drafter_block"].get("spec", {}).get("draft_vocab_size", 0)
        entry = self.data.get("draft_vocab")
        if entry is None:
            if size:
                raise EngineDirError(f"{where}: draft_vocab: missing, but graphs.drafter_block.spec.draft_vocab_size "
                                     f"is {size}")
            return
        d2t = entry.get("d2t") if isinstance(entry, dict) else None
        vocab = self.data["runtime"]["vocab_size"]
        if not isinstance(d2t, list) or len(d2t) != size or entry.get("size") != size or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in d2t) \
                or len(set(d2t)) != len(d2t):
            raise EngineDirError(f"{where}: draft_vocab: expected size and d2t of {size} distinct token ids in "
                                 f"[0, {vocab}) (graphs.drafter_block.spec.draft_vocab_size), found size "
                                 f"{entry.get('size') if isinstance(entry, dict) else entry!r} and "
                                 f"{len(d2t) if isinstance(d2t, list) else type(d2t).__name__} ids")

    def check_files(self, verify: bool) -> None:
        """Every listed file exists inside the directory (and matches its size/hash when `verify`)."""
        for rel, info in self.data["files"].items():
            full = self.path_of(rel, "files")
            if not full.is_file():
                raise EngineDirError(f"{self.root}: file {rel!r} listed in the manifest is missing")
            size = full.stat().st_size
            if size != info.get("bytes"):
                raise EngineDirError(f"{self.root}: file {rel!r} was altered: expected {info.get('bytes')} bytes, "
                                     f"found {size}")
            if verify and sha256_file(full) != info.get("sha256"):
                raise EngineDirError(f"{self.root}: file {rel!r} was altered: sha256 does not match the manifest")
        for section in ("graphs",):
            for name, entry in self.data[section].items():
                for k in ("path", "data"):
                    if entry.get(k):
                        self.path_of(entry[k], f"{section}.{name}.{k}")
                        if entry[k] not in self.data["files"]:
                            raise EngineDirError(f"{self.root}: {section}.{name}.{k} {entry[k]!r} is not "
                                                 "listed in files (cannot be verified)")
