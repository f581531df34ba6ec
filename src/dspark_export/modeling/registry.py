"""Explicit architecture registry, keyed on the Hugging Face ``model_type``.

Every target (and so every drafter, which copies its target's attention shapes) must be one of the
architectures below. There is no fuzzy name matching and no ``hasattr`` probing: an unknown
``model_type`` is a :class:`~dspark_export.errors.ConfigError` that lists the supported ones
(STYLE.md B9).

An entry says what differs between the decoder families the drafter mirrors
(DeepSpec reference §1.3, the Qwen3 drafter layer; Llama and Qwen2 are the same layer without
q/k norms):

| model_type | q/k RMSNorm per head | biased projections when ``attention_bias`` | rotary class |
| --- | --- | --- | --- |
| llama | no | q, k, v, o | ``LlamaRotaryEmbedding`` |
| qwen2 | no | q, k, v (always biased; the config has no ``attention_bias``) | ``Qwen2RotaryEmbedding`` |
| qwen3 | yes ([D] weights) | q, k, v, o | ``Qwen3RotaryEmbedding`` |

RoPE is read as ``inv_freq [D/2] float32`` and ``attention_scaling`` (a float that multiplies cos
and sin), either from a loaded model's ``model.model.rotary_emb`` buffers (:func:`read_rope`) or by
running the transformers rope init functions through the family's rotary class
(:func:`compute_rope`). Only RoPE types whose frequencies do not depend on the sequence length are
accepted (``dynamic`` and ``longrope`` rescale with the length and are rejected).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from dspark_export.errors import ConfigError

__all__ = [
    "ArchitectureSpec",
    "RopeTables",
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "get_architecture",
    "validate_target_config",
    "compute_rope",
    "read_rope",
    "head_dim_of",
    "make_hf_config",
    "rope_parameters_of",
]

logger = logging.getLogger(__name__)

#: RoPE types whose inverse frequencies are fixed at load time (transformers ``rope_type`` names).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeTables:
    """Rotary embedding tables of one model (rotate-half convention, as transformers).

    Attributes:
        inv_freq: [D/2] float32, angle per position of each frequency pair (radians).
        attention_scaling: multiplies cos and sin (1.0 except for yarn-style scaling).
    """

    inv_freq: torch.Tensor
    attention_scaling: float


@dataclass(frozen=True)
class ArchitectureSpec:
    """What the drafter and the exporter need to know about one decoder family.

    Attributes:
        model_type: the HF ``model_type`` string.
        has_qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        biased_when_attention_bias: projections that carry a bias when ``attention_bias`` is True.
        forced_attention_bias: the value of ``attention_bias`` the family always has (Qwen2 has
            biased q/k/v and no config field), or None to read the config's ``attention_bias``.
        drafter_architecture: the ``architectures[0]`` string of a drafter checkpoint of this family
            (DeepSpec writes ``Qwen3DSparkModel``; the others are this project's names).
        rotary_class: the transformers rotary embedding class of the family.
    """

    model_type: str
    has_qk_norm: bool
    biased_when_attention_bias: tuple[str, ...]
    forced_attention_bias: bool | None
    drafter_architecture: str
    rotary_class: Callable[[], type[nn.Module]]

    def attention_bias(self, config: Any) -> bool:
        """``attention_bias`` of an HF config of this family (False when the field is absent)."""
        if self.forced_attention_bias is not None:
            return self.forced_attention_bias
        return bool(getattr(config, "attention_bias", False))

    def biased_projections(self, attention_bias: bool) -> tuple[str, ...]:
        """Names among ``q_proj, k_proj, v_proj, o_proj`` that have a ``.bias`` tensor."""
        return self.biased_when_attention_bias if attention_bias else ()


def _llama_rotary() -> type[nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding


def _qwen2_rotary() -> type[nn.Module]:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    return Qwen2RotaryEmbedding


def _qwen3_rotary() -> type[nn.Module]:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    return Qwen3RotaryEmbedding


_QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")

_REGISTRY: dict[str, ArchitectureSpec] = {
    "llama": ArchitectureSpec("llama", False, _QKVO, None, "LlamaDSparkModel", _llama_rotary),
    "qwen2": ArchitectureSpec("qwen2", False, ("q_proj", "k_proj", "v_proj"), True, "Qwen2DSparkModel", _qwen2_rotary),
    "qwen3": ArchitectureSpec("qwen3", True, _QKVO, None, "Qwen3DSparkModel", _qwen3_rotary),
}

#: The ``model_type`` values this package can load, export and draft for.
SUPPORTED_MODEL_TYPES = tuple(sorted(_REGISTRY))


def get_architecture(model_type: str) -> ArchitectureSpec:
    """The registry entry of ``model_type``.

    Raises:
        ConfigError: the type is not registered; the message lists the supported types.
    """
    spec = _REGISTRY.get(model_type)
    if spec is None:
        raise ConfigError(
            f"unsupported model_type {model_type!r}: expected one of {list(SUPPORTED_MODEL_TYPES)}"
        )
    return spec


def head_dim_of(config: Any) -> int:
    """D of an HF config: ``head_dim`` when set, else hidden_size // num_attention_heads."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def validate_target_config(config: Any) -> ArchitectureSpec:
    """Check that an HF config describes a target this package supports; return its entry.

    Rejected: unknown ``model_type``, non-SiLU MLPs, MLP biases, sliding-window attention, and RoPE
    types whose frequencies change with the sequence length.

    Raises:
        ConfigError: naming the field, the value found and what is supported.
    """
    spec = get_architecture(config.model_type)
    checks = [
        ("hidden_act", getattr(config, "hidden_act", "silu"), ("silu",)),
        ("mlp_bias", bool(getattr(config, "mlp_bias", False)), (False,)),
        ("use_sliding_window", bool(getattr(config, "use_sliding_window", False)), (False,)),
        ("rope_type", rope_parameters_of(config).get("rope_type", "default"), SUPPORTED_ROPE_TYPES),
    ]
    for field, found, allowed in checks:
        if found not in allowed:
            raise ConfigError(
                f"target {config.model_type!r} config field {field}: expected one of {list(allowed)}, "
                f"found {found!r} (not supported by the drafter and the exported graphs)"
            )
    return spec


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """The RoPE parameters of an HF config as a plain dict (transformers v5 ``rope_parameters``)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, Mapping):
        raise ConfigError(
            f"target {config.model_type!r} config: expected a rope_parameters dict, found {params!r}"
        )
    return dict(params)


def make_hf_config(model_type: str, fields: Mapping[str, Any]) -> Any:
    """Build a transformers config of ``model_type`` from plain fields (``AutoConfig.for_model``)."""
    from transformers import AutoConfig

    get_architecture(model_type)
    return AutoConfig.for_model(model_type, **dict(fields))


def compute_rope(config: Any) -> RopeTables:
    """RoPE tables computed from an HF config with the family's transformers rotary class.

    The rotary class runs transformers' rope init functions (``ROPE_INIT_FUNCTIONS``), so
    ``linear``/``llama3``/``yarn`` scaling follow transformers exactly.

    Returns:
        RopeTables with ``inv_freq [D/2] float32``.

    Raises:
        ConfigError: unsupported model_type or rope type, or inv_freq is not [D/2].
    """
    spec = validate_target_config(config)
    rotary = spec.rotary_class()(config)
    return _tables_from_rotary(rotary, config)


def read_rope(model: nn.Module) -> RopeTables:
    """RoPE tables read from a loaded transformers causal LM's ``model.model.rotary_emb`` buffers.

    Raises:
        ConfigError: unsupported model_type or rope type, or inv_freq is not [D/2].
    """
    config = model.config
    validate_target_config(config)
    return _tables_from_rotary(model.model.rotary_emb, config)


def _tables_from_rotary(rotary: nn.Module, config: Any) -> RopeTables:
    inv_freq = rotary.inv_freq.detach().to(torch.float32).clone()
    expected = head_dim_of(config) // 2
    if tuple(inv_freq.shape) != (expected,):
        raise ConfigError(
            f"target {config.model_type!r} RoPE inv_freq: expected shape [{expected}] (full rotary over "
            f"head_dim {head_dim_of(config)}), found {list(inv_freq.shape)} (partial rotary is not supported)"
        )
    return RopeTables(inv_freq=inv_freq, attention_scaling=float(rotary.attention_scaling))
