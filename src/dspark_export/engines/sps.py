"""``profile/sps.json``, the throughput profile of an engine directory: its one reader and writer, and
``ThroughputProfile``, the typed SPS(B) table the schedulers price steps with.

The file (written by ``engines.profiler.measure_profile``; the C++ runtime reads the same format) is one
JSON object: ``target`` rows {"B", "median_ms", "p10_ms", "p90_ms", "sps", and with a layout-cost fit
"S", "Q", "P"}, ``drafter_block`` rows {"R", "median_ms", ...}, optional ``attention`` (the layout-cost
fit: ``ms_per_row_entry``, ``ms_per_slot_entry``, ``max_error_pct``, ``layouts``), and ``context_len``,
``warmup``, ``repeats``, ``layout``, ``device``, ``warnings``. Units: ms per step, SPS in steps/s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import ProfileError
from .manifest import Manifest, write_json_atomic
from .packing import padded_width

__all__ = ["SPS_PATH", "SpsFile", "ThroughputProfile", "read_sps", "profile_path", "write_sps", "encode_sps"]

SPS_PATH = "profile/sps.json"
"""Where an engine directory keeps the ONNX Runtime profile (TensorRT's: ``profile/tensorrt/sps.json``)."""


@dataclass(frozen=True)
class ThroughputProfile:
    """SPS(B): target steps per second per bucket of verification tokens B (profile/sps.json).

    SPS(B) for any B is the best SPS among the buckets ≥ B, because the runtime pads a step of B
    tokens up to the fastest engine that holds it (`EngineSet.bucket_for`; usually the smallest, but a
    measured staircase can have a larger bucket that runs faster); a B beyond the largest bucket
    cannot run and has SPS 0.

    Drafter cost (optional): where the drafter's block latency per request bucket is known
    (`draft_requests`, `draft_ms`, from sps.json's `drafter_block` rows), a step's time is the target
    pass plus the drafter block, 1/SPS(B) + d(R), and the policies maximise τ / (1/SPS(B) + d(R))
    instead of τ·SPS(B). Why: the paper's drafter is cheap next to a GPU target, so its SPS(B) is the
    step rate; on a CPU the drafter block can cost half a target pass (reports/measurement_history.md,
    "drafter cost") and deciding without it admits drafts that cost more than they return. Without drafter rows the
    formulas are the paper's, bit for bit.

    Layout cost (optional): the target graph pads every slot's query to the longest one and attends
    S × Q query rows over P key entries per slot, the KV buffer's capacity (`runtime.kv_cache.KVCache.attended`)
    (docs/ARCHITECTURE.md, target.onnx), so a
    step's latency depends on the slots S, the padded width Q and P, not on B alone. Where the profiler
    measured it (`attention_ms`, `kv_read_ms` and the layout (S_b, Q_b, P_b) each bucket was timed at),
    a profile bound to the runtime's layout with `at(S, P)` prices a step whose longest request
    verifies w - 1 drafts at

        t(B, w) = 1/SPS(b) + [c_a · (S·Q·P - S_b·Q_b·P_b) + c_kv · (S·P - S_b·P_b)] / 1000 s,

    b the bucket that runs B tokens, Q = max(w, ⌈b / S⌉) (`engines.packing.padded_width`), c_a the ms
    per padded query row per KV entry, c_kv the ms per slot per KV entry (`engines.profiler`, a least-
    squares fit over layouts). The correction never takes a step below half its profiled latency. Why:
    one slot verifying 7 drafts next to 15 decoding ones costs far more than 16 slots of 2 rows, which
    SPS(B) alone prices alike (reports/measurement_history.md, "layout cost";
    `scripts/bench_layout_cost.py` measures it).

    Exact rows (optional, `exact_rows`): where the engines run a pass's own row count rather than its bucket's
    (`EngineSet.runs_exact_rows`: ONNX Runtime's shared sessions), a B between two buckets b_i < B < b_j costs
    the latency interpolated linearly between theirs, at most the staircase's (the pass costs about linearly in
    rows: 7.0 / 7.8 / 11.9 ms for 8 / 9 / 16 rows at R = 4, reports/runtime_split/s41/).

    Args:
        buckets: bucket sizes B in tokens, strictly increasing, each ≥ 1.
        steps_per_s: SPS of each bucket in steps/s, each > 0 and finite.
        draft_requests: request buckets R of the drafter block, strictly increasing, each ≥ 1 (optional).
        draft_ms: the drafter block's latency at each of them, ms, each ≥ 0 and finite.
        attention_ms: c_a, ms per padded query row per KV entry, ≥ 0 (optional; 0 without a fit).
        kv_read_ms: c_kv, ms per slot per KV entry, ≥ 0 (optional).
        profiled_layout: (S_b, Q_b, P_b) each bucket was timed at, one per bucket, each ≥ 1 (optional).
        num_slots: S of the runtime's step, or None (then no layout cost; see `at`).
        kv_capacity: P, the key entries per slot the runtime's step attends (`KVCache.attended`), or None.
        exact_rows: price a B between buckets by interpolation (above) instead of its bucket's latency.
    Raises:
        ProfileError: empty table, unsorted or duplicate buckets, non-positive SPS, length mismatch,
            negative or non-finite layout coefficients, a layout row per bucket missing or below 1.
    """

    buckets: tuple[int, ...]
    steps_per_s: tuple[float, ...]
    draft_requests: tuple[int, ...] = ()
    draft_ms: tuple[float, ...] = ()
    attention_ms: float = 0.0
    kv_read_ms: float = 0.0
    profiled_layout: tuple[tuple[int, int, int], ...] = ()
    num_slots: int | None = None
    kv_capacity: int | None = None
    exact_rows: bool = False
    _b: np.ndarray = field(init=False, repr=False, compare=False)
    _s: np.ndarray = field(init=False, repr=False, compare=False)
    _dense: np.ndarray = field(init=False, repr=False, compare=False)
    _draft_r: np.ndarray = field(init=False, repr=False, compare=False)
    _dense_idx: np.ndarray = field(init=False, repr=False, compare=False)
    _layout: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        b = np.asarray(self.buckets, np.int64)
        s = np.asarray(self.steps_per_s, np.float64)
        if b.ndim != 1 or b.size == 0 or b.shape != s.shape:
            raise ProfileError(f"profile: expected equal, non-empty lists of buckets and SPS, found "
                               f"{len(self.buckets)} buckets and {len(self.steps_per_s)} SPS values")
        if b[0] < 1 or np.any(np.diff(b) <= 0):
            raise ProfileError(f"profile: buckets must be ≥ 1 and strictly increasing, found {list(self.buckets)}")
        if not np.all(np.isfinite(s) & (s > 0)):
            raise ProfileError(f"profile: SPS must be finite and > 0, found {list(self.steps_per_s)}")
        d_r = np.asarray(self.draft_requests, np.int64)
        d_ms = np.asarray(self.draft_ms, np.float64)
        if d_r.shape != d_ms.shape or d_r.ndim != 1 or (d_r.size and (d_r[0] < 1 or np.any(np.diff(d_r) <= 0))) \
                or not np.all(np.isfinite(d_ms) & (d_ms >= 0)):
            raise ProfileError(f"profile: drafter rows must pair strictly increasing request buckets ≥ 1 with "
                               f"finite latencies ≥ 0 ms, found {list(self.draft_requests)} and {list(self.draft_ms)}")
        object.__setattr__(self, "draft_requests", tuple(int(x) for x in d_r))
        object.__setattr__(self, "draft_ms", tuple(float(x) for x in d_ms))
        object.__setattr__(self, "buckets", tuple(int(x) for x in b))
        object.__setattr__(self, "steps_per_s", tuple(float(x) for x in s))
        # Padded lookup table: index len(b) (beyond the largest bucket) reads SPS 0.
        object.__setattr__(self, "_b", b)
        # effective SPS: the fastest bucket at or above each one (suffix maximum)
        object.__setattr__(self, "_s", np.append(np.maximum.accumulate(s[::-1])[::-1], 0.0))
        # SPS for every B = 0..max+1 (the last entry, 0, stands for every B beyond the largest bucket), so
        # the scheduler reads SPS(R..R+n) as one slice instead of a search per step.
        dense = self._s[np.searchsorted(b, np.arange(b[-1] + 2), side="left")]
        if self.exact_rows and b.size > 1:   # latency interpolated between buckets, never above the staircase
            latency = np.interp(np.arange(b[-1] + 1), b, 1.0 / s)
            dense[b[0]:-1] = np.maximum(dense[b[0]:-1], 1.0 / latency[b[0]:])
        object.__setattr__(self, "_dense", dense)
        object.__setattr__(self, "_draft_r", d_r)
        # the bucket that runs each B = 0..max+1: the fastest at or above it (index len(b) beyond the largest)
        best = np.empty(b.size + 1, np.int64)
        best[-1] = b.size
        for i in range(b.size - 1, -1, -1):
            best[i] = i if i == b.size - 1 or s[i] >= s[best[i + 1]] else best[i + 1]
        object.__setattr__(self, "_dense_idx", best[np.searchsorted(b, np.arange(b[-1] + 2), side="left")])
        layout = np.asarray(self.profiled_layout, np.int64).reshape(-1, 3) if self.profiled_layout else np.zeros((0, 3), np.int64)
        if layout.size and (layout.shape[0] != b.size or np.any(layout < 1)):
            raise ProfileError(f"profile: expected one (slots, query width, KV capacity) ≥ 1 per bucket "
                               f"({b.size}), found {self.profiled_layout!r}")
        for name in ("attention_ms", "kv_read_ms"):
            v = float(getattr(self, name))
            if not (np.isfinite(v) and v >= 0):
                raise ProfileError(f"profile: {name} must be finite and ≥ 0 ms, found {getattr(self, name)!r}")
            object.__setattr__(self, name, v)
        for name in ("num_slots", "kv_capacity"):
            v = getattr(self, name)
            if v is not None and int(v) < 1:
                raise ProfileError(f"profile: {name} must be ≥ 1 or None, found {v!r}")
        object.__setattr__(self, "profiled_layout", tuple(tuple(int(x) for x in row) for row in layout))
        object.__setattr__(self, "_layout", layout)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], use_drafter: bool = True, exact_rows: bool = False) -> "ThroughputProfile":
        """Build from the sps.json object: its `target` rows {"B", "median_ms", "p10_ms", "p90_ms", "sps"}
        and, with `use_drafter`, its `drafter_block` rows {"R", "median_ms", ...} (the drafter cost);
        `exact_rows` as the class's field.

        Raises:
            ProfileError: no `target` rows, a row without integer `B` or numeric `sps`.
        """
        rows = data.get("target") if isinstance(data, Mapping) else None
        if not rows:
            raise ProfileError("profile: expected an sps.json object with a non-empty 'target' list of rows")
        try:
            rows = sorted(rows, key=lambda row: int(row["B"]))
            pairs = [(int(row["B"]), float(row["sps"])) for row in rows]
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"profile: every 'target' row needs an integer 'B' and a numeric 'sps' ({e!r})") from e
        fit, layout = data.get("attention"), ()
        if fit is not None and not isinstance(fit, Mapping):
            raise ProfileError(f"profile: 'attention' must be an object {{'ms_per_row_entry': number, "
                               f"'ms_per_slot_entry': number, ...}}, found {type(fit).__name__}")
        if fit:
            def number(key):
                v = fit.get(key)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (np.isfinite(v) and v >= 0):
                    raise ProfileError(f"profile: attention.{key}: expected a finite number ≥ 0 (ms), found {v!r}")
                return float(v)

            def whole(row, key):
                v = row.get(key)
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                    raise ProfileError(f"profile: target row B={row['B']}: '{key}' must be an integer ≥ 1 with an "
                                       f"'attention' fit, found {v!r}")
                return int(v)

            c_a, c_kv = number("ms_per_row_entry"), number("ms_per_slot_entry")
            layout = tuple((whole(row, "S"), whole(row, "Q"), whole(row, "P")) for row in rows)
        drafts = data.get("drafter_block") or []
        try:
            dpairs = sorted((int(row["R"]), float(row["median_ms"])) for row in drafts) if use_drafter else []
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"profile: every 'drafter_block' row needs an integer 'R' and a numeric "
                               f"'median_ms' ({e!r})") from e
        extra = {"attention_ms": c_a, "kv_read_ms": c_kv, "profiled_layout": layout} if fit else {}
        return cls(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs),
                   tuple(p[0] for p in dpairs), tuple(p[1] for p in dpairs), **extra, exact_rows=exact_rows)

    def at(self, num_slots: int, kv_capacity: int) -> "ThroughputProfile":
        """This profile bound to a step layout: S slots (the rows of the KV buffer the target pass reads)
        and KV capacity P (entries per slot). The policies then price the layout cost (class docstring)
        where the profile has one; otherwise the result prices exactly as this profile does."""
        return replace(self, num_slots=int(num_slots), kv_capacity=int(kv_capacity))

    @property
    def has_layout_cost(self) -> bool:
        """Whether step latencies depend on the layout: a measured fit, and a layout bound with `at`."""
        return bool(self.profiled_layout) and self.num_slots is not None and self.kv_capacity is not None \
            and (self.attention_ms > 0 or self.kv_read_ms > 0)

    def step_seconds(self, num_tokens, widths=None) -> np.ndarray:
        """Target-pass latency of steps, s: 1/SPS(B), plus the layout correction (class docstring) where
        `has_layout_cost` and `widths` are given; inf beyond the largest bucket.

        Args:
            num_tokens: [n] int verification tokens B of each step (≥ 0).
            widths: [n] int, 1 + the longest verify length ℓ of each step (its longest segment), or None.
        Returns:
            [n] float64 seconds.
        """
        tokens = np.minimum(np.asarray(num_tokens, np.int64), self._dense_idx.size - 1)
        idx = self._dense_idx[tokens]
        runs = idx < len(self.buckets)
        i = np.minimum(idx, len(self.buckets) - 1)
        with np.errstate(divide="ignore"):
            base = np.where(runs, 1.0 / self._dense[tokens], np.inf)
        if widths is None or not self.has_layout_cost:
            return base
        S, P = self.num_slots, self.kv_capacity
        q = padded_width(np.asarray(widths, np.int64), np.asarray(self.buckets)[i], S)
        sb, qb, pb = self._layout[i].T
        corr = (self.attention_ms * (S * q * P - sb * qb * pb) + self.kv_read_ms * (S * P - sb * pb)) / 1000.0
        return np.where(runs, np.maximum(base + corr, 0.5 * base), np.inf)

    @property
    def has_draft_cost(self) -> bool:
        """Whether the drafter block's latency is known (the policies then count it in the step time)."""
        return bool(self.draft_requests)

    def draft_seconds(self, num_requests: int) -> float:
        """d(R): the drafter block's latency for R requests, s (the smallest drafter bucket ≥ R; the
        largest one beyond it; 0 without drafter rows)."""
        if not self.draft_requests:
            return 0.0
        i = min(int(np.searchsorted(self._draft_r, num_requests, side="left")), len(self.draft_ms) - 1)
        return self.draft_ms[i] / 1000.0

    @property
    def max_tokens(self) -> int:
        """The largest bucket: the most verification tokens one step can hold."""
        return self.buckets[-1]

    def sps(self, num_tokens):
        """SPS(B): the fastest bucket's at or above B, or with `exact_rows` the interpolated rate (class
        docstring); 0 beyond the largest bucket.

        Args:
            num_tokens: int or [n] int array of verification tokens B.
        Returns:
            float, or [n] float64 array, in steps/s.
        """
        out = self._dense[np.clip(np.asarray(num_tokens, np.int64), 0, self._dense.size - 1)]
        return float(out) if np.ndim(out) == 0 else out

    def sps_range(self, first: int, count: int) -> np.ndarray:
        """[count] float64: SPS(first), SPS(first + 1), ..., SPS(first + count - 1); first ≥ 0."""
        out = self._dense[first:first + count]
        if out.size < count:                                  # past the largest bucket: SPS 0
            out = np.concatenate((out, np.zeros(count - out.size)))
        return out


