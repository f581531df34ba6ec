#!/usr/bin/env bash
# Issue 23 items 1 and 4 at one small equal wall-time budget (session 18): three drafters trained from scratch
# on the same features, one after the other, nothing else running. Usage: run.sh RUN BUDGET_S
#   RUN: a run folder whose features/{train,calibration} exist (here: `features --limit 600`)
# Each arm's --steps is BUDGET_S / its steady-state step time (step_times.py), so every cosine schedule ends
# near the budget; the per-sequence logsumexp the N-vocabulary arms compute once falls inside their budget.
set -euo pipefail
RUN=$1 BUDGET=$2
HERE=$(cd "$(dirname "$0")" && pwd)
python "$HERE/step_times.py" "$RUN/features/train" 6 | tee "$HERE/step_times.json"
steps() { python -c "import json,sys; t=json.load(open('$HERE/step_times.json'))['step_s_median']['$1']; print(int($BUDGET / t))"; }
common=(--run "$RUN" --block-size 5 --layers 2 --markov-rank 32 --threads 2 --save-every 200 --eval-limit 64
        --time-budget $((BUDGET * 5 / 4)))
python scripts/train_drafter.py train "${common[@]}" --name abl-dspark-n8192 --steps "$(steps dspark-n8192)" --draft-vocab 8192
python scripts/train_drafter.py train "${common[@]}" --name abl-dspark-full --steps "$(steps dspark-full)" --draft-vocab full
python scripts/train_drafter.py train "${common[@]}" --name abl-dflash-n8192 --steps "$(steps dflash-n8192)" --draft-vocab 8192 \
    --variant dflash
for arm in abl-dspark-n8192 abl-dspark-full abl-dflash-n8192; do
    cp "$RUN/$arm/checkpoints.jsonl" "$HERE/$arm-checkpoints.jsonl"
    cp "$RUN/$arm/metrics.jsonl" "$HERE/$arm-metrics.jsonl"
done
