"""``DrafterConfig``: the DSpark drafter's hyper-parameters, validated, DeepSpec-compatible.

The fields are those DeepSpec's ``build_draft_config`` writes to a drafter's ``config.json``
(DeepSpec reference §1.1): the attention/MLP shapes, norms, RoPE, vocab and ``model_type`` are
copied from the target; ``num_hidden_layers`` is the number of *drafter* layers; the DSpark extras
are ``num_target_layers``, ``target_layer_ids``, ``block_size`` (γ), ``mask_token_id``,
``markov_rank`` (r; 0 = no Markov head), ``markov_head_type``, ``enable_confidence_head`` and
``confidence_head_with_markov``, and ``num_anchors`` (training only, but DeepSpec's model asserts it).
``is_trained`` is this project's own field: False for a freshly initialised drafter
(:func:`dspark_export.modeling.drafter.init_drafter`); it is written under the ``dspark_export`` key, which
DeepSpec's loader (transformers' ``AutoConfig`` then ``Qwen3DSparkModel``) keeps as an unused attribute.

Round trip: DeepSpec's save path (``save_pretrained`` of a deep copy of the target's transformers config)
writes every key of the target config besides the DSpark ones (bos/eos/pad ids, sliding-window keys,
``attention_dropout``, ``initializer_range``, ``use_cache``, ``transformers_version``, ...). Those keys are
kept in ``extra`` when read and written back unchanged on save; a fresh drafter takes them from its target,
as ``build_draft_config`` does.

``target_layer_ids`` may start with -1: the embedding output (the input of layer 0), as DeepSpec's
``validate_target_layer_ids`` defines it (its eval reads ``hidden_states[0]`` for -1, ``hidden_states[l + 1]``
otherwise).

Dimension letters: H hidden size, V vocab, D head dim, m tapped target layers, F = m·H, r Markov rank.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from dspark_export.errors import ConfigError
from dspark_export.modeling.registry import (
    SUPPORTED_ROPE_TYPES,
    ArchitectureSpec,
    get_architecture,
    head_dim_of,
    make_hf_config,
    rope_parameters_of,
    validate_target_config,
)

__all__ = ["DrafterConfig", "default_target_layer_ids", "default_mask_token_id", "MARKOV_HEAD_TYPES"]

#: Markov head types DeepSpec defines (reference §1.6); only "vanilla" is implemented here.
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
_IMPLEMENTED_MARKOV_HEADS = ("vanilla",)

_POSITIVE_INT_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "max_position_embeddings", "num_hidden_layers", "num_target_layers", "block_size", "num_anchors",
)
_BOOL_FIELDS = ("attention_bias", "enable_confidence_head", "confidence_head_with_markov", "is_trained")
#: this project's own config.json keys, written under OWN_KEY (DeepSpec's loader ignores it)
OWN_KEY = "dspark_export"
_OWN_FIELDS = ("is_trained",)
#: keys `to_dict` writes itself (never taken from `extra`)
_DERIVED_KEYS = ("architectures", "rope_parameters", "tie_word_embeddings", "layer_types", OWN_KEY)
#: DeepSpec's default for `num_anchors` (config/dspark/*.py)
DEEPSPEC_NUM_ANCHORS = 512
_REQUIRED_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "rms_norm_eps", "vocab_size", "max_position_embeddings", "num_hidden_layers", "num_target_layers",
    "target_layer_ids", "block_size", "mask_token_id", "markov_rank", "enable_confidence_head",
)


def _fail(name: str, expected: str, found: Any) -> ConfigError:
    return ConfigError(f"DrafterConfig.{name}: expected {expected}, found {found!r}")


@dataclass(frozen=True)
class DrafterConfig:
    """DSpark drafter hyper-parameters (DeepSpec reference §1.1). Validated on construction.

    Raises:
        ConfigError: from ``__post_init__``, naming the field, what was expected and what was found.
    """

    model_type: str  #: HF model_type of the target family ("llama", "qwen2", "qwen3")
    hidden_size: int  #: H
    intermediate_size: int  #: MLP width I
    num_attention_heads: int
    num_key_value_heads: int  #: kvH
    head_dim: int  #: D
    rms_norm_eps: float
    rope_parameters: dict  #: transformers v5 rope dict: rope_theta, rope_type (+ scaling fields)
    vocab_size: int  #: V
    max_position_embeddings: int
    attention_bias: bool
    hidden_act: str  #: only "silu" (gated SiLU MLP)
    num_hidden_layers: int  #: drafter decoder layers
    num_target_layers: int  #: L of the target
    target_layer_ids: tuple  #: tapped target layers, strictly increasing, in {-1 (embeddings)} ∪ [0, L-2]
    block_size: int  #: γ: the anchor slot plus γ-1 mask slots, γ drafts
    mask_token_id: int  #: token id fed at the γ-1 non-anchor slots
    markov_rank: int  #: r; 0 = no Markov head
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    is_trained: bool = False
    num_anchors: int = DEEPSPEC_NUM_ANCHORS  #: training only: anchors sampled per sequence (DeepSpec asserts it)
    #: the other keys of the source config.json (the copied target config), written back on save
    extra: dict = field(default_factory=dict, repr=False, compare=False)
    _spec: ArchitectureSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_spec", get_architecture(self.model_type))
        object.__setattr__(self, "rope_parameters", dict(self.rope_parameters))
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        object.__setattr__(self, "extra", dict(self.extra or {}))
        self._check_scalars()
        self._check_rope()
        self._check_dspark_fields()

    def _check_scalars(self) -> None:
        for name in _POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _fail(name, "a positive int", value)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, "a bool", getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise _fail("num_key_value_heads", f"a divisor of num_attention_heads={self.num_attention_heads}",
                        self.num_key_value_heads)
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
            raise _fail("rms_norm_eps", "a positive float", eps)
        if self.hidden_act != "silu":
            raise _fail("hidden_act", "'silu' (the drafter MLP is down(silu(gate(x)) * up(x)))", self.hidden_act)

    def _check_rope(self) -> None:
        theta = self.rope_parameters.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
            raise _fail("rope_parameters['rope_theta']", "a positive number", theta)
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise _fail("rope_parameters['rope_type']", f"one of {list(SUPPORTED_ROPE_TYPES)}", rope_type)

    def _check_dspark_fields(self) -> None:
        ids, last = self.target_layer_ids, self.num_target_layers - 1
        if not ids or any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
            raise _fail("target_layer_ids", "a non-empty sequence of ints", list(ids))
        if any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1 or ids[-1] >= last:
            raise _fail("target_layer_ids", f"strictly increasing ids in {{-1}} ∪ [0, {last - 1}] (-1: the "
                        f"embedding output; the last target layer {last} is post-norm in HF hidden_states and is "
                        "never tapped)", list(ids))
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise _fail("mask_token_id", f"an int in [0, {self.vocab_size - 1}]", self.mask_token_id)
        if not isinstance(self.markov_rank, int) or isinstance(self.markov_rank, bool) or self.markov_rank < 0:
            raise _fail("markov_rank", "an int >= 0 (0 = no Markov head)", self.markov_rank)
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise _fail("markov_head_type", f"one of {list(MARKOV_HEAD_TYPES)}", self.markov_head_type)
        if self.markov_rank > 0 and self.markov_head_type not in _IMPLEMENTED_MARKOV_HEADS:
            raise _fail("markov_head_type", f"one of {list(_IMPLEMENTED_MARKOV_HEADS)} (DeepSpec's "
                        f"{self.markov_head_type!r} head is not implemented)", self.markov_head_type)

    # ----------------------------------------------------------------------------- derived values

    @property
    def spec(self) -> ArchitectureSpec:
        """The registry entry of ``model_type``."""
        return self._spec

    @property
    def architecture(self) -> str:
        """``architectures[0]`` of the checkpoint (``Qwen3DSparkModel``, ``LlamaDSparkModel``, ...)."""
        return self._spec.drafter_architecture

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters["rope_theta"])

    @property
    def num_target_features(self) -> int:
        """m, the number of tapped target layers."""
        return len(self.target_layer_ids)

    @property
    def feature_size(self) -> int:
        """F = m·H, the width of ``aux_hidden`` and the input of ``fc``."""
        return self.num_target_features * self.hidden_size

    @property
    def has_markov_head(self) -> bool:
        return self.markov_rank > 0

    @property
    def has_confidence_head(self) -> bool:
        return self.enable_confidence_head

    @property
    def confidence_input_size(self) -> int:
        """H + r when the confidence head also reads W1[prev], else H (DeepSpec reference §1.7)."""
        with_markov = self.confidence_head_with_markov and self.has_markov_head
        return self.hidden_size + (self.markov_rank if with_markov else 0)

    def check_target(self, target_config: Any) -> None:
        """Check that this drafter fits a target (an HF config); every message names both values.

        Raises:
            ConfigError: model_type, hidden_size, vocab_size or the number of target layers differ, or
                ``target_layer_ids`` leave [0, L-2] of the target (the last layer L-1 is never tapped:
                HF's last hidden state is post-norm, DeepSpec ``assert_no_final_target_layer``).
        """
        num_layers = target_config.num_hidden_layers
        ids = list(self.target_layer_ids)
        if any(not -1 <= i <= num_layers - 2 for i in ids):
            what = "includes the last target layer" if num_layers - 1 in ids else "is out of range"
            raise ConfigError(
                f"drafter target_layer_ids {ids} {what} for a target with {num_layers} layers: expected ids "
                f"in {{-1}} ∪ [0, {num_layers - 2}] (-1: the embedding output; layer {num_layers - 1} is "
                "post-norm in HF hidden_states)"
            )
        for name, mine, theirs in (
            ("model_type", self.model_type, target_config.model_type),
            ("hidden_size", self.hidden_size, target_config.hidden_size),
            ("vocab_size", self.vocab_size, target_config.vocab_size),
            ("num_target_layers", self.num_target_layers, num_layers),
        ):
            if mine != theirs:
                raise ConfigError(f"drafter {name} is {mine!r} but the target's is {theirs!r}; "
                                  "the drafter was built for a different target")

    # ----------------------------------------------------------------------------- conversions

    def replace(self, **changes: Any) -> "DrafterConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict, in DeepSpec's layout (reference §1.1, §1.10): the ``extra`` keys as read
        (or copied from the target), then the drafter fields, then this project's own keys under ``OWN_KEY``."""
        out: dict[str, Any] = {k: copy.deepcopy(v) for k, v in self.extra.items() if k not in _DERIVED_KEYS}
        out["architectures"] = [self.architecture]
        for f in dataclasses.fields(self):
            if f.init and f.name != "extra" and f.name not in _OWN_FIELDS:
                value = getattr(self, f.name)
                out[f.name] = list(value) if isinstance(value, tuple) else value
        out["rope_parameters"] = dict(self.rope_parameters)
        out["tie_word_embeddings"] = False
        out["layer_types"] = ["full_attention"] * self.num_hidden_layers
        out[OWN_KEY] = {name: getattr(self, name) for name in _OWN_FIELDS}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DrafterConfig":
        """Read a DeepSpec or dspark-export drafter ``config.json`` dict.

        Unknown keys (the rest of the copied target config) are ignored. RoPE is read from
        ``rope_parameters`` (transformers v5) or from top-level ``rope_theta`` (+ legacy
        ``rope_scaling``). Defaults for keys DeepSpec may omit: ``head_dim`` = H / heads,
        ``attention_bias`` = the family's default, ``hidden_act`` = "silu", ``markov_head_type`` =
        "vanilla", ``confidence_head_with_markov`` = True, ``num_anchors`` = 512, and ``is_trained`` = True (a
        checkpoint without the field was written by DeepSpec training). ``is_trained`` is read from ``OWN_KEY``
        (or, in older files, the top level). Every other key is kept in ``extra``.

        Raises:
            ConfigError: a required key is missing, or a value is invalid.
        """
        missing = [k for k in _REQUIRED_KEYS if k not in data]
        if missing:
            raise ConfigError(f"drafter config: missing required field(s) {missing}")
        spec = get_architecture(data["model_type"])
        names = [f.name for f in dataclasses.fields(cls) if f.init and f.name != "extra"]
        kwargs = {k: data[k] for k in names if k in data and data[k] is not None}
        own = data.get(OWN_KEY)
        if isinstance(own, Mapping):
            kwargs.update({k: own[k] for k in _OWN_FIELDS if k in own})
        kwargs["extra"] = {k: copy.deepcopy(v) for k, v in data.items() if k not in names and k not in _DERIVED_KEYS}
        kwargs["rope_parameters"] = _rope_from_dict(data)
        kwargs.setdefault("head_dim", data["hidden_size"] // data["num_attention_heads"])
        kwargs.setdefault("attention_bias", bool(spec.forced_attention_bias))
        kwargs.setdefault("hidden_act", "silu")
        kwargs.setdefault("is_trained", True)
        return cls(**kwargs)

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        num_draft_layers: int = 1,
        target_layer_ids: Sequence[int] | None = None,
        block_size: int = 7,
        mask_token_id: int | None = None,
        markov_rank: int = 64,
        markov_head_type: str = "vanilla",
        enable_confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
        eos_token_ids: Iterable[int] | None = None,
        num_anchors: int = DEEPSPEC_NUM_ANCHORS,
    ) -> "DrafterConfig":
        """A drafter config for ``target_config`` (an HF config), as DeepSpec ``build_draft_config``.

        Copies H, I, heads, kvH, D, eps, RoPE, V, max positions, attention_bias, hidden_act and
        model_type from the target, and keeps the target config's other keys in ``extra`` (DeepSpec's
        ``build_draft_config`` starts from a deep copy of it). ``target_layer_ids`` defaults to
        :func:`default_target_layer_ids`; ``mask_token_id`` to :func:`default_mask_token_id` with
        ``eos_token_ids`` (default: the config's ``eos_token_id``).

        Raises:
            ConfigError: unsupported target, or an invalid drafter field.
        """
        spec = validate_target_config(target_config)
        num_layers = target_config.num_hidden_layers
        if eos_token_ids is None:
            eos_token_ids = _as_id_list(getattr(target_config, "eos_token_id", None))
        if mask_token_id is None:
            mask_token_id = default_mask_token_id(target_config, eos_token_ids)
        ids = default_target_layer_ids(num_layers) if target_layer_ids is None else tuple(target_layer_ids)
        return cls(
            model_type=target_config.model_type, hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_attention_heads=target_config.num_attention_heads,
            num_key_value_heads=target_config.num_key_value_heads, head_dim=head_dim_of(target_config),
            rms_norm_eps=float(target_config.rms_norm_eps), rope_parameters=rope_parameters_of(target_config),
            vocab_size=target_config.vocab_size, max_position_embeddings=target_config.max_position_embeddings,
            attention_bias=spec.attention_bias(target_config), hidden_act=target_config.hidden_act,
            num_hidden_layers=num_draft_layers, num_target_layers=num_layers, target_layer_ids=ids,
            block_size=block_size, mask_token_id=mask_token_id, markov_rank=markov_rank,
            markov_head_type=markov_head_type, enable_confidence_head=enable_confidence_head,
            confidence_head_with_markov=confidence_head_with_markov, is_trained=False, num_anchors=num_anchors,
            extra=_target_extra(target_config),
        )

    def to_hf_config(self) -> Any:
        """A transformers config of the drafter's family with the drafter's attention shapes and RoPE.

        Used to compute the drafter's RoPE tables with transformers' own rope init functions.
        """
        fields = {name: getattr(self, name) for name in (
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "vocab_size", "max_position_embeddings", "num_hidden_layers", "hidden_act")}
        fields["rope_parameters"] = dict(self.rope_parameters)
        if self._spec.forced_attention_bias is None:
            fields["attention_bias"] = self.attention_bias
        return make_hf_config(self.model_type, fields)


def default_target_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """Default tapped target layers: m = min(5, L-1) ids spread evenly over [1, L-2].

    When [1, L-2] has fewer than m ids (L <= 6) all of [0, L-2] are used. The last layer L-1 is never
    tapped (DeepSpec reference §1.1, ``assert_no_final_target_layer``). Rounding is half-up, so the
    ids are strictly increasing. Example: L=30 gives (1, 8, 15, 21, 28); L=4 gives (0, 1, 2).

    Raises:
        ConfigError: L < 2.
    """
    if num_target_layers < 2:
        raise _fail("num_target_layers", "at least 2 target layers (the last one is never tapped)",
                    num_target_layers)
    count = min(5, num_target_layers - 1)
    first, last = 1, num_target_layers - 2
    if count > last - first + 1:
        return tuple(range(0, num_target_layers - 1))
    if count == 1:
        return (first,)
    step = (last - first) / (count - 1)
    return tuple(int(math.floor(first + i * step + 0.5)) for i in range(count))


def default_mask_token_id(target_config: Any, eos_token_ids: Iterable[int]) -> int:
    """Default ``mask_token_id``: the target's pad token, else its unk token, else V-1.

    A candidate is skipped when it is None, outside [0, V) or an eos/stop id (an eos embedding in the
    mask slots would look like "the answer ends here"). V-1 is usually an unused padded-vocab row,
    as DeepSpec's Qwen3 mask 151669 is (reference §1.5); it is only a default for fresh drafters,
    and checkpoints carry their own ``mask_token_id``.
    """
    vocab_size = target_config.vocab_size
    eos = set(eos_token_ids)
    for name in ("pad_token_id", "unk_token_id"):
        candidate = getattr(target_config, name, None)
        if isinstance(candidate, int) and 0 <= candidate < vocab_size and candidate not in eos:
            return candidate
    return vocab_size - 1


def _target_extra(target_config: Any) -> dict[str, Any]:
    """The target config's keys a drafter config.json carries besides its own fields (as DeepSpec's deep copy
    does): `to_dict` of the transformers config, minus private keys and the drafter's fields."""
    try:
        data = target_config.to_dict()
    except AttributeError:
        return {}
    names = {f.name for f in dataclasses.fields(DrafterConfig)}
    return {k: copy.deepcopy(v) for k, v in data.items()
            if not k.startswith("_") and k not in names and k not in _DERIVED_KEYS}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_from_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    params = data.get("rope_parameters")
    rope = dict(params) if isinstance(params, Mapping) else {}
    legacy = data.get("rope_scaling")
    if not params and isinstance(legacy, Mapping):
        rope.update(legacy)
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
    if "rope_theta" not in rope and "rope_theta" in data:
        rope["rope_theta"] = data["rope_theta"]
    if "rope_theta" not in rope:
        raise ConfigError("drafter config: expected rope_parameters.rope_theta or top-level rope_theta, found neither")
    rope.setdefault("rope_type", "default")
    return rope
