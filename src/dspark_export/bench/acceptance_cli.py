"""Command-line glue of the acceptance benchmark: `dspark-export bench acceptance`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from .acceptance import (DEFAULT_DATASETS, DEFAULT_SEED, AcceptanceBenchConfig, markdown_table,
                         run_acceptance_bench, write_reports)

EXAMPLES = """examples:
  dspark-export bench acceptance --engine-dir engines/smollm2 --out-dir reports/acceptance
  dspark-export bench acceptance --engine-dir engines/smollm2 --datasets gsm8k,humaneval,mt-bench \\
      --samples 2 --max-new-tokens 32 --policy fixed:4 --json acceptance.json
"""


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `bench acceptance` flags."""
    parser.add_argument("--engine-dir", required=True, type=Path, help="a built engine directory")
    parser.add_argument("--datasets", type=_csv, default=list(DEFAULT_DATASETS),
                        help=f"comma-separated dataset names (default {','.join(DEFAULT_DATASETS)})")
    parser.add_argument("--datasets-dir", type=Path, default=None,
                        help="folder of <name>.jsonl files (default ../shared/eval_datasets from the repo root)")
    parser.add_argument("--samples", type=int, default=20,
                        help="rows per dataset; seeded shuffle when the file has more (default 20)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--policy", default=None,
                        help="fixed:K, K <= the engine's block size γ (default fixed:γ); other policies are refused")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens per request (default 256)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"row shuffle and sampling seed (default {DEFAULT_SEED})")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up request")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0 = ORT's choice)")
    parser.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    parser.add_argument("--out-dir", type=Path, default=None, help="write JSON, markdown and the PNG plot here")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> str:
    """Run the benchmark from parsed flags; writes --json / --out-dir; returns the markdown table.

    Raises:
        DsparkExportError: a bad configuration (named field) or engine directory.
    """
    cfg = AcceptanceBenchConfig(
        engine_dir=args.engine_dir, datasets=tuple(args.datasets), datasets_dir=args.datasets_dir,
        samples=args.samples, temperature=args.temperature, policy=args.policy,
        max_new_tokens=args.max_new_tokens, seed=args.seed, chat=not args.no_chat, warmup=not args.no_warmup,
        threads=args.threads)
    result = run_acceptance_bench(cfg, progress)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        progress(f"wrote {args.json}")
    if args.out_dir is not None:
        for path in write_reports(result, args.out_dir).values():
            progress(f"wrote {path}")
    identity = result["identity"]
    return (markdown_table(result) + f"\n\ngreedy identity vs ar: {identity['identical']} "
            f"({identity['checked']} checked)")
