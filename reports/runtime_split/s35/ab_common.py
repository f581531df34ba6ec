"""The single-user A/B the `ab_*.py` scripts of this folder share: `ar` and dspark-async variants on the 21 peer
prompts (gsm8k, humaneval, mt-bench, 7 each, chat template, 128 new tokens), one Generator per system across the
prompts (as `bench peers` runs them), systems interleaved per prompt and reversed every other round, 2 threads on
the shared ORT pool. Prints per system tokens/s over the per-prompt medians, its ratio to `ar` per round, whether
its tokens equal ar's, and the per-dataset mean of ar's median wall over its own.

    python ab_VARIANT.py ENGINE_DIR [ROUNDS]
"""
import sys
import time
from typing import Callable

import numpy as np

from dspark_export.engines.ort.runner import use_shared_thread_pool


def peer_prompt_ids(engine_dir: str, indices: list[int] | None = None):
    """(a Runtime on `engine_dir` with 2 threads on the shared ORT pool, the chat-templated token ids of the 21
    peer prompts, or of those at `indices`, in the order given)."""
    use_shared_thread_pool(2)
    from dspark_export.bench.peers import PeersBenchConfig
    from dspark_export.runtime.api import Runtime

    prompts = PeersBenchConfig(engine_dir, datasets=("gsm8k", "humaneval", "mt-bench"),
                               datasets_dir="/work/shared/eval_datasets", prompts_per_dataset=7).prompts
    rt = Runtime.open(engine_dir, policy="ar", threads=2)
    return rt, [rt.encode(prompts[i], True) for i in (range(len(prompts)) if indices is None else indices)]


def run(variants: dict[str, Callable | None]) -> None:
    """`variants`: {name: setup(generator) or None} for dspark-async systems beside `ar` (setup changes the
    system's Generator, e.g. its controller's methods, before the first prompt)."""
    engine_dir, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    rt, ids = peer_prompt_ids(engine_dir)
    from dspark_export.runtime.generator import Generator
    from dspark_export.runtime.policies import parse_policy
    from dspark_export.runtime.request import SamplingParams

    gens = {"ar": Generator(rt.engines, parse_policy("ar"))}
    for name, setup in variants.items():
        gens[name] = Generator(rt.engines, parse_policy("dspark-async"))
        if setup is not None:
            setup(gens[name])
    names = list(gens)

    def generate(name, x):
        [r] = gens[name].generate([x], [SamplingParams(max_new_tokens=128)])
        return r.token_ids

    for n in names:
        generate(n, ids[0])   # warm-up
    wall = {n: np.zeros((rounds, len(ids))) for n in names}
    toks: dict = {n: {} for n in names}
    for k in range(rounds):
        for i, x in enumerate(ids):
            for n in (names if k % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                toks[n][i] = generate(n, x)
                wall[n][k, i] = time.perf_counter() - t0
    ar = wall["ar"].sum(axis=1)
    total = sum(len(t) for t in toks["ar"].values())
    width = max(len(n) for n in names)
    for n in names:
        per = [round(float(a / w), 3) for a, w in zip(ar, wall[n].sum(axis=1))]
        same = all(toks[n][i] == toks["ar"][i] for i in toks["ar"])
        print(f"{n:{width}s} {total / np.median(wall[n], axis=0).sum():6.2f} tok/s ×ar per round {per} identical {same}")
        med = np.median(wall["ar"], axis=0) / np.median(wall[n], axis=0)
        print("   per dataset ×ar (median wall per prompt):", [round(float(med[7 * j:7 * j + 7].mean()), 3) for j in range(3)])
