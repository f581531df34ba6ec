#!/bin/bash
# From the repository root: processes alternating the RaggedAttention source at d41b1ed ("old") and the working
# tree's ("new"); the dspark.cpu library is compiled once per source hash and cached, so each switch only loads.
F=src/dspark_export/plugins/cpu_ops/ragged_attention.cpp
git show d41b1ed:$F > /tmp/ra.old && cp $F /tmp/ra.new
for r in 1 2 3; do
  for v in old new; do
    cp /tmp/ra.$v $F
    for C in 1 4; do
      n=$([ $C = 1 ] && echo 8 || echo 32)
      out=$(python reports/runtime_split/s39/lockstep.py /tmp/eng/e $C 1 ar,dspark-async $n 2>&1 | grep "^round")
      echo "r$r $v C=$C $out"
    done
  done
done
cp /tmp/ra.new $F
