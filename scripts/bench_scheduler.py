#!/usr/bin/env python
"""Micro-benchmark of the verification-length policies: host decision time per step, in µs.

Times `Policy.verify_lengths` (the whole decision: input checks, survivals, sort, Θ search, lengths) on
random confidences [R, γ] with a throughput profile: the engine directory's profile/sps.json when given,
else a synthetic power-of-two staircase (SPS = 1000 / (2 + 0.05·B) ms). Reports the median and p90 over
many runs, each run timed on its own, after a warm-up. Single-threaded numpy; no timed assertions.

Usage:
    python scripts/bench_scheduler.py                      # R = 16, γ = 7, 5000 runs per policy
    python scripts/bench_scheduler.py --requests 64 --block-size 7 --sps engines/smollm2/profile/sps.json

With an sps.json that has the layout-cost fit, the profile is bound to S = R slots and --kv-capacity, as
the runtime binds it, so dspark-async's decision includes its search over caps.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from dspark_export.engines.sps import ThroughputProfile
from dspark_export.runtime.policies import parse_policy

POLICIES = ("ar", "fixed:7", "threshold:0.7", "dspark", "dspark-async")


def synthetic_profile() -> ThroughputProfile:
    """Power-of-two buckets 1..256 with a linear latency model, 2 ms + 0.05 ms per token."""
    buckets = tuple(2 ** i for i in range(9))
    return ThroughputProfile(buckets, tuple(1000.0 / (2.0 + 0.05 * b) for b in buckets))


def bench_policy(policy: str, profile: ThroughputProfile, num_requests: int = 16, block_size: int = 7,
                 runs: int = 5000, seed: int = 0) -> dict:
    """Decision time of one policy in µs: {"policy", "median_us", "p90_us", "runs"}.

    Args:
        policy: policy text ("dspark", ...).
        profile: SPS(B).
        num_requests: R. Defaults to 16.
        block_size: γ. Defaults to 7.
        runs: timed decisions, each on fresh confidences (drawn before timing). Defaults to 5000.
        seed: RNG seed of the confidences. Defaults to 0.
    """
    pol = parse_policy(policy)
    rng = np.random.default_rng(seed)
    confs = rng.uniform(0.2, 1.0, (runs + 1, num_requests, block_size)).astype(np.float32)
    for conf in confs[:100]:                                    # warm-up
        pol.verify_lengths(conf, block_size, profile, confs[-1])
    times = np.empty(runs)
    for i in range(runs):
        t0 = time.perf_counter_ns()
        pol.verify_lengths(confs[i], block_size, profile, confs[i + 1])
        times[i] = (time.perf_counter_ns() - t0) / 1e3
    return {"policy": policy, "median_us": round(float(np.median(times)), 2),
            "p90_us": round(float(np.percentile(times, 90)), 2), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16, help="R, requests per step (16)")
    parser.add_argument("--block-size", type=int, default=7, help="γ, draft block size (7)")
    parser.add_argument("--runs", type=int, default=5000, help="timed decisions per policy (5000)")
    parser.add_argument("--sps", help="profile/sps.json of an engine directory (default: synthetic staircase)")
    parser.add_argument("--kv-capacity", type=int, default=256,
                        help="KV capacity P the profile is bound to with R slots, as the runtime binds it, when the "
                             "profile has a layout-cost fit (256)")
    args = parser.parse_args()
    if args.sps:
        with open(args.sps) as f:
            profile = ThroughputProfile.from_json(json.load(f)).at(args.requests, args.kv_capacity)
    else:
        profile = synthetic_profile()
    print(f"R={args.requests} γ={args.block_size} buckets={list(profile.buckets)} "
          f"layout cost {'priced (S = R, P = %d)' % args.kv_capacity if profile.has_layout_cost else 'none'}")
    for policy in POLICIES:
        row = bench_policy(policy, profile, args.requests, args.block_size, args.runs)
        print(f"{row['policy']:>14}: median {row['median_us']:8.2f} µs   p90 {row['p90_us']:8.2f} µs"
              f"   ({row['runs']} runs)")


if __name__ == "__main__":
    main()
