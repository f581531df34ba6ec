"""The throughput profile SPS(B): target steps per second per bucket of verification tokens B.

Paper §3.2.2: the scheduler maximises τ·SPS(B), with SPS "profiled once during engine
initialization and stored as a lightweight cost table". Each bucket is timed at a stated context
length with a verification-shaped batch: R = ⌈B/(γ+1)⌉ requests, each verifying up to γ+1 rows,
every row asking for logits, all requests at the same past length. Every target and drafter-block bucket
is timed round-robin (`time_interleaved`: target B, drafter R, target B', ...), so load that drifts during
the profile moves all of them alike and each pass follows another engine's as in the loop. Warm-up runs
are discarded; the median, p10 and p90 of the timed runs are kept. SPS(B) = 1000 / median_ms.

A table whose latency falls as B grows (beyond the p10-p90 spread) is reported in `warnings`,
not silently used.

SPS(B) alone misprices steps whose layout differs from the profiled one: the target graph pads every
slot's query to the longest one and attends S × Q query rows over the whole KV buffer of capacity P.
So each target row also records the layout it was timed at (S slots, padded query width Q, KV capacity
P), and `measure_layout_cost` fits, by least squares over a few layouts at two capacities,

    t = T(N) + c_a · S·Q·P + c_kv · S·P      (ms; T(N) one free term per bucket N),

stored as sps.json's `attention` section: `ms_per_row_entry` (c_a), `ms_per_slot_entry` (c_kv), the
layouts with their measured and fitted latencies, and the largest relative error of the fit.
`engines.sps.ThroughputProfile` prices a step's layout with it.
"""

from __future__ import annotations

import itertools
import math
import platform
import time
from typing import Callable

import numpy as np
import onnxruntime as ort

from ..exporter.quantize import KEY_CHUNK, aligned
from ..plugins import cpu_ops
from .engine_set import EngineSet
from .packing import Segment, pack_segments

__all__ = ["measure_profile", "measure_layout_cost", "fit_layout_cost", "time_runner", "time_interleaved", "engine_feed"]

_FIT_WARN = 0.25   # a layout fit whose largest relative error exceeds this is reported in `warnings`


def time_runner(runner, feed: dict, warmup: int, repeats: int, budget_ms: float | None = None) -> dict:
    """Latency of `runner.infer(feed)` in ms: {"median_ms", "p10_ms", "p90_ms", "repeats"}.

    With `budget_ms`, a slow pass is timed fewer times (timeit's autorange idea): one warm-up always, the
    others while the warm-ups took under a quarter of the budget; then at least min(3, repeats) timed runs,
    more until `repeats` or until the timed runs add up to the budget. "repeats" is the count timed.
    """
    return time_interleaved({0: (runner, feed)}, warmup, repeats, budget_ms)[0]


def time_interleaved(items: dict, warmup: int, repeats: int, budget_ms: float | None = None) -> dict:
    """`time_runner` for several engines at once, timed round-robin: {key: stats} for items {key: (runner, feed)}.

    Each round runs every item that still wants runs once, in the order given (warm-ups first, then the
    timed runs), each item with `time_runner`'s counts and budget. Why round-robin: a change in machine
    load during the profile then falls on every bucket alike instead of on whichever was being timed, so the
    ratios the scheduler reads (t(B)/t(1), drafter block / target step) hold when the level drifts; and each
    pass runs after another engine's, as in the speculative loop (target, drafter, target, ...), with its
    caches cold and the previous session's threads still spinning, not after a copy of itself.
    """
    spent = {k: 0.0 for k in items}
    times: dict = {k: [] for k in items}

    def run(key) -> float:
        runner, feed = items[key]
        t0 = time.perf_counter()
        runner.infer(feed)
        return (time.perf_counter() - t0) * 1e3

    for i in range(max(1, warmup) if warmup else 0):
        for key in items:
            if budget_ms is None or not i or spent[key] < budget_ms / 4:
                spent[key] += run(key)

    def wants(key) -> bool:
        done = times[key]
        return len(done) < repeats and (budget_ms is None or len(done) < min(3, repeats) or sum(done) < budget_ms)

    while active := [k for k in items if wants(k)]:
        for key in active:
            times[key].append(run(key))
    out = {}
    for key, done in times.items():
        p10, med, p90 = np.percentile(done, [10, 50, 90])
        out[key] = {"median_ms": round(float(med), 3), "p10_ms": round(float(p10), 3),
                    "p90_ms": round(float(p90), 3), "repeats": len(done)}
    return out


