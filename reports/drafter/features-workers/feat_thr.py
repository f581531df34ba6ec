"""Feature throughput of one EngineFeatures session: T random tokens, THREADS intra-op threads (median of 3)."""
import sys, time, numpy as np
from dspark_export.engines.target_features import EngineFeatures
T, th = int(sys.argv[1]), int(sys.argv[2])
ef = EngineFeatures(sys.argv[3] if len(sys.argv) > 3 else "/tmp/eng/main", threads=th)
toks = np.random.default_rng(0).integers(100, 40000, T)
ef.features(toks); t = []
for _ in range(3):
    t0 = time.perf_counter(); ef.features(toks); t.append(time.perf_counter() - t0)
print(f"T={T} threads={th}: {np.median(t)*1e3:.0f} ms per sequence, {T/np.median(t):.0f} tok/s")
