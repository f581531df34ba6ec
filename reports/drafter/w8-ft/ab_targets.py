"""Single-user decoding on several engine directories, interleaved per prompt: `ar` and each policy on each
directory (21 chat prompts as `bench peers` takes them, 128 new tokens, greedy, 2 threads); per system tokens/s
over the per-prompt median walls, wall ratios to `ar` on the first directory per round, and identity with `ar`
on its own directory.

    python ab_targets.py /tmp/eng/d,/tmp/eng/w8 dspark,dspark-async ROUNDS
"""
import sys
import time

import numpy as np

from dspark_export.bench.peers import PeersBenchConfig, _ours
from dspark_export.runtime.api import Runtime
dirs=sys.argv[1].split(','); policies=sys.argv[2].split(','); rounds=int(sys.argv[3]); ppd=int(sys.argv[4]) if len(sys.argv)>4 else 7
prompts=PeersBenchConfig(dirs[0],datasets=('gsm8k','humaneval','mt-bench'),datasets_dir='/work/shared/eval_datasets',prompts_per_dataset=ppd).prompts
rts={d:Runtime.open(d,policy='ar',threads=2) for d in dirs}
ids=[rts[dirs[0]].encode(q,True) for q in prompts]
systems=[(p,d) for d in dirs for p in ['ar']+policies]
gens={s:_ours(rts[s[1]],s[0]) for s in systems}
for g in gens.values(): g(ids[0],4)
wall={s:np.zeros((rounds,len(ids))) for s in systems}; toks={s:{} for s in systems}
for k in range(rounds):
    for i,x in enumerate(ids):
        for s in (systems if k%2==0 else systems[::-1]):
            t=time.perf_counter(); toks[s][i]=list(gens[s](x,128)); wall[s][k,i]=time.perf_counter()-t
base=systems[0]
for s in systems:
    n=sum(len(t) for t in toks[s].values()); ref=toks[('ar',s[1])]
    r=[round(float(a/b),3) for a,b in zip(wall[base].sum(1),wall[s].sum(1))]
    print(f"{s[0]:13s} {s[1]:14s} {n/np.median(wall[s],0).sum():7.2f} tok/s  x{base[0]}@{base[1]} per round {r}  identical to ar(same dir) {all(toks[s][i]==ref[i] for i in ref)}  vs ar@first {sum(toks[s][i]==toks[base][i] for i in ref)}/{len(ref)}",flush=True)