def _kv_feed(spec: dict, num: int, capacity: int, key: str, value: str, pool: dict | None = None) -> dict:
    """One written buffer per layer and per K/V, as the runtime's cache holds them. Why not one shared
    zero buffer: pages np.zeros never wrote all map the same physical zero page, and one buffer for every
    layer stays in the CPU caches, so both time the attention reads too fast (reports/measurement_history.md,
    "profiler KV buffers").

    `pool` (a dict kept by the caller): feeds of the same capacity share their buffers, each taking the first
    `num` slots of the largest (a contiguous view), so the feeds that `time_interleaved` holds at once cost
    the memory of the largest alone; build the largest first.
    """
    shape = (num, spec["num_kv_heads"], capacity, spec["head_dim"])
    feed = {}
    for layer in range(spec["num_layers"]):
        for name in (f"{key}.{layer}", f"{value}.{layer}"):
            buffer = None if pool is None else pool.get((name, capacity))
            if buffer is None or buffer.shape[0] < num:
                buffer = np.full(shape, 0.01, np.float32)
                if pool is not None:
                    pool[(name, capacity)] = buffer
            feed[name] = buffer[:num]
    return feed


def _target_feed(spec: dict, bucket: int, context_len: int, block: int, pool: dict | None = None) -> dict:
    width = block + 1
    num = math.ceil(bucket / width)
    sizes = [width] * (num - 1) + [bucket - width * (num - 1)]
    return _layout_feed(spec, sizes, num, context_len + width, context_len, bucket, pool)


def _layout_feed(spec: dict, sizes: list[int], num_slots: int, capacity: int, context_len: int, bucket: int,
                 pool: dict | None = None) -> dict:
    """Segments of `sizes` rows in the first slots of `num_slots`, each at past length `context_len`, over
    written KV buffers (`_kv_feed`, sharing `pool`) of `capacity` entries per slot (grown as the runtime's
    cache grows: `quantize.aligned`, room for the padded query width), packed into `bucket` rows."""
    segments = [Segment(r, np.ones(q, np.int64), context_len) for r, q in enumerate(sizes)]
    packed = pack_segments(segments, num_slots, np.full(num_slots, context_len, np.int64), bucket)
    capacity = aligned(max(capacity, context_len + packed.feed["pad_index"].shape[1]))
    return {**packed.feed, **_kv_feed(spec, num_slots, capacity, "past_key", "past_value", pool)}


def _layout_of(feed: dict, spec: dict) -> dict:
    """{"S", "Q", "P"} of a target feed: slots, padded query width, key entries attended per slot (the KV
    capacity)."""
    s, q = feed["pad_index"].shape
    return {"S": int(s), "Q": int(q), "P": int(feed["past_key.0"].shape[2])}


def _block_feed(spec: dict, num: int, context_len: int, block: int, pool: dict | None = None) -> dict:
    return {"anchor_ids": np.ones(num, np.int64), "start_positions": np.full(num, context_len, np.int64),
            "context_lens": np.full(num, context_len, np.int64),
            **_kv_feed(spec, num, context_len, "context_key", "context_value", pool),
            "temperature": np.zeros(num, np.float32), "top_k": np.zeros(num, np.int64),
            "top_p": np.ones(num, np.float32), "uniforms": np.full((num, block), 0.5, np.float32),
            "confidence_temperature": np.ones(block, np.float32)}


