"""Command-line glue of the acceptance benchmark: `dspark-export bench acceptance`."""

from __future__ import annotations

import argparse
from typing import Callable

from .acceptance import (DEFAULT_DATASETS, DEFAULT_SEED, AcceptanceBenchConfig, markdown_table,
                         run_acceptance_bench, write_reports)
from ..engines.manifest import write_json_atomic
from .common import add_common_arguments, write_outputs

EXAMPLES = """examples:
  dspark-export bench acceptance --engine-dir engines/smollm2 --out-dir reports/acceptance
  dspark-export bench acceptance --engine-dir engines/smollm2 --datasets gsm8k,humaneval,mt-bench \\
      --samples 2 --max-new-tokens 32 --policy fixed:4 --json acceptance.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bench acceptance` flags."""
    add_common_arguments(parser, datasets=DEFAULT_DATASETS, max_new_tokens=256, seed=DEFAULT_SEED,
                         warmup_help="skip the unmeasured warm-up request",
                         out_help="write JSON, markdown and the PNG plot here")
    parser.add_argument("--samples", type=int, default=20,
                        help="rows per dataset; seeded shuffle when the file has more (default 20)")
    parser.add_argument("--policy", default=None,
                        help="fixed:K, K <= the engine's block size γ (default fixed:γ), or ar (speed baseline); "
                             "scheduling policies are refused")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests decoded at once (default: the engine's largest request bucket); "
                             "1 measures single-user tokens/s")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> str:
    """Run the benchmark from parsed flags; writes --json / --out-dir; returns the markdown table.

    Raises:
        DsparkExportError: a bad configuration (named field) or engine directory.
    """
    cfg = AcceptanceBenchConfig(
        engine_dir=args.engine_dir, datasets=tuple(args.datasets), datasets_dir=args.datasets_dir,
        samples=args.samples, temperature=args.temperature, policy=args.policy,
        max_new_tokens=args.max_new_tokens, seed=args.seed, chat=not args.no_chat, warmup=not args.no_warmup,
        threads=args.threads, max_concurrency=args.max_concurrency)
    def checkpoint(partial: dict) -> None:  # --json holds every finished dataset, even if the run stops
        if args.json is not None and not partial["complete"]:
            write_json_atomic(args.json, partial)

    result = run_acceptance_bench(cfg, progress, on_dataset=checkpoint)
    write_outputs(result, args, write_reports, progress)
    identity = result["identity"]
    return (markdown_table(result) + f"\n\ngreedy identity vs ar: {identity['identical']} "
            f"({identity['checked']} checked)")
