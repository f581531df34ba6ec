"""One 128-token greedy generation in the runtime's own loop under cProfile: how much of a step is ORT's run
(the rest is host work).

    python reports/profiler/attention-share/ar_loop_profile.py /tmp/eng/v8 ar
"""
import cProfile, pstats, time, sys
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.request import SamplingParams
rt = Runtime.open(sys.argv[1], policy=sys.argv[2], threads=2)
ids = rt.encode("Write a short story about a robot who learns to paint. Make it vivid.", True)
sp = SamplingParams(max_new_tokens=128, temperature=0.0)
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
gen = Generator(rt.engines, parse_policy(sys.argv[2]))
gen.generate([ids], [sp])
t = time.perf_counter(); r = gen.generate([ids], [sp]); dt = time.perf_counter() - t
print("tok/s", len(r[0].token_ids) / dt, "steps", r[0].stats.rounds)
pr = cProfile.Profile(); pr.enable(); gen.generate([ids], [sp]); pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
