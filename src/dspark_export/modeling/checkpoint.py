"""DeepSpec-format drafter checkpoints: read (DeepSpec's and ours) and write (ours), safetensors only.

Layout (DeepSpec reference §1.8, §1.10): a folder with ``config.json`` (``architectures``
``["Qwen3DSparkModel"]``, or this project's ``"LlamaDSparkModel"``/``"Qwen2DSparkModel"``, the copied
target fields and the DSpark fields of :class:`~dspark_export.modeling.config.DrafterConfig`) and
``model.safetensors`` or a sharded ``model.safetensors.index.json``. Tensor names have no prefix.
DeepSpec stores ``embed_tokens.weight`` and ``lm_head.weight`` (frozen copies of the target's);
this project's shipped drafters may omit them, and they are then taken from the target.
bf16/fp16 tensors are upcast to fp32. Pickle files (``*.bin``, ``*.pt``) are never read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dspark_export.errors import CheckpointError, ConfigError
from dspark_export.modeling._atomic import install_dir, staging_dir
from dspark_export.modeling.config import DrafterConfig
from dspark_export.modeling.drafter import SHARED_EMBEDDING_NAMES, DSparkDrafter
from dspark_export.modeling.registry import SUPPORTED_MODEL_TYPES, get_architecture
from dspark_export.modeling.target import TargetModel

__all__ = ["load_drafter", "save_drafter", "read_drafter_config", "DRAFTER_ARCHITECTURES"]

logger = logging.getLogger(__name__)

#: ``architectures[0]`` → model_type of the drafter checkpoints this package reads.
DRAFTER_ARCHITECTURES = {get_architecture(t).drafter_architecture: t for t in SUPPORTED_MODEL_TYPES}
_LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def read_drafter_config(path: str | os.PathLike[str]) -> DrafterConfig:
    """Read and validate ``<path>/config.json`` of a drafter checkpoint.

    Raises:
        CheckpointError: the folder or config.json is missing or not JSON.
        ConfigError: unknown ``architectures``, an architecture that contradicts ``model_type``, or
            an invalid field (see :meth:`DrafterConfig.from_dict`).
    """
    path = Path(path)
    data = _read_json(path / "config.json", "drafter config (DeepSpec layout)")
    architectures = data.get("architectures") or []
    arch = architectures[0] if isinstance(architectures, list) and architectures else None
    if arch not in DRAFTER_ARCHITECTURES:
        raise ConfigError(f"drafter {path}: architectures {architectures!r} is not a DSpark drafter; expected "
                          f"one of {sorted(DRAFTER_ARCHITECTURES)}")
    if DRAFTER_ARCHITECTURES[arch] != data.get("model_type"):
        raise ConfigError(f"drafter {path}: architecture {arch} expects model_type "
                          f"{DRAFTER_ARCHITECTURES[arch]!r}, found {data.get('model_type')!r}")
    return DrafterConfig.from_dict(data)


def load_drafter(path: str | os.PathLike[str], target: TargetModel) -> DSparkDrafter:
    """Load a DSpark drafter checkpoint for ``target`` (fp32, eval; embed_tokens/lm_head frozen).

    Raises:
        CheckpointError: missing files, unreadable safetensors, missing or unexpected tensors, or a
            tensor with the wrong shape or a non-float dtype (each named, expected vs found).
        ConfigError: the config is invalid or does not fit the target (hidden size, vocab size,
            model_type, target layers; both values named).
    """
    path = Path(path)
    config = read_drafter_config(path)
    config.check_target(target.config)
    drafter = DSparkDrafter(config)
    tensors = _read_tensors(path)
    state = _checked_state(path, drafter, tensors)
    shared_sources = {"embed_tokens.weight": target.model.get_input_embeddings().weight,
                      "lm_head.weight": target.model.get_output_embeddings().weight}
    for name in SHARED_EMBEDDING_NAMES:
        if name not in state:
            logger.info("drafter %s: %s not in the checkpoint; using the target's", path, name)
            state[name] = shared_sources[name].detach().to(torch.float32)
    drafter.load_state_dict(state, strict=True)
    for name in SHARED_EMBEDDING_NAMES:
        drafter.get_parameter(name).requires_grad_(False)
    logger.info("loaded %s drafter from %s (%d layers, γ=%d, r=%d)", config.model_type, path,
                config.num_hidden_layers, config.block_size, config.markov_rank)
    return drafter.eval()


def _read_json(file: Path, what: str) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointError(f"{file}: not found; expected the {what}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: expected JSON ({what}), could not parse it ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object ({what}), found {type(data).__name__}")
    return data


def _shard_files(path: Path) -> dict[str, list[str]]:
    """Shard file name → tensor names it must hold (empty list: whatever a single file holds)."""
    if (path / _INDEX).is_file():
        weight_map = _read_json(path / _INDEX, "safetensors shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{path / _INDEX}: expected a non-empty 'weight_map' object")
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise CheckpointError(f"{path / _INDEX}: shard of {name} must be a file name in {path}, found {shard!r}")
            shards.setdefault(shard, []).append(name)
        return shards
    if (path / _WEIGHTS).is_file():
        return {_WEIGHTS: []}
    pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
    found = f"only pickle files {pickles} (never loaded)" if pickles else "neither"
    raise CheckpointError(f"drafter {path}: expected {_WEIGHTS} or {_INDEX}, found {found}")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard, listed in _shard_files(path).items():
        file = path / shard
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
                for name in names:
                    if name in tensors:
                        raise CheckpointError(f"drafter {path}: tensor {name} appears in more than one shard")
                    tensors[name] = f.get_tensor(name)
        except (OSError, SafetensorError) as e:
            raise CheckpointError(f"drafter {file}: not a readable safetensors file ({e})") from e
        absent = sorted(set(listed) - set(names))
        if absent:
            raise CheckpointError(f"drafter {file}: the index lists {absent[:8]} in this shard but it lacks them")
    return tensors


def _checked_state(path: Path, drafter: DSparkDrafter, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Check names, shapes and dtypes against the drafter built from the config; upcast to fp32."""
    expected = drafter.state_dict()
    missing = sorted(n for n in expected if n not in tensors and n not in SHARED_EMBEDDING_NAMES)
    unexpected = sorted(n for n in tensors if n not in expected)
    if missing or unexpected:
        raise CheckpointError(
            f"drafter {path}: tensors do not match config.json (markov_rank={drafter.config.markov_rank}, "
            f"enable_confidence_head={drafter.config.enable_confidence_head}, "
            f"num_hidden_layers={drafter.config.num_hidden_layers}): missing {missing[:8]}, unexpected {unexpected[:8]}")
    state = {}
    for name, tensor in tensors.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"drafter {path}: tensor {name}: expected shape {list(want)}, "
                                  f"found {list(tensor.shape)}")
        if tensor.dtype not in _LOADABLE_DTYPES:
            raise CheckpointError(f"drafter {path}: tensor {name}: expected dtype float32, bfloat16 or float16, "
                                  f"found {tensor.dtype}")
        state[name] = tensor.to(torch.float32)
    return state


