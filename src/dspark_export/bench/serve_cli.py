"""Command-line glue of the serving benchmark: `dspark-export bench serve` and scripts/bench_serve.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from .serve import (DEFAULT_CONCURRENCY, DEFAULT_DATASETS, DEFAULT_POLICIES, ServeBenchConfig, markdown_table,
                    run_serve_bench, write_reports)

EXAMPLES = """examples:
  dspark-export bench serve --engine-dir engines/smollm2 --concurrency 1,4 --requests 8 --max-new-tokens 48 \\
      --out-dir reports/serve
  dspark-export bench serve --engine-dir engines/smollm2 --policies ar,dspark-async --json serve.json
"""


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(item) for item in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, found {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bench serve` flags (shared by `dspark-export bench serve` and scripts/bench_serve.py)."""
    parser.add_argument("--engine-dir", required=True, type=Path, help="a built engine directory")
    parser.add_argument("--concurrency", type=_ints, default=list(DEFAULT_CONCURRENCY),
                        help="comma-separated concurrency levels C (default 1,2,4,8,16)")
    parser.add_argument("--policies", type=_csv, default=list(DEFAULT_POLICIES),
                        help=f"comma-separated policies (default {','.join(DEFAULT_POLICIES)})")
    parser.add_argument("--requests", type=int, default=None,
                        help="completed requests per (policy, C) (default max(4, 2·C))")
    parser.add_argument("--datasets", type=_csv, default=list(DEFAULT_DATASETS),
                        help=f"comma-separated dataset names (default {','.join(DEFAULT_DATASETS)})")
    parser.add_argument("--datasets-dir", type=Path, default=None,
                        help="folder of <name>.jsonl files (default ../shared/eval_datasets from the repo root)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="prompt shuffle and sampling seed (default 0)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up before each run")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = ORT's choice)")
    parser.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    parser.add_argument("--out-dir", type=Path, default=None, help="write JSON, markdown and PNG plots here")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> str:
    """Run the benchmark from parsed flags; writes --json / --out-dir; returns the markdown table.

    Raises:
        DsparkExportError: a bad configuration (named field) or engine directory.
    """
    cfg = ServeBenchConfig(
        engine_dir=args.engine_dir, concurrency=tuple(args.concurrency), policies=tuple(args.policies),
        requests=args.requests, datasets=tuple(args.datasets), datasets_dir=args.datasets_dir,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        chat=not args.no_chat, warmup=not args.no_warmup, threads=args.threads)
    result = run_serve_bench(cfg, progress)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        progress(f"wrote {args.json}")
    if args.out_dir is not None:
        for path in write_reports(result, args.out_dir).values():
            progress(f"wrote {path}")
    return markdown_table(result)
