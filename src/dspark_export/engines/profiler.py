"""The throughput profile SPS(B): target steps per second per bucket of verification tokens B.

Paper §3.2.2: the scheduler maximises τ·SPS(B), with SPS "profiled once during engine
initialization and stored as a lightweight cost table". Each bucket is timed at a stated context
length with a verification-shaped batch: R = ⌈B/(γ+1)⌉ requests, each verifying up to γ+1 rows,
every row asking for logits, all requests at the same past length. Warm-up runs are discarded;
the median, p10 and p90 of the timed runs are kept. SPS(B) = 1000 / median_ms.

A table whose latency falls as B grows (beyond the p10-p90 spread) is reported in `warnings`,
not silently used.
"""

from __future__ import annotations

import math
import platform
import time
from typing import Callable

import numpy as np
import onnxruntime as ort

from .engine_set import EngineSet
from .packing import Segment, pack_segments

__all__ = ["measure_profile", "time_runner", "engine_feed"]


def time_runner(runner, feed: dict, warmup: int, repeats: int) -> dict:
    """Latency of `runner.infer(feed)` in ms: {"median_ms", "p10_ms", "p90_ms", "repeats"}."""
    for _ in range(warmup):
        runner.infer(feed)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.infer(feed)
        times.append((time.perf_counter() - t0) * 1e3)
    p10, med, p90 = np.percentile(times, [10, 50, 90])
    return {"median_ms": round(float(med), 3), "p10_ms": round(float(p10), 3), "p90_ms": round(float(p90), 3),
            "repeats": repeats}


def _kv_feed(spec: dict, num: int, capacity: int, key: str, value: str) -> dict:
    shape = (num, spec["num_kv_heads"], capacity, spec["head_dim"])
    buf = np.zeros(shape, np.float32)
    feed = {}
    for layer in range(spec["num_layers"]):
        feed[f"{key}.{layer}"], feed[f"{value}.{layer}"] = buf, buf
    return feed


def _target_feed(spec: dict, bucket: int, context_len: int, block: int) -> dict:
    width = block + 1
    num = math.ceil(bucket / width)
    sizes = [width] * (num - 1) + [bucket - width * (num - 1)]
    segments = [Segment(r, np.ones(q, np.int64), context_len) for r, q in enumerate(sizes)]
    packed = pack_segments(segments, num, np.full(num, context_len, np.int64), bucket)
    return {**packed.feed, **_kv_feed(spec, num, context_len + width, "past_key", "past_value")}


def _block_feed(spec: dict, num: int, context_len: int, block: int) -> dict:
    return {"anchor_ids": np.ones(num, np.int64), "start_positions": np.full(num, context_len, np.int64),
            "context_lens": np.full(num, context_len, np.int64),
            **_kv_feed(spec, num, context_len, "context_key", "context_value"),
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


def measure_profile(engines: EngineSet, context_len: int = 128, warmup: int = 3, repeats: int = 10,
                    progress: Callable[[str], None] | None = None) -> dict:
    """Time every target bucket (SPS table) and every drafter-block bucket.

    Args:
        engines: the engine set to profile.
        context_len: past length of every request during timing, in tokens. Defaults to 128.
        warmup: untimed runs per bucket. Defaults to 3.
        repeats: timed runs per bucket. Defaults to 10.
        progress: called with a short label before each bucket.
    Returns:
        the sps.json object (see the module docstring).
    """
    graphs = engines.manifest.data["graphs"]
    block = graphs["drafter_block"]["spec"]["block_size"]
    target, rows_t, rows_d = graphs["target"]["spec"], [], []
    for b in engines.buckets("target"):
        if progress:
            progress(f"target B={b}")
        stats = time_runner(engines.runner_exact("target", b), _target_feed(target, b, context_len, block), warmup, repeats)
        rows_t.append({"B": b, **stats, "sps": round(1000.0 / stats["median_ms"], 3)})
    for r in engines.buckets("drafter_block"):
        if progress:
            progress(f"drafter R={r}")
        feed = _block_feed(graphs["drafter_block"]["spec"], r, context_len, block)
        rows_d.append({"R": r, **time_runner(engines.runner_exact("drafter_block", r), feed, warmup, repeats)})
    return {
        "context_len": context_len, "block_size": block, "warmup": warmup, "repeats": repeats,
        "layout": "R = ceil(B/(block_size+1)) requests, each verifying up to block_size+1 rows, logits for every row",
        "device": engines.device_info() if hasattr(engines, "device_info") else
        {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
         "backend": "onnxruntime", "onnxruntime": ort.__version__, "providers": ["CPUExecutionProvider"]},
        "target": rows_t, "drafter_block": rows_d,
        "warnings": _check_monotone(rows_t, "B") + _check_monotone(rows_d, "R"),
    }
