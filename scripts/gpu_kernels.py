#!/usr/bin/env python
"""The dspark Triton kernels on a real GPU: equal to the numpy reference, and timed against torch.

Run by ``scripts/gpu_check.sh`` (or alone: ``python scripts/gpu_kernels.py --out DIR``). Needs a CUDA device,
torch with CUDA and triton. Three parts, each a row of the JSON it writes (``DIR/gpu_kernels.json``):

1. correctness: both ops through the checked wrappers (``OP_REGISTRY[op].triton``) and through the
   TensorRT-order launch (``tensorrt_kernels.launch_trt_order``, the plugin's path) on CUDA tensors, on the
   test suite's cases (greedy, sampled, top-k, top-p, ties, ragged verification, every MarkovDraft
   configuration; V not a multiple of the block), compared with the numpy reference: token ids exactly,
   logits and confidences to 1e-5;
2. timing: each kernel against a torch implementation of the same greedy work on the same GPU (CUDA events,
   median of the timed runs after warm-up) at the default model's sizes (V 49152, γ 7, H 576, r 32); the
   torch outputs are first checked equal to the kernel's, so both time the same result;
3. the AOT PTX for this GPU's compute capability assembles with ptxas (as TensorRT would load it).

Exit status: 0 all passed, 1 a check failed, 3 no CUDA device (nothing ran).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "plugins")]


def _cuda_ok() -> str | None:
    try:
        import torch
    except ImportError as e:
        return f"torch does not import ({e})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def correctness(rows: list) -> bool:
    import numpy as np
    import torch

    from dspark_export.plugins.markov_draft import reference as markov_reference
    from dspark_export.plugins.registry import OP_REGISTRY
    from dspark_export.plugins.speculative_verify import reference as verify_reference
    from dspark_export.plugins.tensorrt_kernels import launch_trt_order
    from plugin_cases import MARKOV_CONFIGS, SAMPLING_CASES, draft_vocab_feeds, markov_feeds, verify_feeds

    ok = True

    def cuda(feeds):
        return {k: torch.from_numpy(v.copy()).cuda() for k, v in feeds.items()}

    def host(out):
        return {k: v.cpu().numpy() for k, v in out.items()}

    def check(name, got, want):
        nonlocal ok
        try:
            for k, v in want.items():
                if v.dtype.kind == "i":
                    np.testing.assert_array_equal(got[k], v, err_msg=k)
                else:
                    np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
            rows.append({"check": name, "passed": True})
        except AssertionError as e:
            ok = False
            rows.append({"check": name, "passed": False, "error": str(e)[:500]})

    for tag, config in MARKOV_CONFIGS.items():
        for case in SAMPLING_CASES:
            for vocab, block_v in ((37, 16), (1000, 1024)):
                rng = np.random.default_rng(zlib.crc32(f"{tag}/{case}/{vocab}".encode()))
                feeds = markov_feeds(rng, case, dict(block_size=4, **config), num_requests=5, vocab=vocab)
                want = markov_reference.run(feeds)
                check(f"MarkovDraft/{tag}/{case}/V{vocab}/wrapper",
                      host(OP_REGISTRY["MarkovDraft"].triton(cuda(feeds), block_v=block_v)), want)
                fields = dict(has_markov=int(config["has_markov"]), has_confidence=int(config["has_confidence"]),
                              block_v=block_v)
                check(f"MarkovDraft/{tag}/{case}/V{vocab}/trt-order",
                      host(launch_trt_order("MarkovDraft", cuda(feeds), fields)), want)
                if config["has_markov"]:  # a draft vocabulary of a third of V (logits over its columns)
                    d2t = np.sort(rng.choice(vocab, vocab // 3, replace=False))
                    draft = draft_vocab_feeds(feeds, d2t)[1]
                    check(f"MarkovDraft/{tag}/{case}/V{vocab}/d2t/wrapper",
                          host(OP_REGISTRY["MarkovDraft"].triton(cuda(draft), block_v=block_v)),
                          markov_reference.run(draft))
    for case in list(SAMPLING_CASES) + ["ties"]:
        for vocab, block_v in ((37, 16), (1000, 1024)):
            rng = np.random.default_rng(zlib.crc32(f"{case}/{vocab}".encode()))
            feeds = verify_feeds(rng, "mixed" if case == "ties" else case, [3, 0, 4, 1, 2, 4], gamma=4, vocab=vocab,
                                 has_ties=case == "ties")
            want = verify_reference.run(feeds)
            check(f"SpeculativeVerify/{case}/V{vocab}/wrapper",
                  host(OP_REGISTRY["SpeculativeVerify"].triton(cuda(feeds), block_v=block_v)), want)
            check(f"SpeculativeVerify/{case}/V{vocab}/trt-order",
                  host(launch_trt_order("SpeculativeVerify", cuda(feeds), {"block_v": block_v})), want)
    return ok


def _torch_markov_greedy(base_logits, hidden, anchor_ids, w1, w2, conf_w, conf_b, conf_t):
    """Greedy MarkovDraft in torch: L_k = U_k + W2·W1[prev], x_k = argmax, conf_k = σ(([h;W1[prev]]·w + b)/T_k)."""
    import torch

    num, gamma, _ = base_logits.shape
    prev = anchor_ids
    ids, logits, conf = [], [], []
    for k in range(gamma):
        e = w1[prev]                                        # [R, r]
        lk = base_logits[:, k] + e @ w2.T                   # [R, V]
        z = torch.cat([hidden[:, k], e], dim=-1) @ conf_w + conf_b
        conf.append(torch.sigmoid(z / conf_t[k]))
        prev = lk.argmax(dim=-1)
        ids.append(prev)
        logits.append(lk)
    return torch.stack(ids, 1), torch.stack(logits, 1), torch.stack(conf, 1)


def _torch_verify_greedy(target_logits, query_start, draft_ids, verify_lens):
    """Greedy SpeculativeVerify in torch: accept while draft == argmax of its target row; next = argmax of row a."""
    import torch

    gamma = draft_ids.shape[1]
    arg = target_logits.argmax(dim=-1)                      # [M]
    start = query_start[:-1]
    j = torch.arange(gamma, device=arg.device)
    rows = (start[:, None] + j[None, :]).clamp(max=arg.shape[0] - 1)
    match = (arg[rows] == draft_ids) & (j[None, :] < verify_lens[:, None])
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    next_ids = arg[start + num_accepted]
    return num_accepted, next_ids


def _time(fn, warmup: int, repeats: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def timing(rows: list, repeats: int) -> bool:
    import torch

    from dspark_export.plugins.registry import OP_REGISTRY

    torch.manual_seed(0)
    V, G, H, RANK = 49152, 7, 576, 32
    ok = True
    for R in (1, 4, 16):
        dev = "cuda"
        feeds = {"base_logits": torch.randn(R, G, V, device=dev) * 2, "hidden": torch.randn(R, G, H, device=dev),
                 "anchor_ids": torch.randint(0, V, (R,), device=dev), "temperature": torch.zeros(R, device=dev),
                 "top_k": torch.zeros(R, dtype=torch.int64, device=dev), "top_p": torch.ones(R, device=dev),
                 "uniforms": torch.rand(R, G, device=dev), "confidence_temperature": torch.ones(G, device=dev),
                 "markov_w1": torch.randn(V, RANK, device=dev) * 0.1, "markov_w2": torch.randn(V, RANK, device=dev) * 0.1,
                 "confidence_weight": torch.randn(H + RANK, device=dev) * 0.05,
                 "confidence_bias": torch.zeros(1, device=dev)}
        run_triton = lambda: OP_REGISTRY["MarkovDraft"].triton(feeds, check_values=False)  # noqa: E731
        args = [feeds[k] for k in ("base_logits", "hidden", "anchor_ids", "markov_w1", "markov_w2",
                                   "confidence_weight", "confidence_bias", "confidence_temperature")]
        run_torch = lambda: _torch_markov_greedy(*args)  # noqa: E731
        got, want = run_triton(), run_torch()
        same = bool(torch.equal(got["draft_ids"], want[0])) and bool(torch.allclose(got["confidence"], want[2], atol=1e-5))
        ok &= same
        rows.append({"timing": "MarkovDraft greedy", "R": R, "V": V, "gamma": G, "same_result": same,
                     "triton_ms": round(_time(run_triton, 5, repeats), 4), "torch_ms": round(_time(run_torch, 5, repeats), 4)})

        lens = torch.full((R,), G, dtype=torch.int64, device=dev)
        tl = torch.randn(R * (G + 1), V, device=dev) * 2
        qs = torch.arange(R + 1, device=dev, dtype=torch.int64) * (G + 1)
        # drafts equal to the target's argmax for a random prefix, so acceptance lengths vary
        arg = tl.argmax(-1)
        cut = torch.randint(0, G + 1, (R,), device=dev)
        j = torch.arange(G, device=dev)
        drafts = torch.where(j[None] < cut[:, None], arg[qs[:-1, None] + j[None]], (arg[qs[:-1, None] + j[None]] + 1) % V)
        vfeeds = {"target_logits": tl, "query_start": qs, "draft_ids": drafts, "draft_logits": torch.randn(R, G, V, device=dev),
                  "verify_lens": lens, "temperature": torch.zeros(R, device=dev),
                  "top_k": torch.zeros(R, dtype=torch.int64, device=dev), "top_p": torch.ones(R, device=dev),
                  "uniforms": torch.rand(R, G + 1, device=dev)}
        run_triton = lambda: OP_REGISTRY["SpeculativeVerify"].triton(vfeeds, check_values=False)  # noqa: E731
        run_torch = lambda: _torch_verify_greedy(tl, qs, drafts, lens)  # noqa: E731
        got, want = run_triton(), run_torch()
        same = bool(torch.equal(got["num_accepted"], want[0])) and bool(torch.equal(got["next_ids"], want[1]))
        ok &= same
        rows.append({"timing": "SpeculativeVerify greedy", "R": R, "V": V, "gamma": G, "same_result": same,
                     "triton_ms": round(_time(run_triton, 5, repeats), 4), "torch_ms": round(_time(run_torch, 5, repeats), 4)})
    return ok


def aot(rows: list) -> bool:
    import torch

    from dspark_export.plugins.tensorrt_kernels import assemble, compile_aot

    major, minor = torch.cuda.get_device_capability()
    cap = 10 * major + minor
    ok = True
    for op, fields, static in (("SpeculativeVerify", {}, {}),
                               ("MarkovDraft", {"has_markov": 1, "has_confidence": 1}, {"RANK": 32, "H": 576})):
        try:
            k = compile_aot(op, fields, static, capability=cap)
            assemble(k, capability=cap)
            rows.append({"aot": op, "capability": cap, "passed": True, "params": k.num_params, "block_x": k.block_x,
                         "shared_mem": k.shared_mem})
        except Exception as e:  # report and go on
            ok = False
            rows.append({"aot": op, "capability": cap, "passed": False, "error": f"{type(e).__name__}: {e}"[:500]})
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."), help="folder for gpu_kernels.json")
    ap.add_argument("--repeats", type=int, default=50, help="timed runs per kernel (50)")
    ap.add_argument("--parts", default="correctness,timing,aot")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    reason = _cuda_ok()
    result = {"device": None, "parts": {}, "reason": reason}
    if reason is not None:
        (args.out / "gpu_kernels.json").write_text(json.dumps(result, indent=1))
        print(f"gpu_kernels: no GPU run: {reason}")
        return 3
    import torch

    result["device"] = {"name": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
                        "torch": torch.__version__}
    ok = True
    for part in args.parts.split(","):
        rows: list = []
        t0 = time.perf_counter()
        try:
            passed = {"correctness": correctness, "timing": lambda r: timing(r, args.repeats), "aot": aot}[part](rows)
        except Exception:
            passed = False
            rows.append({"error": traceback.format_exc()[-2000:]})
        ok &= passed
        result["parts"][part] = {"passed": passed, "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
        print(f"gpu_kernels: {part}: {'passed' if passed else 'FAILED'} ({len(rows)} rows, "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
    (args.out / "gpu_kernels.json").write_text(json.dumps(result, indent=1))
    for row in result["parts"].get("timing", {}).get("rows", []):
        if "timing" in row:
            print(f"  {row['timing']:<26} R={row['R']:<3} triton {row['triton_ms']:.4f} ms  torch {row['torch_ms']:.4f} ms"
                  f"  same={row['same_result']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
