"""One linear layer K x N at M rows: int4 / int8 MatMulNBits, the int8 MatMulInteger chain of the drafter's head
(`exporter.drafter.int8_lm_head`) and fp32 MatMul, timed interleaved (median of 7 rounds x 50 runs, us).

    python one_linear.py THREADS M[,M...]      # the README's table: python one_linear.py 1 1,2,8,20
"""
import sys
import time

import numpy as np
import onnxruntime as ort
from dspark_export.exporter.builder import GraphBuilder
from dspark_export.exporter import drafter as dr
from dspark_export.exporter.quantize import matmul_nbits, WeightFormat
rng=np.random.default_rng(0)
def mk(kind,K,N):
    b=GraphBuilder('g'); x=b.input('x','float32',['M',K])
    W=rng.standard_normal((N,K)).astype(np.float32)*0.05
    if kind=='int4': y=matmul_nbits(b,x,'w',W,WeightFormat('int4'),'l')
    elif kind=='int8nb': y=matmul_nbits(b,x,'w',W,WeightFormat('int8'),'l')
    elif kind=='mmi8': y=dr.int8_lm_head(b,x,W)
    elif kind=='fp32': y=b.op('MatMul',[x,b.weight('w',np.ascontiguousarray(W.T))],'l')
    b.output(y,'y','float32',['M',N])
    return b.model() if hasattr(b,'model') else b.build()
def sess(m,t):
    so=ort.SessionOptions(); so.intra_op_num_threads=t; so.log_severity_level=3
    if t>1: so.add_session_config_entry('session.intra_op.allow_spinning','1')
    return ort.InferenceSession(m.SerializeToString(),so,providers=['CPUExecutionProvider'])
for K,N in [(576,3072),(1536,576),(576,960),(576,8192)]:
  for M in [int(a) for a in sys.argv[2].split(",")]:
    x=rng.standard_normal((M,K)).astype(np.float32)
    res={}
    ss={k:sess(mk(k,K,N),int(sys.argv[1])) for k in ['int4','int8nb','mmi8','fp32']}
    ts={k:[] for k in ss}
    for r in range(7):
      for k,s in ss.items():
        s.run(None,{'x':x}); t=time.perf_counter()
        for _ in range(50): s.run(None,{'x':x})
        ts[k].append((time.perf_counter()-t)/50*1e6)
    print(K,N,M,' '.join('%s %.0f'%(k,np.median(v)) for k,v in ts.items()))