def engine_feed(graphs: dict, graph: str, bucket: int, context_len: int, seed: int = 0) -> dict:
    """A feed for `graph`'s engine of `bucket`, shaped as the runtime shapes it (the profiler's layouts).

    target: a verification batch (see the module docstring); drafter_block: R requests at `context_len`;
    drafter_context: N random feature rows; verify: R requests verifying γ drafts each against random
    logits, greedy. `graphs` is the manifest's `graphs` section. Values are seeded (`seed`).
    """
    block = graphs["drafter_block"]["spec"]["block_size"]
    rng = np.random.default_rng(seed)
    if graph == "target":
        feed = _target_feed(graphs["target"]["spec"], bucket, context_len, block)
        vocab = graphs["target"]["spec"]["vocab_size"]
        feed["input_ids"] = rng.integers(0, vocab, feed["input_ids"].shape).astype(np.int64)
        for name in feed:
            if name.startswith("past_"):
                feed[name] = rng.normal(0, 1, feed[name].shape).astype(np.float32)
        return feed
    if graph == "drafter_block":
        feed = _block_feed(graphs["drafter_block"]["spec"], bucket, context_len, block)
        for name in feed:
            if name.startswith(("context_key.", "context_value.")):   # not context_lens
                feed[name] = rng.normal(0, 1, feed[name].shape).astype(np.float32)
        return feed
    if graph == "drafter_context":
        spec = graphs["drafter_block"]["spec"]
        return {"aux_hidden": rng.normal(0, 1, (bucket, spec["feature_size"])).astype(np.float32),
                "position_ids": (context_len + np.arange(bucket)).astype(np.int64)}
    if graph == "verify":
        vocab = graphs["target"]["spec"]["vocab_size"]
        lens = np.full(bucket, block, np.int64)
        return {"target_logits": rng.normal(0, 2, (bucket * (block + 1), vocab)).astype(np.float32),
                "query_start": (np.arange(bucket + 1) * (block + 1)).astype(np.int64),
                "draft_ids": rng.integers(0, vocab, (bucket, block)).astype(np.int64),
                "draft_logits": rng.normal(0, 2, (bucket, block, vocab)).astype(np.float32),
                "verify_lens": lens, "temperature": np.zeros(bucket, np.float32), "top_k": np.zeros(bucket, np.int64),
                "top_p": np.ones(bucket, np.float32), "uniforms": rng.random((bucket, block + 1), dtype=np.float32)}
    raise ValueError(f"engine_feed: unknown graph {graph!r}")


def _check_monotone(rows: list[dict], dim: str) -> list[str]:
    """Latency should not fall as the bucket grows; flag drops beyond the spread."""
    warnings = []
    for prev, cur in zip(rows, rows[1:]):
        if cur["p90_ms"] < prev["p10_ms"]:
            warnings.append(f"non-monotone: {dim}={cur[dim]} ran faster ({cur['median_ms']} ms) than "
                            f"{dim}={prev[dim]} ({prev['median_ms']} ms) beyond the p10-p90 spread")
    if len(rows) > 2 and rows[-1]["median_ms"] <= rows[0]["p90_ms"]:
        warnings.append(f"flat: the largest bucket is no slower than the smallest; the table carries no signal")
    return warnings


