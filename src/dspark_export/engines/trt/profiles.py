"""Optimization profiles of the TensorRT engines: one profile per (graph, bucket), shapes from one dim assignment.

A TensorRT engine with dynamic inputs needs, per input, a min/opt/max shape (TensorRT builder
optimization profile). Shapes that disagree across inputs (a batch of 4 for ``query_start`` and 8 for
``past_key.0``) build an engine that rejects every real feed, so the shapes here are never written per
input: each profile point (min, opt, max) is one assignment of the graph's dimension letters, and every
input's shape is its declared ONNX shape evaluated under that assignment (``R+1`` / ``R_plus_1`` → R + 1).
Inputs that share a letter therefore agree by construction, and ``check_profile`` verifies it again from
the shapes alone (the test holds every bucket of an engine directory to it).

Ranges, from what the runtime feeds each engine (docs/ARCHITECTURE.md, "Runtime"):

| graph | fixed by the bucket | free letters: min .. max (opt) |
| --- | --- | --- |
| target | N | R 1..R_max (⌈N/(γ+1)⌉); Q 1..N (min(N, γ+1)); M 1..N (N); P 1..⌈max_context+N⌉ (⌈context+γ+1⌉) |
| drafter_context | N | none |
| drafter_block | R | P 1..⌈max_context⌉ (⌈context⌉) |
| verify | R | M R..R·(γ+1) (R·(γ+1)) |

R_max is the largest request bucket (the slot count never exceeds it), P the KV buffer capacity the
runtime hands over (whole buffer, entries past ``cache_lens`` masked; ⌈x⌉: rounded up to a multiple of
KEY_CHUNK as ``exporter.quantize.aligned``, with room for the pass's query width), Q the padded query width, M the
logit rows. Our target has no key-length input: past and new keys are scored separately and joined
before the softmax, so the attention's key length (P + Q at every point, reported as ``key_len``) needs
no input of its own to agree with.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import onnx

from ...errors import BuildError
from ...exporter.quantize import aligned

__all__ = ["ShapeProfile", "profile_for", "check_profile", "eval_dim", "POINTS"]

POINTS = ("min", "opt", "max")


def eval_dim(dim: int | str, values: Mapping[str, int]) -> int:
    """The size of one declared dim under ``values``: an int, a letter, or a sum such as ``R+1`` / ``R_plus_1``.

    Raises:
        BuildError: a letter without a value.
    """
    if isinstance(dim, int):
        return dim
    total = 0
    for term in re.split(r"\+|_plus_", dim):
        term = term.strip()
        if term.isdigit():
            total += int(term)
        elif term in values:
            total += int(values[term])
        else:
            raise BuildError(f"dimension {dim!r}: no value for {term!r} (known: {sorted(values)})")
    return total


@dataclasses.dataclass(frozen=True)
class ShapeProfile:
    """The min/opt/max shapes of one engine.

    Attributes:
        graph: "target", "drafter_context", "drafter_block" or "verify".
        dim: the bucketed letter ("N" or "R"); bucket: its value.
        values: point → {letter: value} (the assignment every shape is evaluated under).
        shapes: point → {input name: shape}.
    """

    graph: str
    dim: str
    bucket: int
    values: Mapping[str, Mapping[str, int]]
    shapes: Mapping[str, Mapping[str, tuple[int, ...]]]

    def to_dict(self) -> dict:
        return {"graph": self.graph, "dim": self.dim, "bucket": self.bucket,
                "values": {p: dict(v) for p, v in self.values.items()},
                "shapes": {p: {k: list(s) for k, s in v.items()} for p, v in self.shapes.items()}}

    def polygraphy(self):
        """This profile as ``polygraphy.backend.trt.Profile`` (polygraphy imports without TensorRT)."""
        from polygraphy.backend.trt import Profile

        profile = Profile()
        for name in self.shapes["min"]:
            profile.add(name, self.shapes["min"][name], self.shapes["opt"][name], self.shapes["max"][name])
        return profile


def _declared(model: onnx.ModelProto) -> dict[str, tuple[int | str, ...]]:
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            elif d.dim_param:
                dims.append(d.dim_param)
            else:
                raise BuildError(f"input {vi.name!r} has an unnamed dynamic dimension; a profile cannot be derived")
        out[vi.name] = tuple(dims)
    return out


def _ranges(graph: str, bucket: int, *, block_size: int, max_context: int, max_requests: int,
            context_len: int) -> tuple[str, dict[str, tuple[int, int, int]]]:
    """(bucketed letter, {letter: (min, opt, max)}) for one engine."""
    g1 = block_size + 1
    if graph == "target":
        n = bucket
        return "N", {"N": (n, n, n), "R": (1, min(max_requests, math.ceil(n / g1)), max_requests),
                     "Q": (1, min(n, g1), n), "M": (1, n, n),
                     "P": (1, aligned(min(max_context, context_len + g1)), aligned(max_context + n))}
    if graph == "drafter_context":
        return "N", {"N": (bucket, bucket, bucket)}
    if graph == "drafter_block":
        return "R", {"R": (bucket, bucket, bucket), "P": (1, aligned(min(max_context, context_len)), aligned(max_context))}
    if graph == "verify":
        r = bucket
        return "R", {"R": (r, r, r), "M": (r, r * g1, r * g1)}
    raise BuildError(f"no optimization profile rule for graph {graph!r}")


def profile_for(model: onnx.ModelProto, graph: str, bucket: int, *, block_size: int, max_context: int,
                max_requests: int, context_len: int = 128, fixed: Mapping[str, int] | None = None) -> ShapeProfile:
    """The optimization profile of ``graph``'s engine for ``bucket`` (see the module docstring).

    Args:
        model: the graph (lowered or canonical: the inputs are the same), weights not needed.
        graph: its name in the engine directory.
        bucket: the engine's bucket (N for target/drafter_context, R for drafter_block/verify).
        block_size: γ; max_context: the KV capacity per request; max_requests: the largest R bucket.
        context_len: the past length the opt point is tuned for (the profiler's context).
        fixed: letters with a single value in this model (e.g. {"V": 49152}) beyond the declared ints.
    Raises:
        BuildError: an input dim whose letter has no range, or a shape that breaks ``check_profile``.
    """
    dim, ranges = _ranges(graph, bucket, block_size=block_size, max_context=max_context,
                          max_requests=max_requests, context_len=context_len)
    for letter, value in (fixed or {}).items():
        ranges.setdefault(letter, (value, value, value))
    declared = _declared(model)
    values = {p: {letter: r[i] for letter, r in ranges.items()} for i, p in enumerate(POINTS)}
    if "P" in ranges and "Q" in ranges:  # the target's attention: P past keys + up to Q new ones per request
        for p in POINTS:
            values[p]["key_len"] = values[p]["P"] + values[p]["Q"]
    shapes = {p: {name: tuple(eval_dim(d, values[p]) for d in dims) for name, dims in declared.items()}
              for p in POINTS}
    profile = ShapeProfile(graph, dim, bucket, values, shapes)
    problems = check_profile(profile, declared)
    if problems:
        raise BuildError(f"{graph} bucket {bucket}: inconsistent optimization profile: {'; '.join(problems)}")
    return profile


def check_profile(profile: ShapeProfile, declared: Mapping[str, tuple[int | str, ...]]) -> list[str]:
    """Problems of ``profile`` found from its shapes alone (empty = consistent).

    Per point: every letter reads the same size from every input axis that declares it (``R+1`` counts as
    R + 1); declared ints are kept; min <= opt <= max per axis; the bucketed letter is the bucket at every
    point; every size is >= 1 (TensorRT engines here never see empty inputs).
    """
    problems = []
    for p in POINTS:
        seen: dict[str, tuple[int, str]] = {}
        for name, dims in declared.items():
            shape = profile.shapes[p][name]
            if len(shape) != len(dims):
                problems.append(f"{p}: {name} has rank {len(shape)}, declared {len(dims)}")
                continue
            for axis, (d, size) in enumerate(zip(dims, shape)):
                if size < 1:
                    problems.append(f"{p}: {name} axis {axis} is {size}")
                if isinstance(d, int):
                    if size != d:
                        problems.append(f"{p}: {name} axis {axis} is {size}, declared {d}")
                    continue
                terms = re.split(r"\+|_plus_", d)
                letters = [t for t in terms if not t.isdigit()]
                if len(letters) != 1:
                    continue
                letter = letters[0]
                value = size - sum(int(t) for t in terms if t.isdigit())
                if letter in seen and seen[letter][0] != value:
                    problems.append(f"{p}: {letter} is {seen[letter][0]} in {seen[letter][1]} but {value} in "
                                    f"{name} axis {axis}")
                seen.setdefault(letter, (value, f"{name} axis {axis}"))
        bucketed = seen.get(profile.dim)
        if bucketed is not None and bucketed[0] != profile.bucket:
            problems.append(f"{p}: {profile.dim} is {bucketed[0]}, the engine's bucket is {profile.bucket}")
    for name in declared:
        lo, opt, hi = (profile.shapes[p][name] for p in POINTS)
        if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
            problems.append(f"{name}: min {list(lo)} <= opt {list(opt)} <= max {list(hi)} does not hold")
    return problems
