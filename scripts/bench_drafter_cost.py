#!/usr/bin/env python
"""Drafter block cost against the target's one-token step, per draft vocabulary size N and layer format.

For each (N, layer format) the shipped drafter's block graph is exported as `build` would
(`exporter.drafter.build_block_graph`, int8 LM head unless `--lm-heads` says otherwise) and timed at R = 1, 4, 16 requests with a context of
`--context` entries; each given target graph is timed at one token (B = 1) with the same past length. All
sessions use `--threads` intra-op threads and are timed interleaved, round after round, so a change in machine
load falls on all alike; the median and the interquartile range of the per-round means are reported, and each
drafter cost as a share of each target step.

With `--profile RUNS`, each drafter block at R = 1 is also run RUNS times under ONNX Runtime's profiler (after
the timed rounds) and its node time is split into parts by node name (`PROFILE_PARTS`): the MarkovDraft op (its
inlined function body), the LM head (and the draft-vocabulary scatter), the layers' linear projections and MLP,
RoPE, attention (scores, softmax, context), norms and residuals, and the rest.

Usage:
    python scripts/bench_drafter_cost.py --ranking src/dspark_export/assets/drafters/smollm2-135m-instruct/draft_vocab.json \
        --target-graph fp32=/tmp/eng/fp32/graphs/target.onnx --sizes 4096,8192,16384,32768,full \
        --formats float32,int8,int4 --out reports/drafter/draft-vocab-cost.json
Exit codes: 0 done, 2 an error (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from dspark_export.plugins import cpu_ops


def _session(model_or_path, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = threads, 1, 3
    data = model_or_path if isinstance(model_or_path, str) else model_or_path.SerializeToString()
    cpu_ops.register_for(so, model_or_path)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


PROFILE_PARTS = (("markov_draft", ("markov_draft", "MarkovDraft")), ("lm_head", ("lm_head", "draft_vocab")),
                 ("projections_mlp", ("_proj/", "/mlp/")), ("rope", ("_rope/", "/rope/")), ("attention", ("/attn/",)),
                 ("norms_residuals", ("layernorm/", "/norm/", "_residual/")))
"""(part, name fragments) in order: a node belongs to the first part one of whose fragments its name holds."""


def _part(node_name: str) -> str:
    for part, fragments in PROFILE_PARTS:
        if any(f in node_name for f in fragments):
            return part
    return "other"


def _profile(model, feed: dict, runs: int) -> dict:
    """ms per run and share of the summed node time per `PROFILE_PARTS` part (one intra-op thread)."""
    import collections
    import tempfile

    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = 1, 1, 3
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort")
    cpu_ops.register_for(so, model)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    warm = 3
    for _ in range(warm + runs):
        sess.run(None, feed)
    events = json.loads(Path(sess.end_profiling()).read_text())
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_run = len(nodes) // (warm + runs)
    parts: collections.Counter = collections.Counter()
    top: collections.Counter = collections.Counter()
    for e in nodes[-per_run * runs:]:
        name = e["name"][: -len("_kernel_time")]
        parts[_part(name)] += e["dur"] / 1e3 / runs
        top[f"{e['args'].get('op_name', '')} {name}"] += e["dur"] / 1e3 / runs
    total = sum(parts.values())
    return {"node_ms": round(total, 3), "nodes_per_run": per_run, "ms": {k: round(v, 3) for k, v in parts.most_common()},
            "share": {k: round(v / total, 3) for k, v in parts.most_common()},
            "top_nodes_ms": {k: round(v, 3) for k, v in top.most_common(12)}}


def _quartiles(x: np.ndarray) -> list[float]:
    """[q25, median, q75] of per-round ratios, rounded."""
    return [round(float(np.percentile(x, q)), 3) for q in (25, 50, 75)]


def _block_feed(spec, R: int, P: int, rng) -> dict:
    feed = {"anchor_ids": rng.integers(0, spec.vocab_size, R), "start_positions": np.full(R, P),
            "context_lens": np.full(R, P), "temperature": np.zeros(R, np.float32), "top_k": np.zeros(R, np.int64),
            "top_p": np.ones(R, np.float32), "uniforms": rng.random((R, spec.block_size), dtype=np.float32),
            "confidence_temperature": np.ones(spec.block_size, np.float32)}
    for i in range(spec.num_layers):
        for name in ("context_key", "context_value"):
            feed[f"{name}.{i}"] = rng.standard_normal((R, spec.num_kv_heads, P, spec.head_dim)).astype(np.float32)
    return feed


def _saved_block_feed(sess, R: int, P: int, rng, vocab: int) -> dict:
    """`_block_feed` for a saved block graph, its dimensions read from the graph's inputs; anchors drawn from the
    target vocabulary `vocab` (the graph's `draft_logits` may be only the draft vocabulary wide)."""
    dims = {i.name: i.shape for i in sess.get_inputs()}
    kvh, d = dims["context_key.0"][1], dims["context_key.0"][3]
    spec = argparse.Namespace(vocab_size=vocab, block_size=dims["uniforms"][1], num_kv_heads=kvh, head_dim=d,
                              num_layers=sum(n.startswith("context_key.") for n in dims))
    return _block_feed(spec, R, P, rng)


def _target_feed(sess, P: int, rng) -> dict:
    """One token after P cached entries, over a KV buffer as the runtime holds it: aligned(P + 1) entries
    (the exact attention's contract, `runtime.kv_cache.KVCache.feed`)."""
    from dspark_export.exporter.quantize import aligned

    feed = {"input_ids": np.array([100]), "position_ids": np.array([P]), "query_start": np.array([0, 1]),
            "cache_lens": np.array([P]), "pad_index": np.zeros((1, 1), np.int64), "logit_rows": np.array([0])}
    for inp in sess.get_inputs():
        if inp.name.startswith("past_"):
            kvh, d = inp.shape[1], inp.shape[3]
            feed[inp.name] = rng.standard_normal((1, kvh, aligned(P + 1), d)).astype(np.float32)
    return feed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranking", required=True, help="draft_vocab.json (scripts/train_drafter.py draft-vocab)")
    p.add_argument("--target-graph", action="append", default=[], metavar="LABEL=PATH",
                   help="a target.onnx to time at B = 1 (repeatable)")
    p.add_argument("--block-graph", action="append", default=[], metavar="LABEL=PATH",
                   help="also time a saved drafter_block.onnx (e.g. one built by another commit) at each R (repeatable)")
    p.add_argument("--sizes", default="4096,8192,16384,32768,full")
    p.add_argument("--formats", default="float32,int8,int4", help="drafter layer formats")
    p.add_argument("--lm-heads", default="int8", help="drafter LM head formats (exporter.drafter.LM_HEAD_DTYPES)")
    p.add_argument("--forms", default="auto",
                   help="block forms, comma-separated: auto (what build exports: fused exactly when the layers are "
                        "quantized), plain, fused, contrib (exporter.drafter.build_block_graph's `fused`)")
    p.add_argument("--block-sizes", default="",
                   help="γ values to build the drafter block at (default: the shipped drafter's); the weights do not "
                        "depend on γ, so this times the shapes a drafter trained with that γ would run")
    p.add_argument("--requests", default="1,4,16")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=5, help="runs per session per round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter; cpu: the process's CPU time (time.process_time), a steadier "
                        "measure of the work on a machine shared with other jobs (use with --threads 1, where "
                        "ONNX Runtime computes in the calling thread and no thread spins)")
    p.add_argument("--profile", type=int, default=0, metavar="RUNS",
                   help="also profile each drafter block at R = 1 over RUNS runs (node time per part)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from dspark_export.errors import DsparkExportError
    from dspark_export.exporter.drafter import build_block_graph
    from dspark_export.modeling.loading import load_build_inputs
    from dspark_export.training.draft_vocab import read_ranking, select_d2t

    try:
        inputs = load_build_inputs(None, None)
        drafter, vocab = inputs.drafter, int(inputs.drafter.config.vocab_size)
        ranking = read_ranking(args.ranking, vocab)["ranking"]
        embed = inputs.target_model.get_input_embeddings().weight.detach().float().numpy()
    except DsparkExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    requests = [int(r) for r in args.requests.split(",")]
    sessions = {}  # label -> (session, {R: feed})
    models = {}  # drafter label -> ModelProto (for --profile)
    built = []  # (N, γ, layer format, form, label) of every drafter block built here
    for label_path in args.target_graph:
        label, path = label_path.split("=", 1)
        s = _session(path, args.threads)
        sessions[f"target:{label}"] = (s, {1: _target_feed(s, args.context, rng)})
    for label_path in args.block_graph:
        label, path = label_path.split("=", 1)
        s = _session(path, args.threads)
        sessions[f"block:{label}"] = (s, {R: _saved_block_feed(s, R, args.context, rng, vocab) for R in requests})
    import torch

    from dspark_export.exporter.drafter import _spec

    import copy
    import dataclasses

    gammas = [int(g) for g in args.block_sizes.split(",")] if args.block_sizes else [drafter.config.block_size]
    for size, gamma in ((size, g) for size in args.sizes.split(",") for g in gammas):
        d2t = None if size == "full" else select_d2t(ranking, int(size), vocab)
        shaped = drafter
        if gamma != drafter.config.block_size:
            shaped = copy.copy(drafter)  # the same modules; only the frozen config's γ differs
            object.__setattr__(shaped, "config", dataclasses.replace(drafter.config, block_size=gamma))
        for fmt, form, head in ((f, form, h) for f in args.formats.split(",") for form in args.forms.split(",")
                                for h in args.lm_heads.split(",")):
            fused = {"auto": None, "plain": False, "fused": True, "contrib": "contrib"}[form]
            with torch.no_grad():
                model = build_block_graph(shaped, inputs.rope, embed, head, d2t, fmt, fused=fused)
            spec = _spec(shaped, head, 0 if d2t is None else len(d2t), fmt)
            s = _session(model, args.threads)
            label = f"drafter:N={size}:{fmt}" + ("" if form == "auto" else f":{form}") + \
                ("" if not args.block_sizes else f":γ={gamma}") + ("" if head == "int8" else f":head={head}")
            models[label] = model
            built.append((size, gamma, fmt, form, head, label))
            sessions[label] = (s, {R: _block_feed(spec, R, args.context, rng) for R in requests})
            print(f"built N={size} {fmt} {form} head {head}", file=sys.stderr, flush=True)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for label, (s, feeds) in sessions.items():
            for R, feed in feeds.items():
                s.run(None, feed)
                t0 = clock()
                for _ in range(args.reps):
                    s.run(None, feed)
                times.setdefault(f"{label}:R={R}", []).append((clock() - t0) / args.reps * 1e3)
        print(f"round {rnd + 1}/{args.rounds}", file=sys.stderr, flush=True)
    stats = {k: {"median_ms": round(float(np.median(v)), 3), "q25_ms": round(float(np.percentile(v, 25)), 3),
                 "q75_ms": round(float(np.percentile(v, 75)), 3)} for k, v in times.items()}
    targets = {k.split(":")[1]: v["median_ms"] for k, v in stats.items() if k.startswith("target:")}
    rows = []
    for size, gamma, fmt, form, head, label in built:
        row = {"N": size, "block_size": gamma, "layers": fmt, "form": form, "lm_head": head}
        for R in requests:
            st = stats[f"{label}:R={R}"]
            row[f"R{R}_ms"] = st["median_ms"]
            row[f"R{R}_iqr_ms"] = [st["q25_ms"], st["q75_ms"]]
        for t, ms in targets.items():
            row[f"R1_share_of_{t}"] = round(row["R1_ms"] / ms, 3)
        rows.append(row)
    for label_path in args.block_graph:
        label = label_path.split("=", 1)[0]
        row = {"graph": label}
        for R in requests:
            st = stats[f"block:{label}:R={R}"]
            row[f"R{R}_ms"], row[f"R{R}_iqr_ms"] = st["median_ms"], [st["q25_ms"], st["q75_ms"]]
        for t, ms in targets.items():
            row[f"R1_share_of_{t}"] = round(row["R1_ms"] / ms, 3)
        rows.append(row)
    # Paired per round (same load): each drafter time over the first --block-graph's, and over each target's.
    paired = {}
    base = f"block:{args.block_graph[0].split('=', 1)[0]}" if args.block_graph else None
    for key, v in times.items():
        if key.startswith("target:"):
            continue
        label, R = key.rsplit(":R=", 1)
        v = np.array(v)
        entry = {}
        for t in targets:
            entry[f"share_of_{t}"] = _quartiles(v / np.array(times[f"target:{t}:R=1"]))
        if base and label != base:
            entry["over_" + base.split(":", 1)[1]] = _quartiles(v / np.array(times[f"{base}:R={R}"]))
        paired[key] = entry
    profiles = {}
    for label, model in models.items() if args.profile else ():
        profiles[label] = _profile(model, sessions[label][1][requests[0]], args.profile)
        print(json.dumps({label: {k: profiles[label][k] for k in ("node_ms", "share")}}), flush=True)
    result = {"command": " ".join(sys.argv), "context": args.context, "threads": args.threads, "clock": args.clock,
              "profile_R": requests[0] if args.profile else None, "profiles": profiles,
              "rounds": args.rounds,
              "reps": args.reps, "targets_B1_ms": targets, "stats": stats, "rows": rows, "paired": paired,
              "note": "machine shared with other jobs during the run; ratios in one interleaved run"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(json.dumps(row))
    print(json.dumps({"targets_B1_ms": targets}))
    for key, entry in paired.items():
        print(json.dumps({key: entry}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
