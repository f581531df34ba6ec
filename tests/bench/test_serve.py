"""Serving benchmark on the tiny engine directory: closed-loop invariants, metrics, reports, errors."""

from __future__ import annotations

import json

import pytest

from dspark_export.bench import ServeBenchConfig, run_serve_bench, write_reports
from dspark_export.bench.serve import _TimedPolicy, markdown_table
from dspark_export.errors import ConfigError
from dspark_export.runtime.draft_control import DraftController
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.request import SamplingParams

from ..script_loader import load_script
from ..test_pipeline import BUCKETS, engine_dir  # noqa: F401  (module fixture: the tiny engine directory)

POLICIES = ("ar", "fixed:1", "fixed:4", "dspark", "dspark-async")
CONCURRENCY = (1, 3)
MAX_NEW = 10
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def datasets_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval_datasets")
    (folder / "alpha.jsonl").write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in
                                                ["What is 2+3?", "Say hi.", "Count to five", "Name a color"]))
    (folder / "beta.jsonl").write_text("".join(json.dumps({"turns": t}) + "\n" for t in
                                               [["Write a poem", "Shorter."], ["def f(x):"], ["Why?"]]))
    return folder


@pytest.fixture(scope="module")
def bench(engine_dir, datasets_dir):  # noqa: F811
    """One benchmark run with Generator.submit wrapped: in-flight requests counted per generator."""
    gens: dict[int, dict] = {}
    original = Generator.submit

    def counting_submit(self, prompt, params, on_token=None):
        count = gens.setdefault(id(self), {"gen": self, "live": 0, "max": 0, "submitted": 0})
        count["live"] += 1
        count["submitted"] += 1
        count["max"] = max(count["max"], count["live"])

        def wrapped(rid, tokens, result):
            if result.finish_reason is not None:
                count["live"] -= 1
            if on_token is not None:
                on_token(rid, tokens, result)
        return original(self, prompt, params, wrapped)

    cfg = ServeBenchConfig(engine_dir, concurrency=CONCURRENCY, policies=POLICIES, datasets=("alpha", "beta"),
                           datasets_dir=datasets_dir, max_new_tokens=MAX_NEW, seed=3)
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Generator, "submit", counting_submit)
        # the tiny build's profile is timed on whatever else the machine runs: a loaded machine can price
        # every draft out (dspark then does ar's work, legitimately); these tests check the metrics of steps
        # that draft, so perfect drafts always pay here (the skip rules have their own tests)
        mp.setattr(DraftController, "can_pay", lambda self, *args: True)
        result = run_serve_bench(cfg, progress=lines.append)
    measured = [c for c in gens.values() if isinstance(c["gen"].policy, _TimedPolicy)]
    return cfg, result, measured, lines


