"""EngineFeatures with and without the empty-cache prefill (`engines/target_features.py`), alternated per record.

    python reports/drafter/features-prefill/bench.py ENGINE_DIR RECORDS.jsonl [--records N] [--skip K] [--threads T]

Prints tokens/s of each, the per-record time ratio (specialised / engine graph: median [p10, p90]) and how
many records gave bit-identical aux and last arrays.
"""
import argparse
import json
import time

import numpy as np

from dspark_export.engines.target_features import EngineFeatures

ap = argparse.ArgumentParser()
ap.add_argument("engine_dir")
ap.add_argument("records")
ap.add_argument("--records", type=int, default=40, dest="n")
ap.add_argument("--skip", type=int, default=0)
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
sources = {"engine graph": EngineFeatures(args.engine_dir, threads=args.threads, specialise=False),
           "specialised": EngineFeatures(args.engine_dir, threads=args.threads)}
with open(args.records, encoding="utf-8") as f:
    recs = [json.loads(line) for _, line in zip(range(args.skip + args.n), f)][args.skip:]
seconds = {k: [] for k in sources}
tokens, same = 0, 0
for i, rec in enumerate(recs):
    seq = (rec["prompt_ids"] + rec["response_ids"])[:1024]
    out = {}
    for name in (list(sources) if i % 2 else list(sources)[::-1]):
        t0 = time.perf_counter()
        out[name] = sources[name].features(seq)
        seconds[name].append(time.perf_counter() - t0)
    tokens += len(seq)
    same += all(np.array_equal(a, b) for a, b in zip(*out.values()))
ratio = np.array(seconds["specialised"]) / np.array(seconds["engine graph"])
print(json.dumps({"records": len(recs), "tokens": tokens, "threads": args.threads,
                  "specialised_layers": sources["specialised"].specialised_layers,
                  "tokens_per_s": {k: round(tokens / sum(v), 1) for k, v in seconds.items()},
                  "ratio_median_p10_p90": [round(float(x), 3) for x in np.percentile(ratio, [50, 10, 90])],
                  "bit_identical": f"{same}/{len(recs)}"}))