def measure_layout_cost(engines: EngineSet, context_len: int = 128, warmup: int = 2, repeats: int = 6,
                        progress: Callable[[str], None] | None = None, budget_ms: float | None = None) -> dict:
    """Fit what padded attention costs on the target engines (module docstring): c_a and c_kv.

    Layouts (w = γ + 1 rows per verification, S_max = the most slots a step can have): one slot of w
    rows; S_max slots of 1 row; S_max slots of which two verify w rows; 2 slots of w rows; each at KV
    capacity P1 = context_len + w and P2 = min(max(4 · P1, 1024), max_context), both rounded up to KEY_CHUNK
    as the runtime's cache is (P2 at least P1 + KEY_CHUNK), at past length P - w. Why P2 ≥ 1024: the cost per entry grows past the caches' reach (SmolLM2: a fit up to P = 544 predicted
    the P = 1,024 layouts up to 33 % low, `scripts/bench_layout_cost.py`). Layouts that
    do not fit the largest bucket are left out. A target whose attention is dspark.cpu::RaggedAttention (it reads
    only the live cache entries, so padded slots and capacity cost nothing) gets no layouts and a zero fit, with
    `live_entries_only` true. Negative coefficients (noise on a model whose attention
    costs nothing measurable) are set to 0 after the fit. Where the layouts cannot identify both
    coefficients (one capacity only), both are 0, `underdetermined` is true and `fit_ms` is None.
    `measure_profile` runs it with min(warmup, 2) warm-up and max(3, repeats // 2) timed runs.

    Args:
        engines: the engine set.
        context_len: as `measure_profile`.
        warmup: untimed runs per layout. Defaults to 2.
        repeats: timed runs per layout. Defaults to 6.
        progress: called with a short label before the layouts are timed.
        budget_ms: `time_runner`'s time budget per layout (None: always `repeats`).
    Returns:
        {"ms_per_row_entry", "ms_per_slot_entry", "max_error_pct", "layouts": [{"S", "Q", "P", "N", "rows",
        "median_ms", "p10_ms", "p90_ms", "repeats", "fit_ms"}], "underdetermined" and "live_entries_only" (only
        when true)}.
    """
    graphs, runtime = engines.manifest.data["graphs"], engines.manifest.runtime
    if cpu_ops.manifest_key(cpu_ops.RAGGED_ATTENTION) in engines.manifest.data.get("plugins", {}):
        # the attention reads each request's live entries only: padding a layout costs nothing, SPS(B) prices it
        return {"ms_per_row_entry": 0.0, "ms_per_slot_entry": 0.0, "max_error_pct": 0.0, "layouts": [],
                "live_entries_only": True}
    spec, w = graphs["target"]["spec"], graphs["drafter_block"]["spec"]["block_size"] + 1
    buckets = engines.buckets("target")
    s_max = max(1, min(engines.buckets("drafter_block")[-1], buckets[-1] // w))
    shapes = [(1, [w]), (s_max, [1] * s_max), (s_max, [w, w]), (2, [w, w])]
    p1 = aligned(context_len + w)
    capacities = [p1, max(p1 + KEY_CHUNK, aligned(min(max(4 * p1, 1024), int(runtime["max_context"]))))]
    layouts = [(cap, num, sizes) for cap in capacities for num, sizes in shapes
               if num >= len(sizes) and sum(sizes) <= buckets[-1]]
    rows, items, pool = [None] * len(layouts), {}, {}
    for i in sorted(range(len(layouts)), key=lambda i: -layouts[i][1]):  # the most slots first (`_kv_feed`)
        cap, num, sizes = layouts[i]
        n = next(b for b in buckets if b >= sum(sizes))
        feed = _layout_feed(spec, sizes, num, cap, cap - w, n, pool)
        items[i] = (engines.runner_exact("target", n), feed)
        rows[i] = {**_layout_of(feed, spec), "N": n, "rows": sum(sizes)}
    items = dict(sorted(items.items()))
    if progress and rows:
        progress(f"attention: {len(rows)} layouts at P = {', '.join(str(c) for c in capacities)}, interleaved")
    for i, stats in time_interleaved(items, warmup, repeats, budget_ms).items():
        rows[i].update(stats)
    if not rows:
        return {"ms_per_row_entry": 0.0, "ms_per_slot_entry": 0.0, "max_error_pct": 0.0, "layouts": []}
    fit, fitted = fit_layout_cost(rows)
    for r, f in zip(rows, fitted):
        r["fit_ms"] = f
    return {**fit, "layouts": rows}


def fit_layout_cost(layouts: list[dict], latency_key: str = "median_ms") -> tuple[dict, list[float | None]]:
    """Least squares of t = T(N) + c_a·S·Q·P + c_kv·S·P (ms; one free T per bucket N) over timed layouts.

    Args:
        layouts: non-empty rows with integer "S", "Q", "P", "N" and the latency in ms under `latency_key`.
        latency_key: the row field holding the measured latency. Defaults to "median_ms".
    Returns:
        ({"ms_per_row_entry": c_a, "ms_per_slot_entry": c_kv, "max_error_pct"}, the fitted ms per row).
        Negative coefficients are set to 0 after the fit. Where the rows cannot identify both (e.g. one
        capacity only), both are 0, the dict also has "underdetermined": True and the fitted values are None.
    """
    ns = sorted({r["N"] for r in layouts})
    x = np.array([[float(r["N"] == n) for n in ns] + [r["S"] * r["Q"] * r["P"], r["S"] * r["P"]] for r in layouts])
    y = np.array([r[latency_key] for r in layouts])
    if np.linalg.matrix_rank(x) < x.shape[1]:
        return ({"ms_per_row_entry": 0.0, "ms_per_slot_entry": 0.0, "max_error_pct": 0.0, "underdetermined": True},
                [None] * len(layouts))
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    coef[-2:] = np.maximum(coef[-2:], 0.0)
    fit = x @ coef
    return ({"ms_per_row_entry": float(coef[-2]), "ms_per_slot_entry": float(coef[-1]),
             "max_error_pct": round(float(np.max(np.abs(fit / y - 1.0))) * 100, 2)},
            [round(float(f), 3) for f in fit])


def measure_profile(engines: EngineSet, context_len: int = 128, warmup: int = 3, repeats: int = 10,
                    progress: Callable[[str], None] | None = None, budget_ms: float | None = 1000.0) -> dict:
    """Time every target bucket (SPS table) and every drafter-block bucket.

    Args:
        engines: the engine set to profile.
        context_len: past length of every request during timing, in tokens. Defaults to 128.
        warmup: untimed runs per bucket. Defaults to 3.
        repeats: timed runs per bucket. Defaults to 10.
        progress: called with a short label before each timing phase (buckets, then layouts).
        budget_ms: time budget per bucket and per layout (`time_interleaved`): the large buckets, whose passes
            are long and steady, get fewer timed runs. Defaults to 1000 ms; None: always `repeats`.
    Returns:
        the sps.json object (see the module docstring).
    """
    graphs = engines.manifest.data["graphs"]
    block = graphs["drafter_block"]["spec"]["block_size"]
    target = graphs["target"]["spec"]
    items, layouts, pool = {}, {}, {}
    for b in sorted(engines.buckets("target"), reverse=True):  # the largest first (`_kv_feed`)
        items[("target", b)] = (engines.runner_exact("target", b), _target_feed(target, b, context_len, block, pool))
        layouts[b] = _layout_of(items[("target", b)][1], target)
    for r in sorted(engines.buckets("drafter_block"), reverse=True):
        items[("drafter_block", r)] = (engines.runner_exact("drafter_block", r),
                                       _block_feed(graphs["drafter_block"]["spec"], r, context_len, block, pool))
    rows_t = [{"B": b, **layouts[b]} for b in engines.buckets("target")]
    rows_d = [{"R": r} for r in engines.buckets("drafter_block")]
    # loop order: target B, drafter R, target B', drafter R', ... then the larger target buckets
    order = [k for pair in itertools.zip_longest([("target", r["B"]) for r in rows_t],
                                                 [("drafter_block", r["R"]) for r in rows_d]) for k in pair if k]
    if progress:
        progress(f"target B = {', '.join(str(r['B']) for r in rows_t)} and drafter R = "
                 f"{', '.join(str(r['R']) for r in rows_d)}, interleaved")
    stats = time_interleaved({k: items[k] for k in order}, warmup, repeats, budget_ms)
    for row in rows_t:
        s = stats[("target", row["B"])]
        row.update({**s, "sps": round(1000.0 / s["median_ms"], 3)})
        row.update({k: row.pop(k) for k in ("S", "Q", "P")})  # keep the field order of earlier files
    for row in rows_d:
        row.update(stats[("drafter_block", row["R"])])
    del items, pool   # free these feeds' KV buffers before the layouts allocate theirs
    attention = measure_layout_cost(engines, context_len, min(warmup, 2), max(3, repeats // 2), progress=progress,
                                    budget_ms=budget_ms)
    fit_warn = [f"attention: the layout fit is off by up to {attention['max_error_pct']} % on the measured layouts"] \
        if attention["max_error_pct"] > 100 * _FIT_WARN else []
    if attention.get("underdetermined"):
        fit_warn.append("attention: the timed layouts cannot separate c_a from c_kv (one KV capacity fits: "
                        "context_len + block_size + 1 reaches max_context); no layout cost is used")
    return {
        "context_len": context_len, "block_size": block, "warmup": warmup, "repeats": repeats,
        "layout": "R = ceil(B/(block_size+1)) requests, each verifying up to block_size+1 rows, logits for every row",
        "device": engines.device_info() if hasattr(engines, "device_info") else
        {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
         "backend": "onnxruntime", "onnxruntime": ort.__version__, "providers": ["CPUExecutionProvider"]},
        "target": rows_t, "drafter_block": rows_d, "attention": attention,
        "warnings": _check_monotone(rows_t, "B") + _check_monotone(rows_d, "R") + fit_warn,
    }
