"""Benchmarks over a built engine directory.

- `bench.serve`: closed-loop serving benchmark (DSpark paper §5, Fig. 7 and Fig. 8): throughput vs
  per-user tokens/s and verification length vs concurrency, per policy.
"""

from .serve import ServeBenchConfig, run_serve_bench, write_reports

__all__ = ["ServeBenchConfig", "run_serve_bench", "write_reports"]
