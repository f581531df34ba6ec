"""Command-line glue of the serving benchmark: `dspark-export bench serve` and scripts/bench_serve.py."""

from __future__ import annotations

import argparse
from typing import Callable

from .common import add_common_arguments, csv_list, int_list, write_outputs
from .serve import (DEFAULT_CONCURRENCY, DEFAULT_DATASETS, DEFAULT_POLICIES, ServeBenchConfig, markdown_table,
                    run_serve_bench, write_reports)

EXAMPLES = """examples:
  dspark-export bench serve --engine-dir engines/smollm2 --concurrency 1,4 --requests 8 --max-new-tokens 48 \\
      --out-dir reports/serve
  dspark-export bench serve --engine-dir engines/smollm2 --policies ar,dspark-async --json serve.json
  dspark-export bench serve --engine-dir engines/smollm2 --concurrency 2,8 --requests 16 --repeats 3
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bench serve` flags (shared by `dspark-export bench serve` and scripts/bench_serve.py)."""
    add_common_arguments(parser, datasets=DEFAULT_DATASETS, max_new_tokens=128, seed=0,
                         warmup_help="skip the unmeasured warm-up before each run",
                         out_help="write JSON, markdown and PNG plots here")
    parser.add_argument("--concurrency", type=int_list, default=list(DEFAULT_CONCURRENCY),
                        help="comma-separated concurrency levels C (default 1,2,4,8,16)")
    parser.add_argument("--policies", type=csv_list, default=list(DEFAULT_POLICIES),
                        help=f"comma-separated policies (default {','.join(DEFAULT_POLICIES)})")
    parser.add_argument("--requests", type=int, default=None,
                        help="completed requests per (policy, C) (default max(4, 2·C))")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measured runs per (policy, C), policies interleaved; rows report medians and "
                             "the paired ratio to ar (default 1)")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> str:
    """Run the benchmark from parsed flags; writes --json / --out-dir; returns the markdown table.

    Raises:
        DsparkExportError: a bad configuration (named field) or engine directory.
    """
    cfg = ServeBenchConfig(
        engine_dir=args.engine_dir, concurrency=tuple(args.concurrency), policies=tuple(args.policies),
        requests=args.requests, datasets=tuple(args.datasets), datasets_dir=args.datasets_dir,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        chat=not args.no_chat, warmup=not args.no_warmup, threads=args.threads,
        repeats=args.repeats)
    result = run_serve_bench(cfg, progress)
    write_outputs(result, args, write_reports, progress)
    return markdown_table(result)
