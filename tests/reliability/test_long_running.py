"""A long-running generator keeps no cost of requests that have left: its caches shrink back."""

from __future__ import annotations

import pytest

from dspark_export.runtime.request import SamplingParams

from ..script_loader import load_script
from .conftest import ar_tokens, generator

SHORT = [11, 12, 13, 14, 15]


@pytest.mark.parametrize("policy", ["ar", "fixed:4"])
def test_caches_shrink_once_a_long_request_leaves(rel_runtime, policy):
    """A 300-token prompt grows the caches past their initial 256 entries; once it finishes, the short
    request still running decodes over 256 entries again (`KVCache.shrink`), with unchanged tokens."""
    gen = generator(rel_runtime, policy, max_slots=2)
    long_prompt = [3 + (7 * i) % 190 for i in range(300)]
    a = gen.submit(long_prompt, SamplingParams(max_new_tokens=6))
    b = gen.submit(SHORT, SamplingParams(max_new_tokens=40))
    caches = [gen.target_kv] + ([gen.draft_kv] if policy != "ar" else [])
    seen = []
    while gen.has_work():
        gen.step()
        seen.append((gen.result(a).finish_reason is not None, gen.result(b).finish_reason is not None,
                     [c.capacity for c in caches]))
    assert any(not a_done and min(caps) > 256 for a_done, _, caps in seen), seen
    after = [caps for a_done, b_done, caps in seen if a_done and not b_done]
    assert after and all(caps == [256] * len(caps) for caps in after), seen
    assert gen.result(a).token_ids == ar_tokens(rel_runtime, long_prompt, 6)
    assert gen.result(b).token_ids == ar_tokens(rel_runtime, SHORT, 40)


def test_bench_kv_shrink_script_small(rel_engine_dir, tmp_path):
    """scripts/bench_kv_shrink.py on the tiny engine directory, so the script cannot rot."""
    import json

    module = load_script("bench_kv_shrink.py")
    out = tmp_path / "shrink.json"
    assert module.main(["--engine-dir", str(rel_engine_dir), "--concurrency", "1,2", "--long-tokens", "400",
                        "--repeats", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["capacity_without_shrink"] == 512 and r["tokens_per_s_shrink"] > 0 and r["tokens_per_s_no_shrink"] > 0
    assert module.main(["--engine-dir", str(rel_engine_dir), "--long-tokens", "510"]) == 2   # past max_context
