"""Command-line glue of the HTTP load benchmark: `dspark-export bench http` and scripts/bench_http.py."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from .common import csv_list, int_list, write_outputs
from .http import HttpBenchConfig, markdown_table, run_http_bench, write_reports

EXAMPLES = """examples:
  dspark-export bench http --engine-dir engines/smollm2 --concurrency 1,2,4,8,16 --out-dir reports/http
  dspark-export bench http --engine-dir engines/smollm2 --concurrency 1,4 --requests 8 --repeats 1 --json http.json
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine-dir", required=True, help="a built engine directory")
    p.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16],
                   help="comma-separated closed-loop client counts C (default 1,2,4,8,16)")
    p.add_argument("--requests", type=int, default=None, help="completed requests per run (default max(4, C))")
    p.add_argument("--datasets", type=csv_list, default=["gsm8k", "mt-bench"],
                   help="comma-separated dataset names (default gsm8k,mt-bench)")
    p.add_argument("--datasets-dir", default=None, help="folder of <name>.jsonl files (default ../shared/eval_datasets)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--policy", default="dspark", help="verification policy of both modes (default dspark)")
    p.add_argument("--repeats", type=int, default=2, help="runs per (mode, C), modes interleaved (default 2)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads of each engine (0 = its choice)")
    p.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up")
    p.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--out-dir", type=Path, default=None, help="write JSON and markdown here")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> str:
    cfg = HttpBenchConfig(engine_dir=args.engine_dir, concurrency=tuple(args.concurrency), requests=args.requests,
                          datasets=tuple(args.datasets), datasets_dir=args.datasets_dir,
                          max_new_tokens=args.max_new_tokens, policy=args.policy, repeats=args.repeats,
                          threads=args.threads, warmup=not args.no_warmup)
    result = run_http_bench(cfg, progress)
    write_outputs(result, args, write_reports, progress)
    return markdown_table(result)