def save_drafter(drafter: DSparkDrafter, path: str | os.PathLike[str], *, include_embeddings: bool = True,
                 dtype: torch.dtype = torch.float32) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in DeepSpec's layout, atomically.

    The folder is written beside ``path`` and renamed into place; an existing drafter folder at
    ``path`` is replaced.

    Args:
        drafter: the drafter to save.
        path: destination folder.
        include_embeddings: store ``embed_tokens.weight`` and ``lm_head.weight`` (DeepSpec does);
            False leaves them to be taken from the target at load time.
        dtype: tensor dtype on disk: float32 (default), bfloat16 or float16.

    Returns:
        ``path`` as a Path.

    Raises:
        ConfigError: unsupported ``dtype``.
        CheckpointError: ``path`` exists and is not a drafter folder (refusing to replace it).
    """
    path = Path(path)
    if dtype not in _LOADABLE_DTYPES:
        raise ConfigError(f"save_drafter dtype: expected one of {list(_LOADABLE_DTYPES)}, found {dtype}")
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not (path / "config.json").is_file())):
        raise CheckpointError(f"save_drafter: {path} exists and is not a drafter folder; refusing to replace it")
    state = {name: t.detach().to(dtype).contiguous().clone() for name, t in drafter.state_dict().items()
             if include_embeddings or name not in SHARED_EMBEDDING_NAMES}
    config = drafter.config.to_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    staging = staging_dir(path)
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        save_file(state, str(staging / _WEIGHTS), metadata={"format": "pt"})
        install_dir(staging, path)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("saved drafter to %s (%d tensors, %s)", path, len(state), config["dtype"])
    return path
