"""Minor/major page faults and context switches of one 128-token generation, ar and dspark-async, after warm-up.

    python reports/runtime_split/s37/page_faults.py
"""
import sys, time, resource
from dspark_export.engines.ort.runner import use_shared_thread_pool; use_shared_thread_pool(2)
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
rt = Runtime.open("/tmp/eng/b", policy="ar", threads=2)
x = rt.encode("Write a long story about a dragon who learns to cook.", True)
for pol in ("ar", "dspark-async"):
    g = Generator(rt.engines, parse_policy(pol))
    g.generate([x], [SamplingParams(max_new_tokens=64)])
    for rep in range(2):
        r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
        r = g.generate([x], [SamplingParams(max_new_tokens=128)])[0]
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        print(pol, "minor faults", r1.ru_minflt - r0.ru_minflt, "major", r1.ru_majflt - r0.ru_majflt, "tokens", len(r.token_ids), f"{time.perf_counter()-t:.2f}s", "vol/invol ctx", r1.ru_nvcsw - r0.ru_nvcsw, r1.ru_nivcsw - r0.ru_nivcsw)
