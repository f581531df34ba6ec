#!/usr/bin/env python3
"""Write the JSON test vectors that hold the native C++ scheduler (cpp/) equal to the Python one.

Every expected value is computed here by the Python implementation (`runtime.policies`,
`runtime.scheduler`, `engines.sps`, `plugins.speculative_verify.reference`, `engines.manifest`); the C++ tests
(`cpp/tests/test_native.cpp`) read the files and must reproduce them exactly.

    python scripts/make_cpp_vectors.py --out build/cpp/vectors [--cases 1000] [--seed 0]

Files written under --out:
    policies.json   policy strings → parsed form or error; ≥ --cases random cases per policy
                    (ar, fixed, threshold, dspark, dspark-async) plus the docstrings' worked examples
    profile.json    SPS(B) lookups on random staircases, and invalid tables that must be refused
    verify.json     the acceptance rule on host-side logits (greedy, sampled, top-k, top-p, edge cases)
    manifests/      small engine-directory manifests, valid and broken, with manifests/cases.json

Verification cases whose outcome would change under a relative perturbation of 1e-5 of the logits or
an absolute 1e-6 of the uniforms are replaced (they sit on a float32 tie, where two correct
implementations that sum in a different order may legitimately disagree); the count is recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from dspark_export.engines.manifest import Manifest
from dspark_export.errors import DsparkExportError
from dspark_export.plugins.common.sampling import SamplingBatch
from dspark_export.plugins.speculative_verify.reference import speculative_verify
from dspark_export.runtime.policies import parse_policy
from dspark_export.engines.sps import ThroughputProfile


def _f32_list(a: np.ndarray) -> list:
    """float32 values as JSON numbers that parse back to the same float32 (repr of the double)."""
    return np.asarray(a, np.float32).astype(np.float64).tolist()


def _random_profile(rng: np.random.Generator) -> ThroughputProfile:
    n = int(rng.integers(1, 9))
    buckets = np.sort(rng.choice(np.arange(1, 129), size=n, replace=False))
    kind = rng.integers(0, 3)
    if kind == 0:      # smooth, decreasing with B (a GPU-like curve)
        sps = 100.0 / (1.0 + buckets / rng.uniform(4, 64))
    elif kind == 1:    # noisy staircase, may be non-monotone (what a CPU profile looks like)
        sps = rng.uniform(5, 100, size=n)
    else:              # flat then a cliff
        sps = np.where(buckets <= rng.integers(1, 129), 80.0, 20.0) + rng.uniform(0, 1e-3, size=n)
    draft_r, draft_ms = (), ()
    if rng.random() < 0.5:     # with the drafter cost (sps.json drafter_block rows)
        draft_r = tuple(int(r) for r in np.sort(rng.choice(np.arange(1, 33), size=int(rng.integers(1, 6)),
                                                           replace=False)))
        draft_ms = tuple(float(m) for m in rng.uniform(0, 40, len(draft_r)))
    p = ThroughputProfile(tuple(int(b) for b in buckets), tuple(float(s) for s in sps), draft_r, draft_ms)
    if rng.random() < 0.5:     # with the layout cost (sps.json attention fit), bound to a step layout
        layout = tuple((int(rng.integers(1, 17)), int(rng.integers(1, 9)), int(rng.integers(16, 513))) for _ in buckets)
        p = ThroughputProfile(p.buckets, p.steps_per_s, draft_r, draft_ms, attention_ms=float(rng.uniform(0, 2e-3)),
                              kv_read_ms=float(rng.uniform(0, 2e-3)) * (rng.random() < 0.8), profiled_layout=layout)
        p = p.at(int(rng.integers(1, 17)), int(rng.integers(16, 4097)))
    return p


def _profile_json(p: ThroughputProfile) -> dict:
    return {"buckets": list(p.buckets), "sps": list(p.steps_per_s), "draft_requests": list(p.draft_requests),
            "draft_ms": list(p.draft_ms), "attention_ms": p.attention_ms, "kv_read_ms": p.kv_read_ms,
            "layout": [list(row) for row in p.profiled_layout], "num_slots": p.num_slots, "kv_capacity": p.kv_capacity}


def _random_confidence(rng: np.random.Generator, rows: int, gamma: int) -> np.ndarray:
    kind = rng.integers(0, 4)
    if kind == 0:
        c = rng.uniform(0, 1, (rows, gamma))
    elif kind == 1:    # realistic: high early, decaying
        c = np.clip(rng.beta(5, 2, (rows, gamma)) * np.linspace(1, 0.6, gamma), 0, 1)
    elif kind == 2:    # coarse values: many exact ties in the survivals
        c = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(rows, gamma))
    else:              # extremes
        c = rng.choice([0.0, 1.0, 0.999, 0.001], size=(rows, gamma))
    return c.astype(np.float32)


def policy_vectors(rng: np.random.Generator, cases: int) -> dict:
    parse = []
    for text in ["ar", "dspark", "dspark-async", "fixed:1", "fixed:7", "fixed:12", "threshold:0.5", "threshold:1",
                 "threshold:0.05", " fixed:3 ", "fixed:0", "fixed:-2", "fixed:x", "fixed:", "threshold:0",
                 "threshold:1.5", "threshold:nan", "threshold:-0.1", "threshold:abc", "greedy", "", "dspark:2",
                 "AR", "fixed:2.5"]:
        try:
            p = parse_policy(text)
            parse.append({"text": text, "ok": True, "name": p.name, "k": p.k, "threshold": p.threshold,
                          "str": str(p), "drafts": p.drafts})
        except DsparkExportError:
            parse.append({"text": text, "ok": False})
    out = []

    def add(policy: str, conf: np.ndarray, profile=None, lagged=None, max_lengths=None, tag="random"):
        pol = parse_policy(policy)
        expected = pol.verify_lengths(conf, conf.shape[1], profile, lagged, max_lengths)
        out.append({"tag": tag, "policy": policy, "gamma": int(conf.shape[1]),
                    "confidence": _f32_list(conf),
                    "lagged": None if lagged is None else _f32_list(lagged),
                    "profile": None if profile is None else _profile_json(profile),
                    "max_lengths": None if max_lengths is None else [int(x) for x in max_lengths],
                    "expected": [int(x) for x in expected]})

    # Worked examples from the docstrings (runtime/policies.py, runtime/scheduler.py).
    worked = ThroughputProfile((2, 4, 8), (100.0, 90.0, 75.0))
    c = np.array([[0.9, 0.8, 0.5], [0.6, 0.5, 0.9]], np.float32)
    add("dspark", c, worked, tag="worked:dspark")
    add("dspark-async", c, worked, lagged=c, tag="worked:dspark-async")
    add("threshold:0.5", np.array([[0.9, 0.6, 0.4, 0.9], [0.3, 0.9, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5]], np.float32),
        tag="worked:threshold")
    add("threshold:0.7", np.array([[np.float32(0.7), 0.71, 0.69]], np.float32), tag="edge:threshold-float32")
    add("dspark", np.zeros((0, 4), np.float32), worked, tag="edge:no-requests")
    add("dspark", np.ones((9, 3), np.float32), worked, tag="edge:R-beyond-largest-bucket")
    add("fixed:7", np.ones((2, 4), np.float32), tag="edge:K-above-gamma")
    add("dspark", np.ones((2, 4), np.float32), worked, max_lengths=np.array([0, 2]), tag="edge:max-lengths")

    for policy in ("ar", "fixed", "threshold", "dspark", "dspark-async"):
        for _ in range(cases):
            rows, gamma = int(rng.integers(1, 17)), int(rng.integers(1, 9))
            conf = _random_confidence(rng, rows, gamma)
            profile = _random_profile(rng) if policy.startswith("dspark") else None
            max_lengths = rng.integers(0, gamma + 2, rows) if rng.random() < 0.3 else None
            lagged = None
            if policy == "dspark-async" and rng.random() < 0.85:
                lagged = _random_confidence(rng, int(rng.integers(1, 17)), int(rng.integers(1, 9)))
            name = {"fixed": f"fixed:{int(rng.integers(1, 10))}",
                    "threshold": f"threshold:{float(np.float32(rng.uniform(0.01, 1))):.6g}"}.get(policy, policy)
            add(name, conf, profile, lagged, max_lengths)
    return {"parse": parse, "cases": out}


def profile_vectors(rng: np.random.Generator, cases: int) -> dict:
    lookups = []
    for _ in range(cases):
        p = _random_profile(rng)
        queries = [int(q) for q in rng.integers(0, p.max_tokens + 3, 8)]
        widths = [int(w) for w in rng.integers(1, 10, len(queries))]
        lookups.append({**_profile_json(p), "queries": queries, "expected": [float(p.sps(q)) for q in queries],
                        "expected_draft_s": [p.draft_seconds(q) for q in queries], "max_tokens": p.max_tokens,
                        "widths": widths, "has_layout_cost": p.has_layout_cost,
                        "expected_step_s": [float(x) if np.isfinite(x) else "inf"
                                            for x in p.step_seconds(queries, widths)]})
    invalid = []
    for buckets, sps in [([], []), ([1, 2], [10.0]), ([2, 1], [5.0, 4.0]), ([1, 1], [5.0, 4.0]), ([0, 2], [5.0, 4.0]),
                         ([1, 2], [5.0, 0.0]), ([1, 2], [5.0, -1.0]), ([1, 2], [5.0, float("inf")])]:
        try:
            ThroughputProfile(tuple(buckets), tuple(sps))
            ok = True
        except DsparkExportError:
            ok = False
        invalid.append({"buckets": buckets, "sps": [s if np.isfinite(s) else "inf" for s in sps], "ok": ok})
    # the sps.json form (rows of a real profile)
    sps_json = {"target": [{"B": 4, "median_ms": 42.4, "p10_ms": 41.0, "p90_ms": 44.0, "sps": 23.6},
                           {"B": 1, "median_ms": 30.8, "p10_ms": 30.0, "p90_ms": 31.0, "sps": 32.5},
                           {"B": 2, "median_ms": 38.5, "p10_ms": 38.0, "p90_ms": 39.0, "sps": 26.0}],
                "drafter_block": [{"R": 2, "median_ms": 21.8}, {"R": 1, "median_ms": 14.1}]}
    parsed = ThroughputProfile.from_json(sps_json)
    # with the layout fit the profiler writes (engines/profiler.py measure_layout_cost)
    fitted = json.loads(json.dumps(sps_json))
    for row, shape in zip(fitted["target"], ([1, 4, 136], [1, 1, 136], [1, 2, 136])):
        row.update(zip("SQP", shape))
    fitted["attention"] = {"ms_per_row_entry": 7.1e-4, "ms_per_slot_entry": 8.8e-4, "max_error_pct": 4.9, "layouts": []}
    bound = ThroughputProfile.from_json(fitted).at(4, 256)
    queries = [0, 1, 2, 3, 4, 5]
    return {"lookups": lookups, "invalid": invalid,
            "sps_json": {"data": sps_json, **_profile_json(parsed)},
            "sps_json_fit": {"data": fitted, "num_slots": 4, "kv_capacity": 256, "queries": queries,
                             "widths": [1, 1, 2, 2, 3, 1],
                             "expected_step_s": [float(x) if np.isfinite(x) else "inf"
                                                 for x in bound.step_seconds(queries, [1, 1, 2, 2, 3, 1])]}}


def _verify_once(case: dict) -> tuple[int, int]:
    n = case["verify_len"]
    tl = np.asarray(case["target_logits"], np.float32)
    out = speculative_verify(
        tl, np.array([0, n + 1], np.int64), np.asarray([case["draft_ids"]], np.int64),
        np.asarray([case["draft_logits"]], np.float32), np.array([n], np.int64),
        SamplingBatch(np.array([case["temperature"]], np.float32), np.array([case["top_k"]], np.int64),
                   np.array([case["top_p"]], np.float32)),
        np.asarray([case["uniforms"]], np.float32))
    return int(out.num_accepted[0]), int(out.next_ids[0])


def _stable(case: dict, result: tuple[int, int]) -> bool:
    for scale, du in ((1 + 1e-5, 0.0), (1 - 1e-5, 0.0), (1.0, 1e-6), (1.0, -1e-6)):
        c = dict(case)
        c["target_logits"] = (np.asarray(case["target_logits"], np.float32) * np.float32(scale)).tolist()
        c["draft_logits"] = (np.asarray(case["draft_logits"], np.float32) * np.float32(scale)).tolist()
        c["uniforms"] = np.clip(np.asarray(case["uniforms"], np.float32) + np.float32(du), 0, 0.9999999).tolist()
        if _verify_once(c) != result:
            return False
    return True


def verify_vectors(rng: np.random.Generator, cases: int) -> dict:
    out, replaced = [], 0

    def make(V, g, n, temperature, top_k, top_p, kind):
        target = rng.normal(0, 2, (n + 1, V)).astype(np.float32)
        draft = rng.normal(0, 2, (g, V)).astype(np.float32)
        if kind == "close":        # draft ≈ target: long accepted runs
            draft[: n] = target[: n] + rng.normal(0, 0.3, (n, V)).astype(np.float32)
        if kind == "one-hot":      # a draft distribution that is (numerically) one-hot
            draft = np.full((g, V), -1e4, np.float32)
            draft[np.arange(g), rng.integers(0, V, g)] = 0.0
        warped = None
        ids = rng.integers(0, V, g)
        if kind in ("close", "one-hot"):  # draw the drafts from the draft distribution, as the drafter does
            from dspark_export.plugins.common.sampling import sample_from_probs, warp_probs
            warped = warp_probs(draft, np.full(g, temperature, np.float32), np.full(g, top_k, np.int64),
                                np.full(g, top_p, np.float32))
            ids = sample_from_probs(warped, rng.random(g, dtype=np.float32))
        if kind == "all-accepted" and temperature == 0:
            ids[:n] = np.argmax(target[:n], axis=-1)
        if kind == "first-rejected" and temperature == 0:
            ids[0] = (np.argmax(target[0]) + 1) % V
        return {"tag": kind, "V": V, "gamma": g, "verify_len": n, "temperature": float(np.float32(temperature)),
                "top_k": int(top_k), "top_p": float(np.float32(top_p)),
                "target_logits": _f32_list(target), "draft_logits": _f32_list(draft),
                "draft_ids": [int(x) for x in ids],
                "uniforms": _f32_list(rng.random(g + 1, dtype=np.float32))}

    kinds = ["random", "close", "one-hot", "all-accepted", "first-rejected"]
    while len(out) < cases:
        V = int(rng.choice([2, 5, 17, 64, 100, 257]))
        g = int(rng.integers(1, 9))
        n = int(rng.integers(0, g + 1)) if rng.random() < 0.9 else 0      # 0 = empty draft (bonus only)
        temperature = 0.0 if rng.random() < 0.35 else float(rng.uniform(0.3, 1.5))
        top_k = int(rng.integers(1, V + 3)) if rng.random() < 0.3 else 0
        top_p = float(rng.uniform(0.2, 1.0)) if rng.random() < 0.3 else 1.0
        case = make(V, g, n, temperature, top_k, top_p, kinds[len(out) % len(kinds)])
        result = _verify_once(case)
        if not _stable(case, result):
            replaced += 1
            continue
        case["expected"] = {"num_accepted": result[0], "next_id": result[1]}
        out.append(case)
    return {"cases": out, "replaced_near_ties": replaced}


def manifest_vectors(root: Path) -> list[dict]:
    """Write manifest folders under root; each case says whether Python's Manifest.load accepts it."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    files = {"graphs/target.onnx": b"target-graph", "graphs/target.onnx.data": b"\0" * 64,
             "graphs/drafter_block.onnx": b"drafter", "graphs/drafter_context.onnx": b"context",
             "graphs/verify.onnx": b"verify", "profile/sps.json": json.dumps(
                 {"target": [{"B": 1, "sps": 30.0}, {"B": 4, "sps": 20.0}]}).encode(),
             "engines/onnxruntime/target.N4.json": b"{}"}

    def base() -> dict:
        return {
            "schema_version": 1, "tool": {"name": "dspark-export", "version": "0.1.0"},
            "graphs": {"target": {"path": "graphs/target.onnx", "data": "graphs/target.onnx.data", "spec": {}},
                       "drafter_context": {"path": "graphs/drafter_context.onnx", "spec": {}},
                       "drafter_block": {"path": "graphs/drafter_block.onnx", "spec": {"block_size": 4}},
                       "verify": {"path": "graphs/verify.onnx", "spec": {}}},
            "engines": [{"key": {"graph": "target", "backend": "onnxruntime", "dim": "N", "bucket": 4},
                         "path": "engines/onnxruntime/target.N4.json"}],
            "runtime": {"block_size": 4, "max_context": 96, "vocab_size": 256, "eos_token_ids": [2],
                        "confidence_temperature": [1.0, 1.0, 1.5, 2.0]},
            "profile": {"path": "profile/sps.json"},
            "files": {rel: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()} for rel, b in files.items()},
        }

    def write(name: str, manifest, mutate_files=None, raw: bytes | None = None) -> dict:
        d = root / name
        for rel, b in files.items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_bytes(b)
        if mutate_files:
            mutate_files(d)
        if raw is not None:
            (d / "manifest.json").write_bytes(raw)
        elif manifest is not None:
            (d / "manifest.json").write_text(json.dumps(manifest, indent=2))
        try:
            Manifest.load(d, verify=True)
            ok, error = True, None
        except DsparkExportError as e:
            ok, error = False, str(e)
        return {"name": name, "ok": ok, "python_error": error}

    def edit(fn):
        m = base()
        fn(m)
        return m

    def pop_path(m, *keys):
        for k in keys[:-1]:
            m = m[k]
        m.pop(keys[-1])

    cases = [write("valid", base())]
    cases.append(write("schema_99", edit(lambda m: m.update(schema_version=99))))
    cases.append(write("schema_missing", edit(lambda m: m.pop("schema_version"))))
    cases.append(write("schema_string", edit(lambda m: m.update(schema_version="1"))))
    for name, version in (("schema_2", 2), ("schema_3", 3), ("schema_0", 0), ("schema_true", True),
                          ("schema_float", 1.0)):
        cases.append(write(name, edit(lambda m, v=version: m.update(schema_version=v))))
    for f in ("tool", "graphs", "engines", "runtime", "files"):
        cases.append(write(f"missing_{f}", edit(lambda m, f=f: m.pop(f))))
    cases.append(write("graphs_missing_verify", edit(lambda m: pop_path(m, "graphs", "verify"))))
    for f in ("block_size", "max_context", "vocab_size", "eos_token_ids", "confidence_temperature"):
        cases.append(write(f"runtime_missing_{f}", edit(lambda m, f=f: pop_path(m, "runtime", f))))
    cases.append(write("runtime_block_size_string", edit(lambda m: m["runtime"].update(block_size="4"))))
    cases.append(write("runtime_block_size_bool", edit(lambda m: m["runtime"].update(block_size=True))))
    cases.append(write("block_size_mismatch", edit(lambda m: m["runtime"].update(block_size=5))))
    cases.append(write("sts_length_mismatch", edit(lambda m: m["runtime"].update(confidence_temperature=[1.0]))))
    cases.append(write("engines_not_list", edit(lambda m: m.update(engines={}))))
    cases.append(write("engines_empty", edit(lambda m: m.update(engines=[]))))
    cases.append(write("runtime_max_context_negative", edit(lambda m: m["runtime"].update(max_context=-1))))
    cases.append(write("runtime_vocab_size_zero", edit(lambda m: m["runtime"].update(vocab_size=0))))
    cases.append(write("vocab_size_mismatch", edit(lambda m: m["graphs"]["target"]["spec"].update(vocab_size=100))))
    cases.append(write("vocab_size_match", edit(lambda m: m["graphs"]["target"]["spec"].update(vocab_size=256))))
    cases.append(write("engine_path_mismatch", edit(lambda m: m["engines"][0].update(path="engines/x.json"))))
    cases.append(write("engine_key_malformed", edit(lambda m: m["engines"][0].update(key={"graph": "target"}))))

    def outside(m):
        m["files"]["../escape.txt"] = {"bytes": 1, "sha256": "0" * 64}
    cases.append(write("file_path_outside", edit(outside)))

    def absolute(m):
        m["graphs"]["verify"]["path"] = "/etc/passwd"
    cases.append(write("graph_path_absolute", edit(absolute)))

    def dotdot_graph(m):
        m["graphs"]["verify"]["path"] = "graphs/../../verify.onnx"
    cases.append(write("graph_path_dotdot", edit(dotdot_graph)))

    def unlisted(m):
        m["files"].pop("graphs/verify.onnx")
    cases.append(write("graph_not_listed", edit(unlisted)))
    cases.append(write("file_missing", base(), mutate_files=lambda d: (d / "graphs/verify.onnx").unlink()))
    cases.append(write("file_size_altered", base(),
                       mutate_files=lambda d: (d / "graphs/verify.onnx").write_bytes(b"verify-longer")))
    cases.append(write("file_hash_altered", base(),
                       mutate_files=lambda d: (d / "graphs/verify.onnx").write_bytes(b"VERIFY")))
    outside_file = root / "outside.bin"
    outside_file.write_bytes(b"secret")

    def symlink_out(m):
        m["files"]["graphs/link.onnx"] = {"bytes": 6, "sha256": hashlib.sha256(b"secret").hexdigest()}
    cases.append(write("file_symlink_outside", edit(symlink_out),
                       mutate_files=lambda d: (d / "graphs/link.onnx").symlink_to(outside_file)))
    cases.append(write("not_json", None, raw=b"{ not json"))
    cases.append(write("json_array", None, raw=b"[1, 2]"))
    cases.append(write("no_manifest", None))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--cases", type=int, default=1000, help="random cases per policy / verify / profile (default 1000)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    written = {
        "policies.json": policy_vectors(rng, args.cases),
        "profile.json": profile_vectors(rng, max(1, args.cases // 4)),
        "verify.json": verify_vectors(rng, args.cases),
    }
    for name, data in written.items():
        (args.out / name).write_text(json.dumps(data))
    cases = manifest_vectors(args.out / "manifests")
    (args.out / "manifests" / "cases.json").write_text(json.dumps(cases, indent=1))
    n_pol = len(written["policies.json"]["cases"])
    print(f"wrote {args.out}: {n_pol} policy cases, {len(written['verify.json']['cases'])} verify cases "
          f"({written['verify.json']['replaced_near_ties']} near-ties replaced), "
          f"{len(written['profile.json']['lookups'])} profile tables, {len(cases)} manifests", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
