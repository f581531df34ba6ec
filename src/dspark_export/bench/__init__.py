"""Benchmarks over a built engine directory.

- `bench.serve`: closed-loop serving benchmark (DSpark paper §5, Fig. 7 and Fig. 8): throughput vs
  per-user tokens/s and verification length vs concurrency, per policy.
- `bench.acceptance`: offline acceptance protocol (paper Table 1, Fig. 2): τ per dataset and domain,
  conditional acceptance per draft position, under a fixed block.
"""

from .serve import ServeBenchConfig, run_serve_bench, write_reports

__all__ = ["ServeBenchConfig", "run_serve_bench", "write_reports"]
