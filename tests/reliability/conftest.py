"""Fixtures of the reliability suite: one tiny engine directory with an 8-token draft block and a
512-token context (long enough for the long-prompt rows), plus helpers shared by its modules."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams

REL_BUILD = dict(target_buckets=(1, 2, 4, 8, 16, 32, 64, 128), request_buckets=(1, 2, 4), max_context=512,
                 profile_context=16, profile_repeats=2, block_size=8, markov_rank=8)


@pytest.fixture(scope="session")
def rel_engine_dir(build_tiny_engine_dir):
    """Engine directory of the tiny Llama (tests/conftest.py) with an untrained γ=8 drafter."""
    return build_tiny_engine_dir("rel_engines", **REL_BUILD)


@pytest.fixture(scope="session")
def rel_runtime(rel_engine_dir):
    return Runtime.open(rel_engine_dir, policy="ar")


def generator(rt, policy="ar", **kw) -> Generator:
    """A fresh Generator over the runtime's engines (fresh caches and slots)."""
    return Generator(rt.engines, parse_policy(policy) if isinstance(policy, str) else policy, **kw)


def ar_tokens(rt, prompt, n, **params) -> list[int]:
    """Non-speculative output of one request run alone (the reference every spec run must equal)."""
    return generator(rt, "ar").generate([list(prompt)], [SamplingParams(max_new_tokens=n, **params)])[0].token_ids


def run_steps(gen, on_step=None):
    """Step until idle, calling on_step(gen) after every step."""
    while gen.has_work():
        gen.step()
        if on_step is not None:
            on_step(gen)


def random_prompt(seed: int, n: int, vocab: int = 256) -> list[int]:
    return np.random.default_rng(seed).integers(4, vocab, n).tolist()
