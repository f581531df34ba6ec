#!/bin/bash
# Processes alternating two engine directories built before (s39) and after (s39f) fuse_swiglu, one library:
#   dspark-export build --out /tmp/eng/s39f   (and /tmp/eng/s39 from the commit before)
cd "$(git rev-parse --show-toplevel)"
for r in 1 2 3; do
  for e in s39 s39f; do
    for C in 1 4; do
      n=$([ $C = 1 ] && echo 8 || echo 32)
      out=$(python reports/runtime_split/s39/lockstep.py /tmp/eng/$e $C 1 ar,dspark-async $n 2>&1 | grep "^round")
      echo "r$r $e C=$C $out"
    done
  done
done
