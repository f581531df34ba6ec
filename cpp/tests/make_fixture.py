#!/usr/bin/env python3
"""Build the C++ tests' fixture: a tiny random engine directory plus the Python runtime's outputs on it.

    python cpp/tests/make_fixture.py --out build/cpp/fixture

Writes <out>/engines (a complete engine directory built from a tiny random Llama, as the Python tests
build it) and <out>/expected.json: for each prompt, the greedy token ids and text the Python runtime
generates (policy `ar`; every policy must give the same ids under greedy decoding).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import make_tiny_target, make_tiny_tokenizer  # noqa: E402

from dspark_export.pipeline import BuildConfig, build_engine_dir  # noqa: E402
from dspark_export.runtime.api import Runtime  # noqa: E402
from dspark_export.runtime.request import SamplingParams  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41], [100] * 11, [7, 3, 9, 200, 17, 18, 19, 20, 21], [12]]
TEXT_PROMPT = "Hi there"
MAX_NEW_TOKENS = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    out = args.out.resolve()
    if (out / "expected.json").is_file():
        print(f"{out}: fixture exists", file=sys.stderr)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "target"
        make_tiny_target("llama", seed=3).save_pretrained(target)
        make_tiny_tokenizer().save_pretrained(target)
        if (out / "engines").exists():
            shutil.rmtree(out / "engines")
        build_engine_dir(BuildConfig(out=out / "engines", target=str(target), drafter="untrained",
                                     target_buckets=(1, 2, 4, 8, 16, 32, 64), request_buckets=(1, 2, 4),
                                     max_context=96, profile_context=16, profile_repeats=2, block_size=4,
                                     markov_rank=8))
    rt = Runtime.open(out / "engines", policy="ar")
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    results = rt.generate_ids(PROMPTS, [params] * len(PROMPTS))
    [chat] = rt.generate_text([TEXT_PROMPT], params, chat=True)
    expected = {
        "max_new_tokens": MAX_NEW_TOKENS,
        "vocab_size": int(rt.engines.manifest.runtime["vocab_size"]),
        "max_context": int(rt.engines.manifest.runtime["max_context"]),
        "prompts": [{"prompt": p, "token_ids": r.token_ids, "finish_reason": r.finish_reason}
                    for p, r in zip(PROMPTS, results)],
        "chat": {"text": TEXT_PROMPT, "token_ids": chat.token_ids, "output_text": chat.text,
                 "finish_reason": chat.finish_reason},
    }
    tmp_file = out / "expected.json.tmp"
    tmp_file.write_text(json.dumps(expected, indent=1))
    tmp_file.replace(out / "expected.json")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
