#!/usr/bin/env python
"""Bounded soak test: many mixed requests through continuous batching on one engine directory.

    python scripts/soak.py --engine-dir /tmp/eng/dspark --requests 300 --min-new 8 --max-new 48

Requests mix prompt lengths (1 token up to --max-prompt tokens of the eval prompts, chat template
applied), max_new_tokens (uniform in [--min-new, --max-new]), sampling (greedy, T 0.7 / top-k 50 /
top-p 0.9, T 1.0) and policies (one continuously batched `Generator` per policy, all in this process,
stepped in turn; new requests arrive while others run, at most --in-flight at a time). A few
requests are invalid on purpose (every --bad-every-th: empty prompt, negative temperature, prompt
over the capacity) and a few are cancelled mid-stream (every --cancel-every-th, after 3 tokens).

Checks, all reported (exit status 1 if any fails):
  * every request finished: "length"/"stop"/"capacity", or "error"/"cancelled" with a reason, and
    exactly the invalid ones failed, and the ones cancelled mid-stream ended "cancelled" (or earlier,
    by a stop token);
  * every greedy request that finished normally equals its solo non-speculative run (`ar`, alone);
  * resident memory (psutil RSS) after the run is within --max-drift (5 %) of RSS measured after the
    warm-up, with glibc's mmap threshold fixed (--mmap-threshold, see `set_mmap_threshold`). Warm-up:
    every engine first runs once at the largest shapes the soak can reach (`prewarm`, so ONNX
    Runtime's per-session arenas are at their working size), each generator runs one full batch of the
    longest request (its KV buffers, which the OS commits page by page as they are written, reach
    their working size; not counted in the report), then the first --warmup requests finish.

Finished requests are `release`d as they are read, as a long-running server would.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil

BAD_KINDS = ("empty-prompt", "negative-temperature", "over-capacity")
SAMPLING = ({"temperature": 0.0}, {"temperature": 0.7, "top_k": 50, "top_p": 0.9}, {"temperature": 1.0})
FALLBACK_TEXTS = (
    "Explain how a hash map works.", "Write a haiku about rain.", "What is 17 * 23? Show the steps.",
    "Summarise the plot of a detective story in three sentences.", "List five prime numbers and why they are prime.",
    "def fibonacci(n):\n    # complete this function", "Translate 'good morning' into French and Spanish.",
)


@dataclass
class Record:
    """One soak request: what was asked and how it ended."""

    index: int
    policy: str
    prompt: list[int]
    params: dict
    kind: str = "normal"              # "normal" | one of BAD_KINDS | "cancel"
    request_id: int = -1
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


def load_texts(datasets_dir: Path | None) -> list[str]:
    """First turns of the eval prompts (../shared/eval_datasets), or a built-in list without them."""
    from dspark_export.datasets import read_dataset

    if datasets_dir is None or not Path(datasets_dir).is_dir():
        return list(FALLBACK_TEXTS)
    texts = []
    for path in sorted(Path(datasets_dir).glob("*.jsonl")):
        texts += read_dataset(path)[:20]
    return texts or list(FALLBACK_TEXTS)


def make_records(encode, texts: list[str], policies: list[str], n: int, min_new: int, max_new: int,
                 max_prompt: int, capacity: int, bad_every: int, cancel_every: int, seed: int) -> list[Record]:
    """The soak's requests, deterministic in `seed`. The first len(policies) requests are the longest
    (max_prompt tokens, max_new) so every generator's cache reaches its working size in the warm-up."""
    rng = np.random.default_rng(seed)
    pool = [encode(t) for t in texts]
    long_ids = [t for ids in pool for t in ids]
    records = []
    for i in range(n):
        policy = policies[i % len(policies)]
        sampling = dict(SAMPLING[int(rng.integers(len(SAMPLING)))])
        if i < len(policies):
            prompt, new = (long_ids * (max_prompt // max(1, len(long_ids)) + 1))[:max_prompt], max_new
        else:
            ids = pool[int(rng.integers(len(pool)))]
            lo = min(len(ids), max_prompt)
            length = int(rng.choice([1, int(rng.integers(2, 32)), lo, int(rng.integers(lo, max_prompt + 1))]))
            prompt = (ids * (length // max(1, len(ids)) + 1))[:max(1, min(length, max_prompt))]
            new = int(rng.integers(min_new, max_new + 1))
        params = dict(max_new_tokens=new, seed=int(rng.integers(1 << 30)), **sampling)
        rec = Record(i, policy, prompt, params)
        if bad_every and i >= len(policies) and i % bad_every == bad_every - 1:
            rec.kind = BAD_KINDS[(i // bad_every) % len(BAD_KINDS)]
            if rec.kind == "empty-prompt":
                rec.prompt = []
            elif rec.kind == "negative-temperature":
                rec.params["temperature"] = -1.0
            else:
                rec.prompt = (long_ids * (capacity // max(1, len(long_ids)) + 2))[:capacity + 5]
        elif cancel_every and i >= len(policies) and i % cancel_every == cancel_every // 2:
            rec.kind = "cancel"
            rec.params["max_new_tokens"] = max(rec.params["max_new_tokens"], 8)
        records.append(rec)
    return records


def kv_capacity(needed: int, max_context: int, initial: int = 256) -> int:
    """The capacity a `KVCache` reaches for `needed` entries (`quantize.aligned`, from `initial`)."""
    from dspark_export.exporter.quantize import aligned

    return max(aligned(min(initial, max_context)), aligned(needed))


def prewarm(rt, slots: int, capacity: int) -> None:
    """Run every engine once at the largest shapes the soak can reach (`slots` requests, KV buffers of
    `capacity` entries, every row returning logits), as a server does at start-up: ONNX Runtime's
    per-session memory arenas grow to the largest shape each session has seen and keep it, so without
    this the first minutes of serving look like a leak."""
    from dspark_export.engines.packing import Segment, pack_segments

    eng = rt.engines
    graphs = eng.manifest.data["graphs"]
    tspec, dspec = graphs["target"]["spec"], graphs["drafter_block"]["spec"]
    g, V = int(dspec["block_size"]), int(eng.manifest.runtime["vocab_size"])
    S = eng.bucket_for("drafter_block", slots)

    def kv(spec, key, value, n=S, entries=capacity):
        shape = (n, spec["num_kv_heads"], entries, spec["head_dim"])
        return {f"{name}.{i}": np.zeros(shape, np.float32) for i in range(spec["num_layers"]) for name in (key, value)}

    for N in eng.buckets("target"):
        sizes = [N // S + (1 if r < N % S else 0) for r in range(S)]
        segs = [Segment(r, np.ones(q, np.int64), capacity - q) for r, q in enumerate(sizes) if q]
        lens = np.zeros(S, np.int64)
        for seg in segs:
            lens[seg.slot] = seg.start_position
        packed = pack_segments(segs, S, lens, N)
        entries = kv_capacity(capacity - 1 + packed.feed["pad_index"].shape[1], capacity)  # room for the padded width
        eng.runner_exact("target", N).infer({**packed.feed, **kv(tspec, "past_key", "past_value", entries=entries)})
    for N in eng.buckets("drafter_context"):
        eng.runner_exact("drafter_context", N).infer({
            "aux_hidden": np.zeros((N, graphs["drafter_context"]["spec"]["feature_size"]), np.float32),
            "position_ids": np.arange(N, dtype=np.int64)})
    for R in eng.buckets("drafter_block"):
        eng.runner_exact("drafter_block", R).infer({
            "anchor_ids": np.ones(R, np.int64), "start_positions": np.full(R, capacity - g, np.int64),
            "context_lens": np.full(R, capacity - g, np.int64), **kv(dspec, "context_key", "context_value", R),
            "temperature": np.ones(R, np.float32), "top_k": np.zeros(R, np.int64), "top_p": np.full(R, 0.9, np.float32),
            "uniforms": np.full((R, g), 0.5, np.float32), "confidence_temperature": np.ones(g, np.float32)})
    for R in eng.buckets("verify"):
        eng.runner_exact("verify", R).infer({
            "target_logits": np.zeros((R * (g + 1), V), np.float32),
            "query_start": np.arange(R + 1, dtype=np.int64) * (g + 1), "draft_ids": np.zeros((R, g), np.int64),
            "draft_logits": np.zeros((R, g, V), np.float32), "verify_lens": np.full(R, g, np.int64),
            "temperature": np.ones(R, np.float32), "top_k": np.zeros(R, np.int64), "top_p": np.full(R, 0.9, np.float32),
            "uniforms": np.full((R, g + 1), 0.5, np.float32)})


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold (mallopt M_MMAP_THRESHOLD) at `nbytes`; False where not glibc.

    glibc raises the threshold each time a large mmapped block is freed (up to 32 MiB), after which
    numpy's multi-MiB per-step temporaries (logits rows, draft logits) come from the heap, which then
    grows and fragments: measured on SmolLM2, RSS rose 11-17 % over 100 requests after warm-up with
    the default, and stayed flat with the threshold fixed at 1 MiB (the same as the environment
    variable MALLOC_MMAP_THRESHOLD_=1048576). A long-running server should do the same."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, int(nbytes)))   # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def run_soak(rt, records: list[Record], in_flight: int, warmup: int, max_slots: int | None = None,
             log=lambda msg: None, warm_batch: bool = False) -> dict:
    """Serve `records` through one Generator per policy, stepped in turn. Returns the report dict
    (without the solo-run check, see `check_greedy`)."""
    from dspark_export.runtime.generator import Generator
    from dspark_export.runtime.policies import parse_policy
    from dspark_export.runtime.request import SamplingParams

    gens = {p: Generator(rt.engines, parse_policy(p), max_slots=max_slots, detokenize=rt.decode)
            for p in dict.fromkeys(r.policy for r in records)}
    by_id: dict[tuple[str, int], Record] = {}
    to_release: list[tuple[str, int]] = []
    pending = list(records)
    live = 0
    finished = 0
    rss_warm = None
    rss_samples = []
    t0 = time.perf_counter()

    def on_token(policy):
        def callback(rid, tokens, result):
            nonlocal live, finished
            rec = by_id[(policy, rid)]
            if rec.kind == "cancel" and result.finish_reason is None and len(result.token_ids) >= 3:
                gens[policy].cancel(rid)
            if result.finish_reason is not None:
                rec.tokens, rec.finish_reason, rec.error = list(result.token_ids), result.finish_reason, result.error
                to_release.append((policy, rid))
                live -= 1
                finished += 1
        return callback

    def submit_more():
        nonlocal live
        while pending and live < in_flight:
            rec = pending.pop(0)
            gen = gens[rec.policy]
            live += 1
            rid = gen.batch.next_id          # the id submit assigns (one submitting thread)
            by_id[(rec.policy, rid)] = rec
            rec.request_id = gen.submit(rec.prompt, SamplingParams(**rec.params), on_token(rec.policy))
            assert rec.request_id == rid
        while to_release:               # requests refused at submit
            policy, rid = to_release.pop()
            gens[policy].release(rid)

    if warm_batch:
        # one full batch of the longest requests per generator: its KV buffers (allocated lazily by the
        # OS, resident only once written) are written to their working size before the baseline
        longest = max((r for r in records if r.kind == "normal"), key=lambda r: len(r.prompt) + r.params["max_new_tokens"])
        for gen in gens.values():
            ids = [gen.submit(longest.prompt, SamplingParams(max_new_tokens=longest.params["max_new_tokens"],
                                                             ))
                   for _ in range(gen.max_slots)]
            while gen.has_work():
                gen.step()
            for rid in ids:
                gen.release(rid)
        log(f"warm batch done: {sum(g.max_slots for g in gens.values())} requests")
    submit_more()
    steps = rounds = 0
    while pending or any(g.has_work() for g in gens.values()):
        rounds += 1
        for policy, gen in gens.items():
            if gen.has_work():
                gen.step()
                steps += 1
        while to_release:
            policy, rid = to_release.pop()
            gens[policy].release(rid)
        submit_more()
        if rss_warm is None and finished >= warmup:
            rss_warm = rss_bytes()
            log(f"warm-up done after {finished} requests: RSS {rss_warm / 2**20:.1f} MiB")
        if rounds % 25 == 0:
            rss_samples.append(psutil.Process().memory_info().rss)
            log(f"{finished}/{len(records)} finished, {steps} steps, RSS {rss_samples[-1] / 2**20:.1f} MiB")
    wall = time.perf_counter() - t0
    rss_end = rss_bytes()
    leftover = sum(len(g.batch.requests) for g in gens.values())
    reasons: dict[str, int] = {}
    for r in records:
        reasons[str(r.finish_reason)] = reasons.get(str(r.finish_reason), 0) + 1
    problems = []
    for r in records:
        if r.finish_reason is None:
            problems.append(f"request {r.index}: never finished")
        elif r.kind in BAD_KINDS and r.finish_reason != "error":
            problems.append(f"request {r.index} ({r.kind}): expected an error, got {r.finish_reason}")
        elif r.kind == "cancel" and r.finish_reason not in ("cancelled", "length", "stop", "capacity"):
            problems.append(f"request {r.index} (cancel): ended {r.finish_reason} ({r.error})")
        elif r.kind == "normal" and r.finish_reason not in ("length", "stop", "capacity"):
            problems.append(f"request {r.index}: ended {r.finish_reason} ({r.error})")
        elif r.finish_reason == "error" and not r.error:
            problems.append(f"request {r.index}: error without a reason")
    if leftover:
        problems.append(f"{leftover} finished requests were not released")
    drift = (rss_end - rss_warm) / rss_warm if rss_warm else None
    return {"requests": len(records), "policies": list(gens), "finish_reasons": reasons, "steps": steps,
            "wall_s": round(wall, 1), "generated_tokens": sum(len(r.tokens) for r in records),
            "rss_warm_mib": round(rss_warm / 2**20, 1) if rss_warm else None,
            "rss_end_mib": round(rss_end / 2**20, 1), "rss_max_mib": round(max(rss_samples + [rss_end]) / 2**20, 1),
            "rss_drift": round(drift, 4) if drift is not None else None, "problems": problems}


def check_greedy(rt, records: list[Record], limit: int | None = None) -> dict:
    """Each greedy request that finished normally vs its solo `ar` run (alone in a fresh Generator)."""
    from dspark_export.runtime.generator import Generator
    from dspark_export.runtime.policies import parse_policy
    from dspark_export.runtime.request import SamplingParams

    greedy = [r for r in records if r.params.get("temperature") == 0 and r.kind == "normal"
              and r.finish_reason in ("length", "stop", "capacity")]
    greedy = greedy[:limit] if limit else greedy
    mismatches = []
    for r in greedy:
        gen = Generator(rt.engines, parse_policy("ar"))
        solo = gen.generate([r.prompt], [SamplingParams(**r.params)])[0]
        if solo.token_ids != r.tokens:
            first = next((i for i, (a, b) in enumerate(zip(solo.token_ids, r.tokens)) if a != b),
                         min(len(solo.token_ids), len(r.tokens)))
            mismatches.append({"request": r.index, "policy": r.policy, "first_difference": first})
    return {"greedy_checked": len(greedy), "greedy_mismatches": mismatches}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-dir", type=Path, default=Path("/tmp/eng/dspark"))
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--policies", default="dspark,fixed:4,dspark-async,ar", help="comma-separated policies")
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=48)
    p.add_argument("--max-prompt", type=int, default=400, help="longest prompt in tokens (400)")
    p.add_argument("--in-flight", type=int, default=24, help="requests submitted and not yet finished, at most")
    p.add_argument("--max-slots", type=int, default=8, help="KV slots per generator (8)")
    p.add_argument("--warmup", type=int, default=None, help="requests finished before the RSS baseline (10 %%)")
    p.add_argument("--max-drift", type=float, default=0.05)
    p.add_argument("--no-prewarm", action="store_true", help="skip running every engine at its largest shape first")
    p.add_argument("--mmap-threshold", type=int, default=1 << 20,
                   help="fix glibc's mmap threshold at this many bytes (1 MiB); 0 keeps the allocator default")
    p.add_argument("--bad-every", type=int, default=50)
    p.add_argument("--cancel-every", type=int, default=40)
    p.add_argument("--solo-limit", type=int, default=None, help="check at most this many greedy requests solo")
    p.add_argument("--datasets-dir", type=Path, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the report here too")
    args = p.parse_args(argv)

    from dspark_export.datasets import default_datasets_dir
    from dspark_export.runtime.api import Runtime

    say = (lambda msg: print(f"[soak] {msg}", file=sys.stderr, flush=True))
    fixed = set_mmap_threshold(args.mmap_threshold) if args.mmap_threshold else False
    rt = Runtime.open(args.engine_dir, policy="ar")
    chat = bool(getattr(rt.tokenizer, "chat_template", None))
    texts = load_texts(args.datasets_dir or default_datasets_dir())
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    capacity = int(rt.engines.manifest.runtime["max_context"])
    records = make_records(lambda t: rt.encode(t, chat=chat), texts, policies, args.requests, args.min_new,
                           args.max_new, min(args.max_prompt, capacity - args.max_new - 1), capacity,
                           args.bad_every, args.cancel_every, args.seed)
    warmup = args.warmup if args.warmup is not None else max(len(policies), args.requests // 10)
    capacity = kv_capacity(max(len(r.prompt) for r in records if r.kind != "over-capacity") + args.max_new, capacity)
    if not args.no_prewarm:
        say(f"pre-warming every engine at {args.max_slots} slots x {capacity} KV entries")
        prewarm(rt, args.max_slots, capacity)
    say(f"{len(records)} requests, policies {policies}, new tokens {args.min_new}..{args.max_new}, "
        f"prompts 1..{max(len(r.prompt) for r in records)} tokens, in flight {args.in_flight}")
    report = run_soak(rt, records, args.in_flight, warmup, args.max_slots, say, warm_batch=not args.no_prewarm)
    say(f"served in {report['wall_s']} s; checking greedy requests against solo runs")
    report.update(check_greedy(rt, records, args.solo_limit))
    report["max_drift"] = args.max_drift
    report["mmap_threshold"] = args.mmap_threshold if fixed else "allocator default"
    ok = not report["problems"] and not report["greedy_mismatches"] and \
        report["rss_drift"] is not None and report["rss_drift"] < args.max_drift
    report["ok"] = ok
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
