#!/usr/bin/env python
"""Closed-loop serving benchmark: throughput vs per-user tokens/s per policy and concurrency.

Same as `dspark-export bench serve` (see `dspark_export.bench.serve` for what is measured). Prints the
markdown table on stdout and progress lines on stderr.

Usage:
    python scripts/bench_serve.py --engine-dir engines/smollm2 --concurrency 1,4 --requests 8 \
        --max-new-tokens 48 --json serve.json --out-dir reports/serve
Exit codes: 0 done, 2 an error (one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time

from dspark_export.bench.serve_cli import add_arguments, run
from dspark_export.errors import DsparkExportError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {line}", file=sys.stderr, flush=True)

    try:
        table = run(args, progress)
    except DsparkExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
