"""Time one GroupQueryAttention node (S = 2 and 6) at two past lengths; reuses gqa_invariance.py's graph.

    cd reports/profiler/attention-share && python gqa_time.py
"""
import time, numpy as np, importlib.util, sys
spec = importlib.util.spec_from_file_location("g", "gqa_invariance.py")
src = open("gqa_invariance.py").read().split("worst = 0.0")[0]
exec(src)
for p, cap in ((128, 256), (512, 640)):
    for S in (2, 6):
        pk = np.zeros((1, KVH, cap, D), np.float32); pv = np.zeros_like(pk)
        feed = {"q": Q[None, p:p + S], "k": K[None, p:p + S], "v": V[None, p:p + S], "pk": pk, "pv": pv,
                "seqlens_k": np.array([p + S - 1], np.int32), "total_len": np.array(cap, np.int32)}
        for _ in range(50): s.run(["out"], feed)
        ts = []
        for _ in range(500):
            t = time.perf_counter(); s.run(["out"], feed); ts.append(time.perf_counter() - t)
        print(f"P {p} cap {cap} S {S}: {1e6 * np.median(ts):.0f} us per GQA node (one layer, incl. Python call)")
