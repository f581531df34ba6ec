"""Requests, sampling parameters, results and per-request statistics."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import RequestError

__all__ = ["SamplingParams", "RequestStats", "GenerationResult", "MAX_NEW_TOKENS_LIMIT", "GREEDY_BELOW"]

MAX_NEW_TOKENS_LIMIT = 1 << 20
#: temperatures in (0, GREEDY_BELOW) decode greedily: logits / T overflows float32 long before T reaches 0
#: (vLLM treats T < 1e-5 the same way)
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings.

    Attributes:
        max_new_tokens: generated tokens at most (exactly this many unless a stop id comes first).
        temperature: 0 = greedy (as is any T < GREEDY_BELOW = 1e-5); otherwise softmax(logits / temperature).
        top_k: keep the k most likely tokens; 0 = off.
        top_p: nucleus mass in (0, 1]; 1 = off.
        seed: seeds this request's uniforms (np.random.default_rng(seed)): the same seed, prompt and
            parameters give the same output alone and under ar, fixed:K and threshold:C in any batch. dspark and
            dspark-async choose verification lengths over the whole batch, and how many uniforms a step uses
            follows them, so there a sampled request's text depends on its batch-mates (its distribution
            does not); None = random.
        stop_token_ids: extra stop ids on top of the engine's EOS ids (a list or other iterable becomes a tuple).
        stop: stop strings. The request ends at the first committed token whose decoded output
            contains one (checked token by token, also inside an accepted block); `token_ids` keep
            that token, `text` ends before the stop string (as vLLM / the OpenAI API). Needs a
            tokenizer (`Runtime`, or `Generator(detokenize=...)`). A list or other iterable becomes a tuple.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        # lists (as vLLM and the OpenAI API take them) and other iterables become tuples; a string, or a
        # value that is not iterable, is left for `validate` to name
        for name in ("stop_token_ids", "stop"):
            value = getattr(self, name)
            if isinstance(value, Iterable) and not isinstance(value, (str, bytes, tuple)):
                object.__setattr__(self, name, tuple(value))

    def validate(self) -> None:
        """Raises RequestError naming the bad field, expected vs found."""
        if not isinstance(self.max_new_tokens, (int, np.integer)) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise RequestError(f"max_new_tokens: expected an integer in [1, {MAX_NEW_TOKENS_LIMIT}], "
                               f"found {self.max_new_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float, np.number)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature: expected a finite value >= 0, found {self.temperature!r}")
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise RequestError(f"top_k: expected an integer >= 0 (0 = off), found {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, (int, np.integer)) or self.seed < 0):
            raise RequestError(f"seed: expected an integer >= 0 or None, found {self.seed!r}")
        if not isinstance(self.top_p, (int, float, np.floating)) or not (0 < self.top_p <= 1):
            raise RequestError(f"top_p: expected a value in (0, 1], found {self.top_p!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or \
                not all(isinstance(t, (int, np.integer)) and t >= 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids: expected a tuple of token ids >= 0, found {self.stop_token_ids!r}")
        if isinstance(self.stop, (str, bytes)) or not all(isinstance(t, str) and t for t in self.stop):
            raise RequestError(f"stop: expected a tuple of non-empty strings, found {self.stop!r}")


@dataclass
class RequestStats:
    """Counters of one request. `acceptance_length` is τ: mean tokens committed per verification
    round, the bonus/recovered token included (DeepSpec spec §4.1)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    rounds: int = 0
    committed_in_rounds: int = 0
    draft_tokens: int = 0        # drafts sent to verification
    accepted_tokens: int = 0     # drafts accepted
    wall_s: float = 0.0
    #: per draft position j: rounds that verified position j with drafts 0..j-1 accepted ("reached"),
    #: and rounds whose draft j was accepted. Conditional acceptance at j = accepted[j] / reached[j]
    #: (paper Fig. 2); vLLM's num_accepted_tokens_per_pos is `accepted_per_position`.
    reached_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def observe_round(self, verify_len: int, num_accepted: int) -> None:
        """Record one verification round's per-position outcome."""
        reached = min(verify_len, num_accepted + 1)
        need = max(verify_len, len(self.reached_per_position))
        self.reached_per_position += [0] * (need - len(self.reached_per_position))
        self.accepted_per_position += [0] * (need - len(self.accepted_per_position))
        for j in range(reached):
            self.reached_per_position[j] += 1
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_length(self) -> float:
        return self.committed_in_rounds / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_length=round(self.acceptance_length, 4), tokens_per_s=round(self.tokens_per_s, 3),
                 wall_s=round(self.wall_s, 4))
        return d


@dataclass
class GenerationResult:
    """Outcome of one request: generated ids only (stop token included when it ended the request)."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None   # None while running; "stop" | "length" | "capacity" | "error" | "cancelled"
    error: str | None = None
    stop_reason: int | str | None = None  # the stop id or stop string that ended the request ("stop")
    stats: RequestStats = field(default_factory=RequestStats)
    text: str | None = None
