"""Command line: `dspark-export build | generate | bench | profile | report | export-profile | inspect | trt`.

Each command parses arguments and calls one stage function; errors print one line (the full trace
with --verbose) and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path

from .errors import DsparkExportError, RequestError
from .runtime import DEFAULT_POLICY

log = logging.getLogger("dspark_export")

OVERVIEW_EXAMPLES = """examples (a typical session; `dspark-export COMMAND --help` shows each command's own):
  dspark-export build --out engines/smollm2                       # the embedded default (SmolLM2-135M-Instruct)
  dspark-export generate --engine-dir engines/smollm2 --chat --prompt "What is 12*7?"
  dspark-export bench serve --engine-dir engines/smollm2 --concurrency 1,4 --json serve.json
  dspark-export inspect engines/smollm2                           # what was built, and its integrity
  dspark-export report engines/smollm2                            # HTML report: engines, SPS(B), calibration
"""

BUILD_EXAMPLES = """examples:
  dspark-export build --out engines/smollm2                       # the embedded default (SmolLM2-135M-Instruct)
  dspark-export build --target ./my-llama --drafter ./dspark-ckpt --out engines/mine
  dspark-export build --drafter untrained --max-context 4096 --out engines/smollm2-untrained
"""
GENERATE_EXAMPLES = """examples:
  dspark-export generate --engine-dir engines/smollm2 --chat --prompt "What is 12*7?"
  dspark-export generate --engine-dir engines/smollm2 --prompts-file prompts.jsonl --chat --json --policy fixed:5
  dspark-export generate --engine-dir engines/smollm2 --prompt "Once upon" --temperature 0.8 --seed 1
"""
BENCH_EXAMPLES = """examples:
  dspark-export bench serve --engine-dir engines/smollm2 --concurrency 1,4 --json serve.json
  dspark-export bench acceptance --engine-dir engines/smollm2 --samples 20 --out-dir reports/acceptance
  dspark-export bench peers --engine-dir engines/smollm2 --max-new-tokens 64 --json peers.json
"""
PROFILE_EXAMPLES = """examples:
  dspark-export profile --engine-dir engines/smollm2 --context 512 --repeats 20
"""
REPORT_EXAMPLES = """examples:
  dspark-export report engines/smollm2                            # (re)writes engines/smollm2/report/index.html
  dspark-export report engines/smollm2 --out /tmp/smollm2-report --acceptance reports/acceptance/acceptance.json \\
      --serve reports/serve/serve_bench.json --peers peers.json
"""
EXPORT_PROFILE_EXAMPLES = """examples:
  dspark-export export-profile engines/smollm2 --format sglang --out profile-sglang   # SPS table + STS json
  dspark-export export-profile engines/smollm2 --format trtllm --out profile-trtllm   # cost table + calibration
  dspark-export export-profile engines/smollm2 --format generic --out profile         # labelled JSON + CSV
formats: sglang and trtllm follow those projects' loader source (see docs/ARCHITECTURE.md); vllm has no
documented profile file (it profiles its own CUDA graphs at startup), so --format vllm explains and exits 2.
"""
INSPECT_EXAMPLES = """examples:
  dspark-export inspect engines/smollm2                           # summary; exit 2 if a file is altered or unlisted
  dspark-export inspect engines/smollm2 --json
  dspark-export inspect engines/smollm2 --trt-compat              # exit 1 if a graph would not parse in TensorRT 10
"""
TRT_EXAMPLES = """examples:
  dspark-export trt plan --engine-dir engines/smollm2               # lowering + optimization profiles (no TensorRT needed)
  dspark-export trt build --engine-dir engines/smollm2              # TensorRT >= 10.9 and a GPU: engines + SPS profile
  dspark-export trt compare --engine-dir engines/smollm2            # TensorRT vs ONNX Runtime, Polygraphy comparator
  dspark-export generate --engine-dir engines/smollm2 --backend tensorrt --prompt "Hi"
"""


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, found {text!r}") from e


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark-export", description="DSpark speculative decoding as deployable engines.",
                                epilog=OVERVIEW_EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verbose", action="store_true", help="debug logging and full tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    b = sub.add_parser("build", help="export graphs, build per-bucket engines, profile SPS(B)",
                       epilog=BUILD_EXAMPLES, formatter_class=fmt)
    b.add_argument("--target", help="transformers folder or .gguf file (default: SmolLM2-135M-Instruct)")
    b.add_argument("--drafter", help="DeepSpec-format checkpoint folder, or 'untrained' (default: the shipped "
                                     "drafter for the default target if any, else untrained)")
    b.add_argument("--out", required=True, type=Path, help="engine directory to create")
    b.add_argument("--max-context", type=int, default=4096, help="context capacity per request in tokens (4096)")
    b.add_argument("--target-buckets", type=_int_list, default=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                   help="packed-token buckets B of the target engines (1,2,4,8,16,32,64,128,256)")
    b.add_argument("--request-buckets", type=_int_list, default=(1, 2, 4, 8, 16),
                   help="request-count buckets R of the drafter/verify engines (1,2,4,8,16)")
    b.add_argument("--profile-context", type=int, default=128, help="past length when timing buckets (128)")
    b.add_argument("--profile-repeats", type=int, default=10, help="timed runs per bucket (10)")
    b.add_argument("--seed", type=int, default=0, help="seed of an untrained drafter's init (0)")
    b.add_argument("--drafter-lm-head", choices=("auto", "int8", "float32"), default="auto",
                   help="the drafter block's LM head: int8 weights (a quarter of the memory traffic; the drafts' "
                        "own logits are what verification uses, so output is unchanged, but near-tied drafts can "
                        "differ) or float32, the target's own head shared. auto (default): float32 for a --drafter "
                        "checkpoint you bring (drafts exactly as its source), int8 for the shipped drafter")
    b.add_argument("--weights", choices=("int4", "int8", "w8a8", "fp32"), default=None,
                   help="the target's weights: int4 / int8 block-quantized (ONNX Runtime MatMulNBits, block 32; "
                        "linear layers, LM head and embedding), w8a8 (int8 weights and per-row int8 activations, "
                        "MatMulIntegerToFloat: verification rows cost far less) or fp32 (default: int4, the fastest in "
                        "reports/quant/quant.md; fp32 with an imported DeepSpec --drafter)")
    b.add_argument("--draft-vocab", default="auto", metavar="auto|full|N",
                   help="the drafter's draft vocabulary: its LM head computes N rows (the target's N most frequent "
                        "response tokens) and every other token gets probability 0 in the drafts; output stays "
                        "exact. auto: the shipped drafter's measured size, full for any other drafter (default)")
    b.add_argument("--draft-vocab-from", default=None, metavar="FILE",
                   help="the token ranking for --draft-vocab N: a draft_vocab.json or a responses JSONL of the target "
                        "(scripts/train_drafter.py data); default <drafter folder>/draft_vocab.json")
    b.add_argument("--drafter-weights", choices=("auto", "float32", "int8", "int4", "w8a8"), default="auto",
                   help="the drafter layers' weights (int4 / int8: ONNX Runtime MatMulNBits; w8a8: int8 weights and "
                        "per-row int8 activations; all row-local): auto = the shipped "
                        "drafter's measured format, float32 (exact drafting) for any other drafter")
    b.add_argument("--drafter-context", default="auto", metavar="auto|full|SINK,RECENT",
                   help="the committed rows a drafter-context flush writes: a request's first SINK and the RECENT "
                        "before its draft (e.g. 4,32: a long prompt's middle is skipped, flushes cost less), or full; "
                        "auto = the shipped drafter's measured window, full (exact drafting) for any other drafter")
    b.add_argument("--int4-kernel", choices=("w4a8", "matmulnbits"), default="w4a8",
                   help="kernel of the int4 linear layers: w4a8 = dspark.cpu::MatMulW4A8 (default; same "
                        "arithmetic as MatMulNBits, cheap verification rows; compiled with the system C++ "
                        "compiler on first load), matmulnbits = ONNX Runtime's own op (plain ONNX Runtime "
                        "loads the graphs)")
    b.add_argument("--attention-kernel", choices=("cpu", "onnx"), default="cpu",
                   help="what runs the quantized target's attention: cpu = dspark.cpu::RaggedAttention (default; "
                        "one C++ node a layer reading only the live cache entries, compiled on first load), onnx = "
                        "ONNX Runtime ops")
    b.add_argument("--markov-draft-kernel", choices=("cpu", "onnx"), default="cpu",
                   help="what runs the drafter's greedy Markov slots: cpu = dspark.cpu::MarkovDraftGreedy (default; "
                        "one fused C++ pass per slot, compiled on first load), onnx = standard ONNX ops")
    b.add_argument("--overwrite", action="store_true", help="replace an existing engine directory")

    g = sub.add_parser("generate", help="generate text with speculative decoding",
                       epilog=GENERATE_EXAMPLES, formatter_class=fmt)
    g.add_argument("--engine-dir", required=True, type=Path, help="an engine directory made by `build`")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts-file", type=Path, help='JSONL file, one {"prompt": "..."} per line')
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template (one user turn)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="generated tokens at most (128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (per request: [seed, index])")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); the text ends before it")
    g.add_argument("--policy", default=DEFAULT_POLICY,
                   help=f"ar | fixed:K | threshold:C | dspark | dspark-async (default {DEFAULT_POLICY})")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout, in input order")
    g.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = its choice: the "
                   "physical cores)")
    g.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the engine files")
    g.add_argument("--backend", choices=("onnxruntime", "tensorrt"), default="onnxruntime",
                   help="engines to run: onnxruntime (default) or tensorrt (added by `dspark-export trt build`)")

    bench = sub.add_parser("bench", help="benchmarks: serve, acceptance, peers", epilog=BENCH_EXAMPLES,
                           formatter_class=fmt).add_subparsers(dest="bench", required=True)
    from .bench import acceptance_cli, peers_cli, serve_cli

    for name, module, summary in (
            ("serve", serve_cli, "closed-loop serving benchmark (throughput vs per-user tokens/s)"),
            ("acceptance", acceptance_cli, "offline acceptance length τ per dataset (paper Table 1, Fig. 2)"),
            ("peers", peers_cli, "single-user tokens/s vs onnxruntime-genai and transformers (same prompts, one run)")):
        module.add_arguments(bench.add_parser(name, help=summary, epilog=module.EXAMPLES, formatter_class=fmt))
    from .serve import cli as serve_cli_

    bh = bench.add_parser("http", help="closed-loop HTTP load on `serve` vs the in-process Service (TTFT, TPOT, tok/s)",
                          epilog=serve_cli_.BENCH_EXAMPLES, formatter_class=fmt)
    serve_cli_.add_bench_arguments(bh)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI/uvicorn; Ray Serve with --replicas N)",
                        epilog=serve_cli_.EXAMPLES, formatter_class=fmt)
    serve_cli_.add_arguments(sv)

    pr = sub.add_parser("profile", help="re-measure the SPS(B) table of an engine directory",
                        epilog=PROFILE_EXAMPLES, formatter_class=fmt)
    pr.add_argument("--engine-dir", required=True, type=Path, help="an engine directory made by `build`")
    pr.add_argument("--context", type=int, default=128, help="past length in tokens (128)")
    pr.add_argument("--repeats", type=int, default=10, help="timed runs per bucket (10)")
    pr.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = its choice: the "
                    "physical cores); profile with the threads the engines will run with")

    rp = sub.add_parser("report", help="HTML report of an engine directory (engines, SPS(B), calibration, benchmarks)",
                        epilog=REPORT_EXAMPLES, formatter_class=fmt)
    rp.add_argument("dir", type=Path, help="an engine directory made by `build`")
    rp.add_argument("--out", type=Path, default=None,
                    help="output folder (default <dir>/report, listed in the manifest; a folder outside the engine "
                         "directory leaves it untouched)")
    rp.add_argument("--acceptance", type=Path, help="a `bench acceptance` result JSON to include")
    rp.add_argument("--serve", type=Path, help="a `bench serve` result JSON to include")
    rp.add_argument("--peers", type=Path, help="a `bench peers` result JSON to include")
    rp.add_argument("--calibration", type=Path,
                    help="a calibration.json to show (default: the one the engine directory records)")

    ep = sub.add_parser("export-profile", help="write SPS(B) and STS calibration for SGLang / TensorRT-LLM (or generic)",
                        epilog=EXPORT_PROFILE_EXAMPLES, formatter_class=fmt)
    ep.add_argument("dir", type=Path, help="an engine directory made by `build`")
    ep.add_argument("--format", required=True, choices=("sglang", "trtllm", "generic", "vllm"),
                    help="target file format")
    ep.add_argument("--out", required=True, type=Path, help="folder to write the files into (created)")

    i = sub.add_parser("inspect", help="summarise and verify an engine directory; check its graphs against TensorRT",
                       epilog=INSPECT_EXAMPLES, formatter_class=fmt)
    i.add_argument("dir", type=Path, help="an engine directory made by `build`")
    i.add_argument("--trt-compat", action="store_true",
                   help="check every node (function bodies and If branches included) against TensorRT's ONNX "
                        "operator table; exit 1 if one would not parse")
    i.add_argument("--trt-version", type=int, default=10, help="TensorRT major version to check against (10)")
    i.add_argument("--trt-minor", type=int, default=15,
                   help="TensorRT minor release targeted (15, the table's edition); below 9 the plugin nodes block, "
                        "since ahead-of-time Python plugins need TensorRT >= 10.9")
    i.add_argument("--json", action="store_true", help="one JSON object on stdout instead of tables")

    t = sub.add_parser("trt", help="TensorRT backend: plan (no TensorRT needed), build, compare",
                       epilog=TRT_EXAMPLES, formatter_class=fmt).add_subparsers(dest="trt", required=True)
    tp = t.add_parser("plan", help="lower the graphs and derive every engine's optimization profile (JSON); "
                                   "needs no TensorRT", epilog=TRT_EXAMPLES, formatter_class=fmt)
    tb = t.add_parser("build", help="build TensorRT engines (one plan per graph, one profile per bucket) into an "
                                    "engine directory and profile them (TensorRT >= 10.9, GPU)",
                      epilog=TRT_EXAMPLES, formatter_class=fmt)
    tc = t.add_parser("compare", help="compare every TensorRT engine with ONNX Runtime on the same inputs "
                                      "(Polygraphy comparator); exit 1 on a mismatch",
                      epilog=TRT_EXAMPLES, formatter_class=fmt)
    for q in (tp, tb, tc):
        q.add_argument("--engine-dir", required=True, type=Path, help="an engine directory made by `build`")
    for q in (tp, tb):
        q.add_argument("--context", type=int, default=128, help="past length of the profiles' opt point and of "
                                                                "the SPS timing (128)")
    tb.add_argument("--repeats", type=int, default=10, help="timed runs per bucket (10)")
    tb.add_argument("--opt-level", type=int, default=3, choices=range(6), help="builder optimization level (3)")
    tb.add_argument("--overwrite", action="store_true", help="replace TensorRT engines already in the directory")
    tc.add_argument("--atol", type=float, default=1e-3, help="absolute tolerance (1e-3)")
    tc.add_argument("--rtol", type=float, default=1e-3, help="relative tolerance (1e-3)")
    tc.add_argument("--graphs", type=lambda x: tuple(x.split(",")), default=None,
                    help="comma-separated graphs to compare (all)")
    return p


def _progress(msg: str, t0: float = time.perf_counter()) -> None:
    print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def cmd_build(args) -> int:
    from .pipeline import BuildConfig, build_engine_dir

    if not args.verbose:  # our own stage lines say what is happening; keep the libraries' bars quiet
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

    cfg = BuildConfig(out=args.out, target=args.target, drafter=args.drafter, target_buckets=args.target_buckets,
                      request_buckets=args.request_buckets, max_context=args.max_context,
                      profile_context=args.profile_context, profile_repeats=args.profile_repeats,
                      seed=args.seed, drafter_lm_head=args.drafter_lm_head, overwrite=args.overwrite,
                      weights=args.weights, draft_vocab=args.draft_vocab, draft_vocab_from=args.draft_vocab_from,
                      drafter_weights=args.drafter_weights, drafter_context=args.drafter_context,
                      int4_kernel=args.int4_kernel, markov_draft_kernel=args.markov_draft_kernel,
                      attention_kernel=args.attention_kernel)
    result = build_engine_dir(cfg, progress=_progress)
    _progress(f"built {result.out} ({result.size_bytes / 2**20:.0f} MiB)")
    print(json.dumps({"out": str(result.out), "size_bytes": result.size_bytes,
                      "seconds": {k: round(v, 2) for k, v in result.seconds.items()},
                      "sps": {row["B"]: row["sps"] for row in result.profile["target"]},
                      "layout_cost": _layout_cost(result.profile), "warnings": result.profile["warnings"],
                      "report": str(result.out / "report" / "index.html")
                      if (result.out / "report" / "index.html").is_file() else None}))
    return 0


def cmd_generate(args) -> int:
    from tqdm import tqdm

    from .datasets import read_prompts
    from .runtime.api import Runtime
    from .runtime.policies import parse_policy
    from .runtime.request import GenerationResult, SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=tuple(args.stop))
    params.validate()          # bad argv exits 2 before the engines load; the generator checks again at submit
    policy = parse_policy(args.policy)
    if args.prompt == "":       # refused before the engines load (a chat template would wrap it into a prompt)
        raise RequestError("--prompt: expected text, found an empty string")
    items = [(args.prompt, None)] if args.prompt is not None else read_prompts(args.prompts_file)
    _progress(f"loading {args.engine_dir}")
    rt = Runtime.open(args.engine_dir, policy=policy, verify=not args.no_verify, backend=args.backend,
                      threads=args.threads)
    if not rt.engines.manifest.runtime.get("drafter_trained", False) and rt.policy.drafts:
        _progress("note: this engine directory's drafter is untrained: drafts are rarely accepted")
    _progress(f"generating {len(items)} prompt(s) with policy {rt.policy}")
    valid = [i for i, (_, err) in enumerate(items) if err is None]
    bar = tqdm(total=len(valid), desc="generate", unit="prompt", file=sys.stderr, disable=len(valid) < 2)
    done = iter(rt.generate_text([items[i][0] for i in valid], params, chat=args.chat,
                                 on_finish=lambda index, result: bar.update(1)))
    bar.close()
    results = [next(done) if err is None else GenerationResult(finish_reason="error", error=err, text="")
               for _, err in items]
    for n, ((prompt, err), r) in enumerate(zip(items, results), 1):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": r.text, "token_ids": r.token_ids,
                              "finish_reason": r.finish_reason, "stop_reason": r.stop_reason, "error": r.error, "policy": str(rt.policy),
                              "stats": r.stats.to_dict()}, ensure_ascii=False), flush=True)
        elif r.error:
            print(f"prompt {n}: error: {r.error}", file=sys.stderr)
        else:
            print(r.text, flush=True)
            s = r.stats
            _progress(f"{s.completion_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, τ={s.acceptance_length:.2f}, "
                      f"finish={r.finish_reason}")
    hint = chat_hint(results, args.chat, bool(getattr(rt.tokenizer, "chat_template", None)))
    if hint:
        _progress(hint)
    failed = sum(r.finish_reason == "error" for r in results)
    if failed:
        _progress(f"{failed} of {len(results)} prompt(s) failed")
    return 1 if failed else 0


def chat_hint(results, chat: bool, has_template: bool) -> str | None:
    """The note `generate` prints when prompts sent without --chat stopped at their first token although the
    tokenizer has a chat template: an instruct model given a bare question often ends its turn at once (SmolLM2
    answers "What is the capital of France?" with <|im_end|>), which looks like a broken engine."""
    if chat or not has_template:
        return None
    answered = [r for r in results if r.finish_reason != "error"]
    ended = sum(r.finish_reason == "stop" and len(r.token_ids) <= 1 and isinstance(r.stop_reason, int)
                for r in answered)   # a stop token id, not a --stop string
    if not ended:
        return None
    return (f"note: {ended} of {len(answered)} prompt(s) ended at their first token; this model has a chat template, "
            "and an instruct model given raw text often ends its turn at once: add --chat")


def cmd_bench(args) -> int:
    from .bench import acceptance_cli, peers_cli, serve_cli

    if args.bench == "http":
        from .serve import cli as serve_cli_

        print(serve_cli_.run_bench(args, _progress))
        return 0
    module = {"serve": serve_cli, "acceptance": acceptance_cli, "peers": peers_cli}[args.bench]
    print(module.run(args, _progress))
    return 0


def cmd_serve(args) -> int:
    from .serve import cli as serve_cli_

    return serve_cli_.run(args, _progress)


def cmd_profile(args) -> int:
    from .pipeline import reprofile

    sps = reprofile(args.engine_dir, args.context, args.repeats, progress=_progress, threads=args.threads)
    print(json.dumps({"context_len": sps["context_len"], "sps": {row["B"]: row["sps"] for row in sps["target"]},
                      "layout_cost": _layout_cost(sps), "warnings": sps["warnings"]}))
    return 0


def _layout_cost(sps: dict) -> dict | None:
    """The profile's layout-cost fit in one line of the command's JSON (docs/ARCHITECTURE.md, "The layout cost")."""
    fit = sps.get("attention")
    return {k: fit.get(k) for k in ("ms_per_row_entry", "ms_per_slot_entry", "max_error_pct")} if fit else None


def cmd_report(args) -> int:
    from .report import ReportInputs, load_json_input, write_report

    inputs = ReportInputs(
        acceptance=load_json_input(args.acceptance, "--acceptance", ("datasets", "block_size")) if args.acceptance else None,
        serve=load_json_input(args.serve, "--serve", ("results",)) if args.serve else None,
        peers=load_json_input(args.peers, "--peers", ("results",)) if args.peers else None,
        calibration=load_json_input(args.calibration, "--calibration", ("confidence_temperature",))
        if args.calibration else None,
        calibration_source=str(args.calibration) if args.calibration else None)
    _progress(f"rendering the report of {args.dir}")
    path = write_report(args.dir, args.out, inputs)
    _progress(f"wrote {path}")
    print(json.dumps({"html": str(path), "files": sorted(p.name for p in path.parent.iterdir())}))
    return 0


def cmd_export_profile(args) -> int:
    from .engines.export_profile import export_profile

    result = export_profile(args.dir, args.format, args.out)
    for flag, path in result["flags"].items():
        _progress(f"{flag} {path}")
    for note in result["notes"]:
        _progress(f"note: {note}")
    print(json.dumps(result))
    return 0


def cmd_inspect(args) -> int:
    from .engines.inspect import inspect_engine_dir

    report = inspect_engine_dir(args.dir, trt_compat=args.trt_compat, trt_version=args.trt_version,
                                trt_minor=args.trt_minor)
    print(json.dumps(report.to_dict()) if args.json else report.format_text())
    return report.exit_code


def cmd_trt(args) -> int:
    if args.trt == "plan":
        from .engines.manifest import Manifest
        from .engines.trt.builder import plan_build, plan_summary

        print(json.dumps(plan_summary(plan_build(Manifest.load(args.engine_dir, verify=True), args.context))))
        return 0
    if args.trt == "build":
        from .engines.trt.builder import TrtBuildConfig, build_trt_engines

        sps = build_trt_engines(TrtBuildConfig(args.engine_dir, context_len=args.context, repeats=args.repeats,
                                               builder_optimization_level=args.opt_level,
                                               overwrite=args.overwrite), progress=_progress)
        print(json.dumps({"sps": {row["B"]: row["sps"] for row in sps["target"]}, "layout_cost": _layout_cost(sps),
                          "warnings": sps["warnings"]}))
        return 0
    from .engines.trt.compare import compare_backends

    result = compare_backends(args.engine_dir, atol=args.atol, rtol=args.rtol, graphs=args.graphs,
                              progress=_progress)
    print(json.dumps(result))
    return 0 if result["passed"] else 1


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (timeout, kill, docker stop) cleans up like Ctrl-C


#: commands that run engines, for which the `dspark-export` command shares one ORT thread pool
_ENGINE_COMMANDS = ("build", "generate", "profile", "bench", "serve", "trt")


def main(argv: list[str] | None = None, shared_thread_pool: bool = False) -> int:
    """Exit codes: 0 success; 1 some prompts failed (each reported) or, for `inspect --trt-compat`, a graph
    would not parse in TensorRT; 2 an error (one line on stderr;
    the trace with --verbose); 130 interrupted.

    `shared_thread_pool`: run the command's ONNX Runtime sessions on one process-wide pool of its --threads
    (`engines.ort.runner.use_shared_thread_pool`). The `dspark-export` command (`console_main`) owns its process
    and turns it on; an in-process caller leaves it off, since ORT then refuses any session of the process that
    keeps threads of its own."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if shared_thread_pool and args.command in _ENGINE_COMMANDS:
            from .engines.ort.runner import use_shared_thread_pool
            use_shared_thread_pool(getattr(args, "threads", 0) or 0)
        return {"build": cmd_build, "generate": cmd_generate, "profile": cmd_profile, "bench": cmd_bench,
                "inspect": cmd_inspect, "report": cmd_report,
                "export-profile": cmd_export_profile, "trt": cmd_trt, "serve": cmd_serve}[args.command](args)
    except DsparkExportError as e:
        if args.verbose:
            raise
        print(f"dspark-export {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dspark-export {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug or an unforeseen input: still one line, the trace with --verbose
        if args.verbose:
            raise
        print(f"dspark-export {args.command}: internal error: {type(e).__name__}: {e} "
              "(run with --verbose for the trace)", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def console_main() -> int:
    """The `dspark-export` command: `main` on the process's shared ORT thread pool."""
    return main(shared_thread_pool=True)


if __name__ == "__main__":
    sys.exit(console_main())
