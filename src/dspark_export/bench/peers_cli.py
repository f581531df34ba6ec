"""Command-line glue of the peer benchmark: `dspark-export bench peers`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from .common import csv_list, write_outputs
from .peers import DEFAULT_DATASETS, DEFAULT_POLICIES, SYSTEMS, PeersBenchConfig, markdown_table, run_peers_bench, \
    write_reports

EXAMPLES = """examples:
  dspark-export bench peers --engine-dir engines/smollm2 --max-new-tokens 64 --json peers.json
  dspark-export bench peers --engine-dir engines/smollm2 --prompt "What is 12*7?" --prompt "Write a haiku" \\
      --systems ar,dspark,transformers --policies dspark,fixed:3 --out-dir reports/peers
onnxruntime-genai is optional (pip install 'dspark-export[peers]'), llama.cpp too (pip install
'dspark-export[llamacpp]', built from source with the flags in docs/PEERS.md); a system that cannot run is skipped
with the reason. The ratio of every system is to dspark-export ar, measured in the same run.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-dir", required=True, type=Path, help="a built engine directory")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", type=Path, help='JSONL file, one {"prompt": "..."} per line')
    parser.add_argument("--datasets", type=csv_list, default=list(DEFAULT_DATASETS),
                        help=f"without prompts: the first prompt of each dataset (default {','.join(DEFAULT_DATASETS)})")
    parser.add_argument("--prompts-per-dataset", type=int, default=1,
                        help="without prompts: the first K prompts of each dataset (1)")
    parser.add_argument("--datasets-dir", type=Path, default=None,
                        help="folder of <name>.jsonl files (default ../shared/eval_datasets from the repo root)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt at most (64)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--systems", type=csv_list, default=list(SYSTEMS),
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (default all)")
    parser.add_argument("--policies", type=csv_list, default=list(DEFAULT_POLICIES),
                        help=f"dspark-export policies tried for 'DSpark (best)' (default {','.join(DEFAULT_POLICIES)})")
    parser.add_argument("--hf-model", type=Path, default=None,
                        help="transformers folder of the target (default: the one the engine directory was built from)")
    parser.add_argument("--ortgenai-model", type=Path, default=None,
                        help="an onnxruntime-genai model folder (default: built once from --hf-model, fp32, cpu)")
    parser.add_argument("--ortgenai-int4-model", type=Path, default=None,
                        help="an onnxruntime-genai int4 model folder (default: built once from --hf-model, -p int4 -e cpu)")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="the GGUF llama.cpp runs (default: the engine directory's source GGUF, or the embedded "
                             "default's Q4_1 file)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of every system (2)")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10,
                        help="prompt_lookup_num_tokens of transformers-pld (10)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="interleaved rounds over all prompts; per-prompt time = the median over rounds, and "
                             "each ratio to ar is also given per round (1)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up generation")
    parser.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    parser.add_argument("--out-dir", type=Path, default=None, help="write peers.json, peers.md and peers.png here")


def run(args: argparse.Namespace, progress: Callable[[str], None]) -> str:
    """Run from parsed flags; writes --json / --out-dir; returns the markdown table.

    Raises:
        DsparkExportError: a bad configuration (named field) or engine directory.
    """
    prompts = list(args.prompt)
    if args.prompts_file is not None:
        from ..datasets import read_prompts

        for prompt, err in read_prompts(args.prompts_file):
            if err:
                from ..errors import ConfigError

                raise ConfigError(err)
            prompts.append(prompt)
    cfg = PeersBenchConfig(engine_dir=args.engine_dir, prompts=tuple(prompts), datasets=tuple(args.datasets),
                           datasets_dir=args.datasets_dir, max_new_tokens=args.max_new_tokens, chat=not args.no_chat,
                           systems=tuple(args.systems), policies=tuple(args.policies), hf_model=args.hf_model,
                           ortgenai_model=args.ortgenai_model, prompt_lookup_tokens=args.prompt_lookup_tokens,
                           warmup=not args.no_warmup, ortgenai_int4_model=args.ortgenai_int4_model, gguf=args.gguf,
                           threads=args.threads, prompts_per_dataset=args.prompts_per_dataset,
                           repeats=args.repeats)
    result = run_peers_bench(cfg, progress)
    write_outputs(result, args, write_reports, progress)
    return markdown_table(result)
