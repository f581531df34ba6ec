"""Writing fresh pages against writing pages already touched: 60 arrays [16, 3, 768, 64] float32 (the target's
K/V at 16 slots and capacity 768, 540 MiB). Prints seconds per pass."""
import time

import numpy as np

shape = (16, 3, 768, 64)
a = [np.zeros(shape, np.float32) for _ in range(60)]
for r in range(3):
    t = time.perf_counter()
    for x in a:
        x[:, :, :300] = 1.0
    t1 = time.perf_counter()
    for x in a:
        x.fill(0)
    t2 = time.perf_counter()
    print(f"pass {r}: write 300 of 768 entries {t1 - t:.3f} s, fill all {t2 - t1:.3f} s")
b = [np.empty(shape, np.float32) for _ in range(60)]
t = time.perf_counter()
for x, y in zip(a, b):
    y[...] = x
print(f"copy into new arrays {time.perf_counter() - t:.3f} s")
t = time.perf_counter()
for x, y in zip(a, b):
    y[...] = x
print(f"copy again {time.perf_counter() - t:.3f} s")
