#!/usr/bin/env python
"""How well the profile's layout cost predicts target-pass latency over many step layouts.

    python scripts/bench_layout_cost.py --engine-dir /tmp/eng/dspark --repeats 8 [--json PATH]

The target graph pads every slot's query to the longest one and attends S × Q query rows over the
whole KV buffer (capacity P), so a step's latency depends on its layout, not on its token count B alone
(docs/ARCHITECTURE.md, "The layout cost"). This times one target pass for each of 14 layouts of
1-16 slots (uniform, skewed: one request verifying γ + 1 rows beside decoding ones, and so on) at two
capacities, all interleaved, median of --repeats. Per layout it prints the measured latency, what SPS(B)
alone predicts, and what the engine directory's profile with its layout fit predicts
(`ThroughputProfile.at(S, P).step_seconds`), then a fit of c_a, c_kv on these measurements (the
profiler's model, t = T(N) + c_a·S·Q·P + c_kv·S·P) with its largest error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from dspark_export.engines.engine_set import EngineSet
from dspark_export.engines.packing import Segment, pack_segments
from dspark_export.engines.profiler import fit_layout_cost
from dspark_export.runtime.kv_cache import KVCache
from dspark_export.engines.sps import ThroughputProfile
from dspark_export.exporter.quantize import KEY_CHUNK


def layouts(slots: int, width: int) -> list[tuple[int, list[int]]]:
    """(S, rows per request) pairs up to `slots` slots and `width` = γ + 1 rows per request."""
    half, quarter = max(1, slots // 2), max(1, slots // 4)
    out = [(slots, [1] * slots), (2, [width, width]), (quarter, [width // 2] * quarter), (slots, [width, width]),
           (slots, [2] * slots), (slots, [width] + [1] * (slots - 1)), (quarter, [width] * quarter),
           (half, [width // 2] * half), (slots, [width] + [1] * (half - 1)), (1, [width]), (slots, [1] * half),
           (half, [1] * half), (quarter, [width] + [1] * (quarter - 1)), (quarter, [max(1, width // 2 - 1)] * quarter)]
    return [(s, q) for s, q in out if len(q) <= s]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-dir", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=8, help="timed runs per layout (8)")
    ap.add_argument("--capacities", default="256,1024", help="KV capacities P, comma-separated (256,1024)")
    ap.add_argument("--json", type=Path, help="write the table and the fit here")
    args = ap.parse_args(argv)
    if args.repeats < 2:
        ap.error(f"--repeats: expected at least 2 (the first run is a warm-up), found {args.repeats}")
    eng = EngineSet.open(args.engine_dir, verify=False)
    data = eng.manifest.data
    spec, width = data["graphs"]["target"]["spec"], data["graphs"]["drafter_block"]["spec"]["block_size"] + 1
    max_context = int(eng.manifest.runtime["max_context"])
    try:
        capacities = [int(c) for c in args.capacities.split(",")]
    except ValueError:
        ap.error(f"--capacities: expected integers like 256,1024, found {args.capacities!r}")
    if any(c <= width or c % KEY_CHUNK for c in capacities):
        ap.error(f"--capacities: each must be a multiple of {KEY_CHUNK} (KV buffers are, `quantize.aligned`) above "
                 f"{width}, found {capacities}")
    buckets = eng.buckets("target")
    profile = ThroughputProfile.from_json(json.loads((args.engine_dir / data["profile"]["path"]).read_text()))
    slots = max(1, min(eng.buckets("drafter_block")[-1], buckets[-1] // width))
    cases, caches = [], {}
    for cap in capacities:
        for s, q in layouts(slots, width):
            if sum(q) > buckets[-1]:
                continue
            n = eng.bucket_for("target", sum(q))          # the engine the runtime runs for these rows
            if (s, cap) not in caches:                    # one cache per (S, P), shared by its layouts
                kv = KVCache(spec["num_layers"], s, spec["num_kv_heads"], spec["head_dim"], max(cap, max_context), cap)
                kv.lens[:] = cap - width
                for buf in kv.keys + kv.values:   # written pages, as a serving cache's (np.zeros maps one zero page)
                    buf.fill(0.01)
                caches[(s, cap)] = kv
            kv = caches[(s, cap)]
            packed = pack_segments([Segment(i, np.full(k, 5, np.int64), cap - width) for i, k in enumerate(q)], s,
                                   kv.lens, n)
            feed = {**packed.feed, **kv.feed("past_key", "past_value", width=int(packed.feed["pad_index"].shape[1]))}
            cases.append({"S": s, "rows": q, "P": int(feed["past_key.0"].shape[2]), "B": sum(q), "N": n, "Q": int(packed.feed["pad_index"].shape[1]),
                          "_run": (eng.runner_exact("target", n), feed), "_t": []})
    for _ in range(args.repeats):
        for c in cases:
            runner, feed = c["_run"]
            t0 = time.perf_counter()
            runner.infer(feed)
            c["_t"].append((time.perf_counter() - t0) * 1e3)
    for c in cases:
        c["measured_ms"] = round(float(np.median(c.pop("_t")[1:])), 2)
        c.pop("_run")
        c["sps_only_ms"] = round(1e3 / profile.sps(c["B"]), 2)
        c["layout_ms"] = round(1e3 * float(profile.at(c["S"], c["P"]).step_seconds([c["B"]], [max(c["rows"])])[0]), 2)
    refit, _ = fit_layout_cost(cases, latency_key="measured_ms")
    print(f"{'S':>3} {'rows':<28} {'P':>5} {'B':>4} {'N':>4} {'Q':>2} {'measured':>9} {'SPS(B)':>8} {'layout':>8}")
    for c in cases:
        rows = str(c["rows"]) if len(c["rows"]) <= 4 else f"[{c['rows'][0]}, {c['rows'][1]}, ... ×{len(c['rows'])}]"
        print(f"{c['S']:>3} {rows:<28} {c['P']:>5} {c['B']:>4} {c['N']:>4} {c['Q']:>2} {c['measured_ms']:>9.1f} "
              f"{c['sps_only_ms']:>8.1f} {c['layout_ms']:>8.1f}")
    err = lambda key: max(abs(c[key] / c["measured_ms"] - 1) for c in cases) * 100  # noqa: E731
    print(f"largest error: SPS(B) alone {err('sps_only_ms'):.0f} %, profile with layout fit {err('layout_ms'):.0f} %")
    print(f"refit on these layouts: c_a {refit['ms_per_row_entry']:.3g} ms, c_kv {refit['ms_per_slot_entry']:.3g} ms, "
          f"largest error {refit['max_error_pct']} % (profile: c_a {profile.attention_ms:.3g}, c_kv {profile.kv_read_ms:.3g})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"engine_dir": str(args.engine_dir), "repeats": args.repeats, "layouts": cases,
                                         "refit": refit, "profile_fit": {"ms_per_row_entry": profile.attention_ms,
                                                                         "ms_per_slot_entry": profile.kv_read_ms}},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
