"""The drafter context window (`runtime.stages.ContextWindow`): which committed rows a flush writes, at which
positions, and that drafting from fewer rows keeps every output equal to `ar`'s."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_export.errors import EngineDirError
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.runtime.stages import ContextWindow

from ..test_pipeline import BUCKETS, PROMPTS  # noqa: F401  (same tiny engine directory)
from ..test_pipeline import engine_dir, runtime  # noqa: F401  (module fixtures)

LONG = [(7 * i) % 250 + 3 for i in range(30)]   # a 30-token prompt of distinct tokens


def test_keep_reads_the_sinks_and_the_rows_before_the_anchor():
    w = ContextWindow(sink=2, recent=3)
    keep = w.keep(np.arange(10), 10)
    assert np.flatnonzero(keep).tolist() == [0, 1, 7, 8, 9]
    per_row = w.keep(np.array([0, 5, 6, 2, 3]), np.array([9, 9, 9, 4, 4]))
    assert per_row.tolist() == [True, False, True, True, True]
    for sink, recent in ((-1, 4), (4, 0)):
        with pytest.raises(ValueError, match="expected sink >= 0 and recent >= 1 rows"):
            ContextWindow(sink, recent)


@pytest.mark.parametrize("entry", [{"sink": 4}, {"sink": 4, "recent": 0}, {"sink": "4", "recent": 3},
                                   {"sink": 4.7, "recent": 32}, {"sink": True, "recent": True}, [4, 32],
                                   {"sink": 4, "recent": 10**30}, {"sink": 4, "recent": 32, "extra": 1}])
def test_a_malformed_manifest_window_is_named(engine_dir, tmp_path, entry):  # noqa: F811
    """A hand-edited runtime.drafter_context_window is refused by the runtime and by `inspect`, naming it."""
    import json
    import shutil

    from dspark_export.engines.inspect import inspect_engine_dir
    from dspark_export.engines.manifest import Manifest
    from dspark_export.runtime.api import Runtime
    copy = tmp_path / "eng"
    shutil.copytree(engine_dir, copy)
    data = json.loads((copy / "manifest.json").read_text())
    assert Manifest(copy, data).drafter_context_window is None        # the tiny build reads every row
    data["runtime"]["drafter_context_window"] = entry
    (copy / "manifest.json").write_text(json.dumps(data))
    for load in (lambda: Runtime.open(copy, policy="fixed:4"), lambda: inspect_engine_dir(copy)):
        with pytest.raises(EngineDirError, match=r"runtime.drafter_context_window: expected .*found"):
            load()
    data["runtime"]["drafter_context_window"] = {"sink": 2, "recent": 8}
    (copy / "manifest.json").write_text(json.dumps(data))
    assert Runtime.open(copy, policy="fixed:4").generator.stages.context_window == ContextWindow(2, 8)
    assert "drafter context first 2 + last 8 rows" in inspect_engine_dir(copy).format_text()


def _first_draft(rt, window):
    """A fixed:4 generator over LONG, stepped through its prefill and first drafted step."""
    gen = Generator(rt.engines, parse_policy("fixed:4"), max_slots=1)
    gen.stages.context_window = window
    state = gen.batch.requests[gen.submit(LONG, SamplingParams(max_new_tokens=8))]
    while state.slot < 0 or int(gen.draft_kv.lens[state.slot]) == 0:
        gen.step()
    return gen, state.slot


def test_a_windowed_flush_writes_the_kept_rows_at_their_own_positions(runtime):  # noqa: F811
    """With sink 2 and recent 4, the first draft after a 30-token prompt flushes positions 0, 1 and 26..29 (the
    anchor is the first generated token, at 30): 6 entries, each the whole-context flush's entry at its position
    (RoPE at the true position, not at the entry index)."""
    full, slot = _first_draft(runtime, None)
    windowed, wslot = _first_draft(runtime, ContextWindow(sink=2, recent=4))
    assert int(full.draft_kv.lens[slot]) == len(LONG)
    assert int(windowed.draft_kv.lens[wslot]) == 6
    kept = [0, 1, 26, 27, 28, 29]
    for a, b in zip(full.draft_kv.keys + full.draft_kv.values, windowed.draft_kv.keys + windowed.draft_kv.values):
        np.testing.assert_allclose(b[wslot, :, :6], a[slot, :, kept].transpose(1, 0, 2), rtol=1e-5, atol=1e-5)


def test_a_window_wider_than_the_context_drafts_as_the_whole_context(runtime):  # noqa: F811
    gen_full, slot = _first_draft(runtime, None)
    gen_wide, wslot = _first_draft(runtime, ContextWindow(sink=0, recent=len(LONG)))
    for a, b in zip(gen_full.draft_kv.keys, gen_wide.draft_kv.keys):
        np.testing.assert_array_equal(a[slot, :, :len(LONG)], b[wslot, :, :len(LONG)])


@pytest.mark.parametrize("policy", ["fixed:4", "dspark", "dspark-async"])
def test_windowed_drafting_stays_lossless(runtime, policy):  # noqa: F811
    """Greedy output with a 1 + 3 row window equals ar's, requests arriving mid-stream; a backlog limit of 2 rows
    also flushes requests that do not draft, whose rows the window mostly drops."""
    prompts = PROMPTS + [LONG, [60] * 25]
    ar = Generator(runtime.engines, parse_policy("ar")).generate(
        prompts, [SamplingParams(max_new_tokens=16) for _ in prompts])
    gen = Generator(runtime.engines, parse_policy(policy), max_slots=3)
    gen.stages.context_window = ContextWindow(sink=1, recent=3)
    gen.backlog_limit = 2
    ids = []
    for i, prompt in enumerate(prompts):
        ids.append(gen.submit(prompt, SamplingParams(max_new_tokens=16)))
        for _ in range(i % 2):
            gen.step()
    while gen.has_work():
        gen.step()
        for s in gen.batch.active():       # never more entries than the rows the target has committed
            assert int(gen.draft_kv.lens[s.slot]) <= int(gen.target_kv.lens[s.slot])
    assert [gen.result(r).token_ids for r in ids] == [r.token_ids for r in ar]
