#!/usr/bin/env python
"""Offline acceptance length τ (T = 0, bonus included) of a drafter per draft vocabulary size N.

Replays drafting rounds on cached target features of greedy responses (`training.calibration.replay_rounds`,
the protocol `scripts/train_drafter.py calibrate` uses) once per N, the drafts restricted to the top N of the
ranking (`training.draft_vocab.select_d2t`), exactly as the exported block drafts with `build --draft-vocab N`.

Usage:
    python scripts/bench_draft_vocab_tau.py --run runs/smollm2 \
        --drafter src/dspark_export/assets/drafters/smollm2-135m-instruct \
        --sizes 1024,2048,4096,8192,16384,full --out reports/drafter/draft-vocab-tau.json
Exit codes: 0 done, 2 an error (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run folder holding features/calibration (train_drafter.py)")
    p.add_argument("--drafter", required=True, help="drafter folder (DeepSpec layout)")
    p.add_argument("--ranking", help="draft_vocab.json (default <drafter>/draft_vocab.json)")
    p.add_argument("--sizes", default="1024,2048,4096,8192,16384,full")
    p.add_argument("--stride", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from dspark_export.errors import DsparkExportError
    from dspark_export.modeling.checkpoint import load_drafter
    from dspark_export.modeling.target import default_target_path, load_target
    from dspark_export.training.calibration import replay_rounds
    from dspark_export.training.draft_vocab import DRAFT_VOCAB_FILE, read_ranking, select_d2t
    from dspark_export.training.features import FeatureCache

    try:
        target = load_target(default_target_path())
        drafter = load_drafter(Path(args.drafter), target).eval()
        vocab = drafter.config.vocab_size
        ranking = read_ranking(args.ranking or Path(args.drafter) / DRAFT_VOCAB_FILE, vocab)
    except DsparkExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cache = FeatureCache(Path(args.run) / "features" / "calibration")
    rows = []
    for size in args.sizes.split(","):
        d2t = None if size == "full" else select_d2t(ranking["ranking"], int(size), vocab)
        t0 = time.perf_counter()
        rounds = replay_rounds(drafter, cache, stride=args.stride, d2t=d2t)
        per = {}
        for name in sorted(set(rounds.sources)):
            m = [s == name for s in rounds.sources]
            sub = type(rounds)(rounds.conf_logits[m], rounds.accepted[m], rounds.valid[m], [name] * sum(m))
            per[name] = round(sub.acceptance_length(), 4)
        row = {"N": size, "tau": round(rounds.acceptance_length(), 4), "rounds": len(rounds.sources),
               "per_dataset": per, "conditional_acceptance": [round(x, 4) for x in rounds.conditional_acceptance()]}
        rows.append(row)
        print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    result = {"command": " ".join(sys.argv), "drafter": args.drafter, "ranking_source": ranking.get("source"),
              "ranking_records": ranking.get("records"), "ranking_tokens": ranking.get("tokens_counted"),
              "stride": args.stride, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