def test_result_keys_and_rows(bench):
    cfg, result, _, lines = bench
    assert {"config", "results", "engine_dir", "profile_context", "identity"} <= set(result)
    assert result["profile_context"] == BUCKETS["profile_context"] and result["block_size"] == BUCKETS["block_size"]
    assert [(r["policy"], r["concurrency"]) for r in result["results"]] == \
        [(p, c) for p in POLICIES for c in CONCURRENCY]
    keys = {"policy", "concurrency", "throughput_tokens_per_s", "per_user_tokens_per_s", "per_user_tokens_per_s_p50",
            "per_user_tokens_per_s_p90", "mean_verify_len", "acceptance_length", "mean_step_ms", "scheduler_ms",
            "scheduler_ratio", "requests", "identical"}
    for row in result["results"]:
        assert keys <= set(row), keys - set(row)
        assert row["throughput_tokens_per_s"] > 0 and row["per_user_tokens_per_s"] > 0 and row["mean_step_ms"] > 0
        assert row["per_user_tokens_per_s_p50"] <= row["per_user_tokens_per_s_p90"]
        assert 0 < row["window_tokens"] <= row["output_tokens"] and row["window_s"] <= row["wall_s"]
        assert row["acceptance_length"] >= 1.0
    json.dumps(result)  # JSON-native throughout
    assert result["warnings"] == []                         # default requests max(4, 2·C): no single-wave window
    assert len(lines) == 2 * len(result["results"])
    sequence = result["prompts"]["sequence"]                # round-robin over the datasets, each shuffled
    assert [s.split("#")[0] for s in sequence] == ["alpha", "beta"] * (len(sequence) // 2)
    assert len(sequence) == max(cfg.requests_for(c) for c in CONCURRENCY)


def test_closed_loop_invariants(bench):
    cfg, result, measured, _ = bench
    assert len(measured) == len(result["results"])          # one generator per (policy, C)
    rows = {(r["policy"], r["concurrency"]): r for r in result["results"]}
    run_order = [(p, c) for c in CONCURRENCY for p in POLICIES]  # every policy at one C, then the next C
    for count, row in zip(measured, [rows[key] for key in run_order]):
        c, n = row["concurrency"], cfg.requests_for(row["concurrency"])
        assert count["max"] == c, row            # exactly C in flight at peak, never more
        assert count["submitted"] == n and count["live"] == 0
        assert row["requests"] == n == max(4, 2 * c) and row["max_in_flight"] == c
        assert sum(row["finish_reasons"].values()) == n
        assert row["output_tokens"] <= n * MAX_NEW


def test_policy_metrics(bench):
    _, result, _, _ = bench
    for row in result["results"]:
        if row["policy"] == "ar":
            assert row["mean_verify_len"] == 0 and row["acceptance_length"] == 1.0 and row["scheduler_ms"] == 0
        else:
            assert row["scheduler_ms"] > 0 and 0 < row["scheduler_ratio"] < 1
        if row["policy"] == "fixed:1":
            assert 0 < row["mean_verify_len"] <= 1
        if row["policy"] == "fixed:4":
            assert 1 < row["mean_verify_len"] <= 4
        assert row["acceptance_length"] <= 1 + row["mean_verify_len"] + 1e-9


def test_greedy_identity_for_every_policy(bench):
    _, result, _, _ = bench
    assert set(result["identity"]) == set(POLICIES)
    for policy, check in result["identity"].items():
        assert check["identical"] is True and check["checked"] == 2 * len(CONCURRENCY), policy
    assert all(row["identical"] is True for row in result["results"])


def test_write_reports(bench, tmp_path):
    _, result, _, _ = bench
    paths = write_reports(result, tmp_path / "reports")
    for key in ("throughput_vs_per_user", "verify_len_vs_concurrency"):
        data = paths[key].read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 2000, key
    assert json.loads(paths["json"].read_text())["results"] == result["results"]
    md = paths["markdown"].read_text()
    assert "| policy | C |" in md and md.count("\n| dspark-async |") == len(CONCURRENCY)


def test_repeats_interleave_policies_and_report_medians(engine_dir, datasets_dir):  # noqa: F811
    cfg = ServeBenchConfig(engine_dir, concurrency=(2,), policies=("ar", "fixed:1", "dspark"), requests=3,
                           datasets=("alpha", "beta"), datasets_dir=datasets_dir, max_new_tokens=6, repeats=3)
    lines: list[str] = []
    result = run_serve_bench(cfg, progress=lines.append)
    started = [line.split("]")[0] + "]" for line in lines if "requests ×" in line]
    assert started == ["[ar C=2 run 1/3]", "[fixed:1 C=2 run 1/3]", "[dspark C=2 run 1/3]",    # rotated each repeat
                       "[fixed:1 C=2 run 2/3]", "[dspark C=2 run 2/3]", "[ar C=2 run 2/3]",
                       "[dspark C=2 run 3/3]", "[ar C=2 run 3/3]", "[fixed:1 C=2 run 3/3]"]
    assert result["config"]["repeats"] == 3
    assert len(result["warnings"]) == 1 and result["warnings"][0].startswith("C=2: 3 requests < 2·C")
    assert "--requests 4" in result["warnings"][0] and lines[0] == f"warning: {result['warnings'][0]}"
    rows = {r["policy"]: r for r in result["results"]}
    assert list(rows) == ["ar", "fixed:1", "dspark"]
    for row in rows.values():
        runs = row["throughput_tokens_per_s_runs"]
        assert row["repeats"] == 3 and len(runs) == 3 and len(row["per_user_tokens_per_s_runs"]) == 3
        assert row["throughput_tokens_per_s"] == pytest.approx(sorted(runs)[1], abs=1e-4)    # the median
        assert row["requests"] == 9 and sum(row["finish_reasons"].values()) == 9
        assert row["identical"] is True and row["identity_checked"] == 6
    ar = rows["ar"]
    assert ar["throughput_ratio_to_ar"] == 1.0 and ar["throughput_ratio_to_ar_runs"] == [1.0] * 3
    fixed = rows["fixed:1"]
    paired = [f / a for f, a in zip(fixed["throughput_tokens_per_s_runs"], ar["throughput_tokens_per_s_runs"])]
    assert fixed["throughput_ratio_to_ar_runs"] == pytest.approx(paired, abs=1e-4)
    assert fixed["throughput_ratio_to_ar"] == pytest.approx(sorted(paired)[1], abs=1e-4)
    table = markdown_table(result)
    assert "| ×ar | ×ar runs |" in table
    lo, hi = min(fixed["throughput_ratio_to_ar_runs"]), max(fixed["throughput_ratio_to_ar_runs"])
    assert f"| {fixed['throughput_ratio_to_ar']:.2f} | {lo:.2f}–{hi:.2f} |" in table


@pytest.mark.parametrize("kwargs, match", [
    (dict(policies=("ar", "nope")), "policy: expected one of"),
    (dict(policies=("fixed:0",)), "fixed:K"),
    (dict(concurrency=(0, 2)), "concurrency: expected"),
    (dict(concurrency=()), "concurrency: expected"),
    (dict(datasets=("alpha", "missing")), r"missing\.jsonl"),
    (dict(requests=2, concurrency=(1, 3)), "requests: .*at least C"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(repeats=0), "repeats: expected an integer >= 1, found 0"),
    (dict(repeats=1.5), "repeats: expected an integer >= 1"),
])
def test_bad_config_raises(engine_dir, datasets_dir, kwargs, match):  # noqa: F811
    base = dict(concurrency=(1,), policies=("ar",), datasets=("alpha",), datasets_dir=datasets_dir)
    with pytest.raises(ConfigError, match=match):
        ServeBenchConfig(engine_dir, **{**base, **kwargs})


def test_bad_engine_dir_and_datasets_dir(tmp_path, engine_dir, datasets_dir):  # noqa: F811
    with pytest.raises(ConfigError, match="engine_dir: .*manifest.json"):
        ServeBenchConfig(tmp_path / "nowhere", datasets_dir=datasets_dir, datasets=("alpha",))
    with pytest.raises(ConfigError, match="datasets_dir"):
        ServeBenchConfig(engine_dir, datasets_dir=tmp_path / "nope", datasets=("alpha",))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    cfg = ServeBenchConfig(engine_dir, concurrency=1, policies="ar", datasets="bad", datasets_dir=tmp_path,
                           max_new_tokens=2)
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1: .*'turns'"):
        run_serve_bench(cfg)


def test_policy_the_engine_cannot_run(engine_dir, datasets_dir):  # noqa: F811
    cfg = ServeBenchConfig(engine_dir, concurrency=(1,), policies=("fixed:9",), datasets=("alpha",),
                           datasets_dir=datasets_dir, max_new_tokens=2)
    with pytest.raises(ConfigError, match="fixed:9 .*fixed:1..fixed:4"):
        run_serve_bench(cfg)


def test_script(engine_dir, datasets_dir, tmp_path, capsys):  # noqa: F811
    script = load_script("bench_serve.py")
    common = ["--engine-dir", str(engine_dir), "--datasets", "alpha,beta", "--datasets-dir", str(datasets_dir)]
    rc = script.main(common + ["--concurrency", "2", "--policies", "ar,fixed:2", "--requests", "2",
                               "--max-new-tokens", "4", "--json", str(tmp_path / "r.json"),
                               "--out-dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == 0 and "| fixed:2 | 2 |" in out and "[ar C=2]" in err
    assert len(json.loads((tmp_path / "r.json").read_text())["results"]) == 2
    assert (tmp_path / "out" / "serve_throughput_vs_per_user.png").stat().st_size > 0
    assert script.main(common + ["--policies", "bogus"]) == 2
    assert "error: policy: expected one of" in capsys.readouterr().err


def test_measured_runs_take_the_warm_up_arenas(engine_dir, datasets_dir):  # noqa: F811
    """Both KV caches of each measured generator run in the arenas its warm-up prefaulted (handed on through the
    engines' pool: nothing may keep the warm-up's caches alive), and no measured step moves them to a new one."""
    import numpy as np

    from dspark_export.bench import serve as SB

    seen, warm_arenas = [], []
    original_loop, original_warm_up = SB._closed_loop, SB._warm_up

    def warm_up(gen, *args):
        original_warm_up(gen, *args)
        warm_arenas.append([kv._holder[0] for kv in (gen.batch.target_kv, gen.batch.draft_kv)])

    def watched(gen, prompts, concurrency, params):
        caches = (gen.batch.target_kv, gen.batch.draft_kv)
        before = [kv._holder[0] for kv in caches]
        taken = [np.shares_memory(a, w) for a, w in zip(before, warm_arenas[-1])]
        run = original_loop(gen, prompts, concurrency, params)
        seen.append(taken + [kv._holder[0] is arena for kv, arena in zip(caches, before)])
        return run

    cfg = ServeBenchConfig(engine_dir, concurrency=(3,), policies=("ar", "dspark-async"), datasets=("alpha", "beta"),
                           datasets_dir=datasets_dir, requests=6, max_new_tokens=MAX_NEW, seed=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SB, "_closed_loop", watched)
        mp.setattr(SB, "_warm_up", warm_up)
        run_serve_bench(cfg)
    assert seen == [[True] * 4, [True] * 4]
