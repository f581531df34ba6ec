"""Shared prepacked ONNX Runtime sessions for every bucket of the target, the drafter block and the drafter context."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_export.engines.engine_set import EngineSet
from dspark_export.engines.ort.runner import uses_shared_session
from dspark_export.engines.profiler import engine_feed
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams


BUCKETS = dict(target_buckets=(1, 2, 4, 8, 16, 64), request_buckets=(1, 2, 4), max_context=64,
               profile_context=16, profile_repeats=2, block_size=4, markov_rank=8)
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41], [100] * 11, [7, 3, 9, 200, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def engine_dir(build_tiny_engine_dir):
    return build_tiny_engine_dir("prepack", **BUCKETS)


def test_larger_buckets_share_one_prepacked_session(engine_dir):
    packed = EngineSet.open(engine_dir, verify=False).activate_all()
    target = {b: packed.runner_exact("target", b).session for b in packed.buckets("target")}
    assert len({id(s) for s in target.values()}) == 1                   # one session for every B
    for graph in ("drafter_block", "drafter_context"):
        assert len({id(packed.runner_exact(graph, r).session) for r in packed.buckets(graph)}) == 1, graph
    verify = {id(packed.runner_exact("verify", r).session) for r in packed.buckets("verify")}
    assert len(verify) == len(packed.buckets("verify"))                  # small graphs stay per bucket
    plain = EngineSet.open(engine_dir, verify=False, prepack=False).activate_all()
    assert len({id(plain.runner_exact("target", b).session) for b in plain.buckets("target")}) == \
        len(plain.buckets("target"))


@pytest.mark.parametrize("graph, bucket", [("target", 8), ("target", 1), ("drafter_block", 4), ("drafter_context", 2)])
def test_shared_session_outputs_equal_per_bucket_sessions(engine_dir, graph, bucket):
    packed = EngineSet.open(engine_dir, verify=False)
    plain = EngineSet.open(engine_dir, verify=False, prepack=False)
    feed = engine_feed(packed.manifest.data["graphs"], graph, bucket, 16)
    a = packed.runner_exact(graph, bucket).infer(feed)
    b = plain.runner_exact(graph, bucket).infer(feed)
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_shared_sessions_run_the_rows_they_are_given_not_the_bucket(engine_dir):
    """A shared session runs any row count, so a feed keeps its own row count; per-bucket sessions keep their
    fixed bucket (the greedy test below compares the two end to end)."""
    packed = EngineSet.open(engine_dir, verify=False)
    plain = EngineSet.open(engine_dir, verify=False, prepack=False)
    top = packed.buckets("target")[-1]
    assert top > 9
    assert [packed.runner("target", n).padded_rows(n) for n in (1, 3, 5, 9, top - 1, top)] == [1, 3, 5, 9, top - 1, top]
    assert packed.runner_exact("target", top).padded_rows(0) == 1
    assert plain.runner_exact("target", top).padded_rows(9) == top


def test_greedy_output_is_the_same_with_and_without_prepacking(engine_dir):
    outs = []
    for prepack in (True, False):
        engines = EngineSet.open(engine_dir, verify=False, prepack=prepack)
        params = [SamplingParams(max_new_tokens=20)] * len(PROMPTS)
        outs.append([r.token_ids for r in Generator(engines, parse_policy("fixed:4")).generate(PROMPTS, params)])
    assert outs[0] == outs[1]


def test_engine_specs_record_the_session_kind(engine_dir):
    engines = EngineSet.open(engine_dir, verify=False)
    for key in engines.manifest.engine_keys():
        spec = json.loads((engine_dir / key.path).read_text())
        shared = uses_shared_session(key)
        assert spec["session"] == (f"shared-prepacked:{key.graph}" if shared else "per-bucket")
        assert spec["session_config"]["session.disable_prepacking"] == ("0" if shared else "1")
        assert spec["free_dimension_overrides"] == ({} if shared else {key.dim: key.bucket})
