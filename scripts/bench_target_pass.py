"""One target pass of several target graphs, interleaved: median and spread per graph, ratio to the first.

For A/B checks of a graph change on a noisy machine: every round runs each graph once on the same feed
(`--slots` requests of B rows each at past length `--context` over a KV buffer of `--capacity` entries per
slot), in reverse order every other round, so load changes fall on all of them alike; each graph's ratio to
the first is also taken per round (median and p10–p90) and the outputs are compared bit for bit. `--clock cpu` times process CPU seconds instead of wall time
(with `--threads 1` that is the pass's own work, whatever else the machine runs).

    python scripts/bench_target_pass.py /tmp/eng/a/graphs/target.onnx /tmp/eng/b/graphs/target.onnx \\
        --rows 1,4,8 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dspark_export.exporter.quantize import aligned
from dspark_export.plugins import cpu_ops


def feed_for(session, rows: int, context: int, capacity: int, slots: int = 1) -> dict:
    """The target contract's feed: `slots` requests, each `rows` new tokens after `context` cached ones."""
    n = rows * slots
    feed = dict(input_ids=np.arange(n, dtype=np.int64) + 100,
                position_ids=np.tile(np.arange(context, context + rows, dtype=np.int64), slots),
                query_start=np.arange(slots + 1, dtype=np.int64) * rows,
                cache_lens=np.full(slots, context, np.int64),
                pad_index=np.arange(n, dtype=np.int64).reshape(slots, rows), logit_rows=np.arange(n, dtype=np.int64))
    capacity = aligned(max(capacity, context + rows))   # as the runtime's cache holds it (exact attention's contract)
    rng = np.random.default_rng(0)
    for i in session.get_inputs():
        if i.name.startswith(("past_key.", "past_value.")):
            kv_heads, head_dim = i.shape[1], i.shape[3]
            feed[i.name] = rng.standard_normal((slots, kv_heads, capacity, head_dim)).astype(np.float32)
    return feed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("graphs", nargs="+", help="target.onnx files (same model)")
    p.add_argument("--rows", default="1", help="comma list of B (rows per pass)")
    p.add_argument("--context", type=int, default=100, help="cached entries before the pass")
    p.add_argument("--capacity", type=int, default=256, help="KV buffer entries per slot (≥ context)")
    p.add_argument("--slots", type=int, default=1, help="requests per pass (S)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = p.parse_args(argv)

    import onnxruntime as ort

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    sessions = []
    for path in args.graphs:
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        so.log_severity_level = 3
        cpu_ops.register_for(so, path)
        sessions.append(ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]))
    for rows in (int(r) for r in args.rows.split(",")):
        feeds = [feed_for(s, rows, args.context, args.capacity, args.slots) for s in sessions]
        outs = [s.run(None, f) for s, f in zip(sessions, feeds)]
        for s, f in zip(sessions, feeds):
            for _ in range(2):
                s.run(None, f)
        times = [[] for _ in sessions]
        order = list(zip(times, sessions, feeds))
        for k in range(args.rounds):
            for t, s, f in (order if k % 2 == 0 else order[::-1]):
                t0 = clock()
                s.run(None, f)
                t.append((clock() - t0) * 1e3)
        base = np.asarray(times[0])
        for path, t, out in zip(args.graphs, times, outs):
            ratio = np.asarray(t) / base
            same = all(np.array_equal(a, b) for a, b in zip(out, outs[0]))
            print(f"S={args.slots} B={rows} {path}: median {np.median(t):.2f} ms [p10 {np.percentile(t, 10):.2f}, "
                  f"p90 {np.percentile(t, 90):.2f}] ({args.clock}), per-round ratio {np.median(ratio):.3f} "
                  f"[{np.percentile(ratio, 10):.3f}, {np.percentile(ratio, 90):.3f}], outputs equal to the first: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
