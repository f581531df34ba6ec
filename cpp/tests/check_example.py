#!/usr/bin/env python3
"""The C++ example (examples/cpp/generate.cpp) against the Python runtime: same greedy token ids.

    python cpp/tests/check_example.py --example build/cpp/dspark_generate --engine-dir DIR [--chat]
    DSPARK_REAL_ENGINE_DIR=engines/smollm2 python cpp/tests/check_example.py --example ... \
        --engine-dir-env DSPARK_REAL_ENGINE_DIR --chat        # the real-model check (exit 77 = skipped)

Runs the example with --json for a few prompts and policies and compares its token ids with
`Runtime.generate_text` / `generate_ids` in this process. Exit 0 equal, 1 different, 77 skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from dspark_export.runtime.api import Runtime
from dspark_export.runtime.request import SamplingParams

TEXT_PROMPTS = ["What is the capital of France?", "Write a haiku about GPUs."]
ID_PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--example", required=True)
    ap.add_argument("--engine-dir")
    ap.add_argument("--engine-dir-env", help="read the engine directory from this environment variable; skip if unset")
    ap.add_argument("--chat", action="store_true", help="text prompts with the chat template (real tokenizer)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    engine_dir = args.engine_dir
    if args.engine_dir_env:
        engine_dir = os.environ.get(args.engine_dir_env)
        if not engine_dir:
            print(f"skipped: set {args.engine_dir_env} to an engine directory built by `dspark-export build`")
            return 77
    rt = Runtime.open(engine_dir, policy="ar")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    failures = 0
    for policy in ("dspark", "fixed:3"):
        cases = []
        if args.chat:
            expected = rt.generate_text(TEXT_PROMPTS, params, chat=True)
            cases = [(["--prompt", p, "--chat"], e) for p, e in zip(TEXT_PROMPTS, expected)]
        else:
            expected = rt.generate_ids(ID_PROMPTS, [params] * len(ID_PROMPTS))
            cases = [(["--ids", ",".join(map(str, p))], e) for p, e in zip(ID_PROMPTS, expected)]
        for extra, want in cases:
            cmd = [args.example, "--engine-dir", str(engine_dir), "--json", "--policy", policy,
                   "--max-new-tokens", str(args.max_new_tokens), *extra]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                print(f"FAIL {cmd}: exit {proc.returncode}\n{proc.stderr}")
                failures += 1
                continue
            got = json.loads(proc.stdout)
            same = got["token_ids"] == want.token_ids
            print(f"{'ok  ' if same else 'FAIL'} policy={policy} {extra[:2]}: C++ {len(got['token_ids'])} tokens, "
                  f"tau {got['stats']['acceptance_length']:.2f}, {got['stats']['tokens_per_s']:.1f} tok/s; "
                  f"Python {len(want.token_ids)} tokens")
            if not same:
                print(f"  C++    {got['token_ids']}\n  Python {want.token_ids}")
                failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
