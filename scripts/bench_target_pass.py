"""One target pass of several target graphs, interleaved: median and spread per graph, ratio to the first.

For A/B checks of a graph change on a noisy machine: every round runs each graph once on the same feed
(one request of B rows at past length `--context` over a KV buffer of `--capacity` entries per slot),
so load changes fall on all of them alike. `--clock cpu` times process CPU seconds instead of wall time
(with `--threads 1` that is the pass's own work, whatever else the machine runs).

    python scripts/bench_target_pass.py /tmp/eng/a/graphs/target.onnx /tmp/eng/b/graphs/target.onnx \\
        --rows 1,4,8 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dspark_export.runtime.kv_cache import aligned


def feed_for(session, rows: int, context: int, capacity: int) -> dict:
    """The target contract's feed: one request, `rows` new tokens after `context` cached ones."""
    feed = dict(input_ids=np.arange(rows, dtype=np.int64) + 100,
                position_ids=np.arange(context, context + rows, dtype=np.int64),
                query_start=np.array([0, rows], np.int64), cache_lens=np.array([context], np.int64),
                pad_index=np.arange(rows, dtype=np.int64)[None], logit_rows=np.arange(rows, dtype=np.int64))
    capacity = aligned(max(capacity, context + rows))   # as the runtime's cache holds it (exact attention's contract)
    rng = np.random.default_rng(0)
    for i in session.get_inputs():
        if i.name.startswith(("past_key.", "past_value.")):
            kv_heads, head_dim = i.shape[1], i.shape[3]
            feed[i.name] = rng.standard_normal((1, kv_heads, capacity, head_dim)).astype(np.float32)
    return feed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("graphs", nargs="+", help="target.onnx files (same model)")
    p.add_argument("--rows", default="1", help="comma list of B (rows per pass)")
    p.add_argument("--context", type=int, default=100, help="cached entries before the pass")
    p.add_argument("--capacity", type=int, default=256, help="KV buffer entries per slot (≥ context)")
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
        sessions.append(ort.InferenceSession(path, so, providers=["CPUExecutionProvider"]))
    for rows in (int(r) for r in args.rows.split(",")):
        feeds = [feed_for(s, rows, args.context, args.capacity) for s in sessions]
        for s, f in zip(sessions, feeds):
            for _ in range(3):
                s.run(None, f)
        times = [[] for _ in sessions]
        for _ in range(args.rounds):
            for t, s, f in zip(times, sessions, feeds):
                t0 = clock()
                s.run(None, f)
                t.append((clock() - t0) * 1e3)
        base = np.median(times[0])
        for path, t in zip(args.graphs, times):
            print(f"B={rows} {path}: median {np.median(t):.2f} ms [p10 {np.percentile(t, 10):.2f}, "
                  f"p90 {np.percentile(t, 90):.2f}] ({args.clock}), ratio {np.median(t) / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
