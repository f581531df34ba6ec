"""What `build` loads: the target and the drafter that fits it, resolved from CLI-level choices."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, ConfigError
from .checkpoint import load_drafter
from .config import DrafterConfig
from .drafter import DSparkDrafter, init_drafter
from .target import TargetModel, default_target_path, load_target

log = logging.getLogger(__name__)

__all__ = ["BuildInputs", "load_build_inputs", "shipped_drafter_path"]

UNTRAINED = "untrained"


@dataclass
class BuildInputs:
    """The loaded target and drafter plus provenance for the manifest."""

    target: TargetModel
    drafter: DSparkDrafter
    target_source: dict
    drafter_source: dict

    @property
    def target_model(self) -> Any:
        return self.target.model

    @property
    def rope(self) -> tuple[np.ndarray, float]:
        """(inv_freq [D/2] float32, attention_scaling) shared by target and drafter."""
        return self.drafter.inv_freq.detach().float().numpy(), float(self.drafter.attention_scaling)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.target.eos_token_ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.target.tokenizer, "chat_template", None))

    def save_tokenizer(self, path: Path) -> None:
        self.target.tokenizer.save_pretrained(str(path))


def shipped_drafter_path(target_source: str) -> Path | None:
    """The drafter this package ships for the embedded default target, if any (issue: trained drafter)."""
    root = resources.files("dspark_export") / "assets" / "drafters" / "smollm2-135m-instruct"
    path = Path(str(root))
    return path if (path / "config.json").is_file() else None


def read_calibration(folder: Path, block_size: int) -> list[float] | None:
    """STS temperatures from ``<drafter>/calibration.json`` (written by ``scripts/train_drafter.py
    calibrate``), or None when the file is absent.

    Raises:
        ConfigError: the file is unreadable, or ``confidence_temperature`` is not ``block_size``
            finite positive numbers.
    """
    path = folder / "calibration.json"
    if not path.is_file():
        return None
    try:
        temps = json.loads(path.read_text(encoding="utf-8"))["confidence_temperature"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: expected a JSON object with 'confidence_temperature' ({e!r})") from None
    ok = isinstance(temps, list) and len(temps) == block_size and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in temps)
    if not ok:
        raise ConfigError(f"{path}: confidence_temperature: expected {block_size} finite positive numbers (one per "
                          f"draft position), found {temps!r}")
    return [float(t) for t in temps]


#: the fields of a temperature-only fit kept in calibration.json's ``temperature_only`` entry
TEMPERATURE_ONLY_FIELDS = ("confidence_temperature", "ece_before", "ece_after", "mean_ece_before", "mean_ece_after",
                           "rounds", "bins")


def temperature_only(calibration: dict) -> dict | None:
    """The temperature-only STS fit of a calibration.json dict (σ(z/T), no bias; written by
    `training.calibration.fit_calibration`), or None when the file has none.

    A file without a ``temperature_only`` entry whose biases are all 0 (or absent) is itself a temperature-only
    fit; one with non-zero biases and no entry (written before `fit_calibration`) has none.
    """
    entry = calibration.get("temperature_only")
    if isinstance(entry, dict) and "confidence_temperature" in entry:
        return entry
    if not any(float(b) for b in calibration.get("confidence_bias") or []) and "confidence_temperature" in calibration:
        return {k: calibration.get(k) for k in TEMPERATURE_ONLY_FIELDS}
    return None


def read_calibration_bias(folder: Path, block_size: int) -> list[float] | None:
    """Per-position confidence biases b_k from ``<drafter>/calibration.json`` (this project's addition to
    STS, `training.calibration`), or None when the file or its ``confidence_bias`` field is absent
    (a temperature-only calibration: every b_k = 0).

    Raises:
        ConfigError: the file is unreadable, or ``confidence_bias`` is not ``block_size`` finite numbers.
    """
    path = folder / "calibration.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable calibration ({e!r})") from None
    if not isinstance(data, dict) or "confidence_bias" not in data:
        return None
    bias = data["confidence_bias"]
    ok = isinstance(bias, list) and len(bias) == block_size and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in bias)
    if not ok:
        raise ConfigError(f"{path}: confidence_bias: expected {block_size} finite numbers (one per draft position), "
                          f"found {bias!r}")
    return [float(b) for b in bias]


def load_build_inputs(target: str | None, drafter: str | None, *, block_size: int = 7, num_draft_layers: int = 1,
                      markov_rank: int = 64, seed: int = 0) -> BuildInputs:
    """Load the target (None = embedded default) and the drafter.

    Args:
        target: transformers folder or .gguf file; None = SmolLM2-135M-Instruct (fetched and converted once).
        drafter: DeepSpec-format folder, "untrained", or None (shipped drafter for the default target,
            else untrained).
        block_size, num_draft_layers, markov_rank, seed: a fresh drafter's shape and init seed.
    Raises:
        CheckpointError / ConfigError: from loading; messages name the path and the mismatch.
    """
    is_default = target is None
    target_path = default_target_path() if is_default else Path(target)
    try:
        tgt = load_target(target_path)
    except (CheckpointError, ConfigError) as e:
        hint = (f" (the cached default model may be damaged: delete {target_path} and build again)"
                if is_default else "")
        raise type(e)(f"target {target_path}: {e}{hint}" if str(target_path) not in str(e) else f"{e}{hint}") from e
    if tgt.tokenizer is None:
        raise CheckpointError(f"target {target_path}: has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                              "an engine directory needs one to encode prompts")
    target_source = {"path": str(target_path), "model_type": tgt.model_type,
                     "embedded_default": is_default, "num_layers": tgt.num_layers}
    if drafter is None:
        shipped = shipped_drafter_path(str(target_path)) if is_default else None
        drafter = str(shipped) if shipped else UNTRAINED
    if drafter == UNTRAINED:
        cfg = DrafterConfig.from_target(tgt.config, num_draft_layers=num_draft_layers, block_size=block_size,
                                        markov_rank=markov_rank, eos_token_ids=tgt.eos_token_ids)
        model = init_drafter(tgt, cfg, seed=seed)
        log.warning("drafter: untrained (fresh init, seed %d): speculative output stays exact, but few drafts "
                    "will be accepted", seed)
        source = {"kind": UNTRAINED, "seed": seed, "is_trained": False}
    else:
        try:
            model = load_drafter(drafter, tgt)
        except (CheckpointError, ConfigError) as e:
            raise type(e)(f"drafter {drafter}: {e}" if str(drafter) not in str(e) else str(e)) from e
        shipped = shipped_drafter_path(str(target_path))
        source = {"kind": "checkpoint", "path": str(drafter), "is_trained": bool(model.config.is_trained),
                  "shipped": bool(shipped and Path(drafter).resolve() == shipped.resolve())}
        calibration = read_calibration(Path(drafter), model.config.block_size)
        if calibration is not None:
            source["confidence_temperature"] = calibration
            bias = read_calibration_bias(Path(drafter), model.config.block_size)
            if bias is not None:
                source["confidence_bias"] = bias
    source.update(num_layers=model.config.num_hidden_layers, block_size=model.config.block_size,
                  markov_rank=model.config.markov_rank, target_layer_ids=list(model.config.target_layer_ids))
    return BuildInputs(tgt, model.eval(), target_source, source)
