#!/bin/bash
# Paired A/B of two profiler versions: `dspark-export profile` from OLD_SRC and NEW_SRC (each a checkout's src/
# folder) on two copies of one engine directory, alternating RUNS times; each run's sps.json is kept in OUT and
# scripts/profile_spread.py summarises them. Nothing else should run on the machine meanwhile.
#   bash scripts/ab_profiler.sh /tmp/wt-old/src src /tmp/eng/v6 8 /tmp/ab-profiler
set -euo pipefail
old_src=$1 new_src=$2 engines=$3 runs=$4 out=$5
mkdir -p "$out"
for tag in old new; do rm -rf "$out/engines-$tag"; cp -r "$engines" "$out/engines-$tag"; done
for i in $(seq 1 "$runs"); do
  for tag in old new; do
    src=$old_src; [ "$tag" = new ] && src=$new_src
    PYTHONPATH=$src python -m dspark_export.cli profile --engine-dir "$out/engines-$tag" > /dev/null
    cp "$out/engines-$tag/profile/sps.json" "$out/$tag-$i.json"
  done
  echo "run $i of $runs done"
done
python "$(dirname "$0")/profile_spread.py" "$out"/old-*.json -- "$out"/new-*.json