@dataclass(frozen=True)
class SpsFile:
    """One read sps.json: the JSON object exactly as written (``data``, so unknown keys survive a
    round trip) and typed views of its sections.

    Attributes:
        path: the file it was read from (every error names it).
        data: the JSON object.
    """

    path: Path
    data: dict

    def _rows(self, section: str, key: str) -> list[dict]:
        rows = self.data.get(section)
        if rows is None and section == "drafter_block":
            return []
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ProfileError(f"{self.path}: profile: expected '{section}' to be a list of row objects, "
                               f"found {type(rows).__name__}")
        try:
            return sorted(rows, key=lambda r: int(r[key]))
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{self.path}: profile: every '{section}' row needs an integer '{key}' ({e!r})") from None

    @property
    def target(self) -> list[dict]:
        """The target rows, sorted by B (raises ProfileError without a list of rows with integer B)."""
        return self._rows("target", "B")

    @property
    def drafter_block(self) -> list[dict]:
        """The drafter-block rows, sorted by R ([] when the file has none)."""
        return self._rows("drafter_block", "R")

    @property
    def device(self) -> dict:
        return self.data.get("device", {})

    @property
    def warnings(self) -> list:
        return list(self.data.get("warnings", []))

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level field as written (``context_len``, ``warmup``, ``repeats``, ``layout``, ``attention``)."""
        return self.data.get(key, default)

    def latencies_ms(self) -> dict[str, dict[int, float]]:
        """{"target": {B: median ms}, "drafter_block": {R: median ms}}; both sections are required.

        Raises:
            ProfileError: a missing section, or a row without integer B / R or numeric ``median_ms``.
        """
        try:
            return {"target": {int(r["B"]): float(r["median_ms"]) for r in self.data["target"]},
                    "drafter_block": {int(r["R"]): float(r["median_ms"]) for r in self.data["drafter_block"]}}
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{self.path}: unreadable throughput profile ({e!r})") from e

    def throughput(self, use_drafter: bool = True, exact_rows: bool = False) -> ThroughputProfile:
        """The SPS(B) table (``ThroughputProfile.from_json``); errors name this file."""
        try:
            return ThroughputProfile.from_json(self.data, use_drafter, exact_rows)
        except ProfileError as e:
            raise ProfileError(f"{self.path}: {e}") from e


def read_sps(path: str | Path) -> SpsFile:
    """Read an sps.json file.

    Raises:
        ProfileError: the file is missing or unreadable, not JSON, or not a JSON object (names ``path``).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProfileError(f"{path}: profile: not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: profile: expected a JSON object, found {type(data).__name__}")
    return SpsFile(path, data)


def profile_path(manifest: Manifest) -> Path | None:
    """The profile a manifest records (``profile.path``, inside the directory), or None when it records none."""
    rel = (manifest.data.get("profile") or {}).get("path")
    return manifest.path_of(rel, "profile.path") if rel else None


def encode_sps(data: Mapping[str, Any]) -> bytes:
    """The bytes of an sps.json file holding ``data`` (2-space indent, trailing newline)."""
    return (json.dumps(data, indent=2) + "\n").encode()


def write_sps(path: str | Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically, in the bytes ``encode_sps`` gives."""
    write_json_atomic(Path(path), dict(data))
