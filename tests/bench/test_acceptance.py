"""Acceptance benchmark on the tiny engine directory: protocol (rows, fixed block), metrics, reports, errors."""

from __future__ import annotations

import json
import random

import pytest

from dspark_export.bench.acceptance import AcceptanceBenchConfig, run_acceptance_bench, write_reports
from dspark_export.datasets import select_rows
from dspark_export.cli import main as cli_main
from dspark_export.errors import ConfigError

from ..test_pipeline import BUCKETS, engine_dir  # noqa: F401  (module fixture: the tiny engine directory)

GAMMA = BUCKETS["block_size"]
MAX_NEW = 8
SEED = 7
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROWS = {"gsm8k": ["What is 2+3?", "Add 4 and 9.", "Halve 10.", "Is 7 prime?", "Double 6."],
        "math500": ["Solve x+1=2.", "What is 3*3?"],
        "humaneval": ["def f(x):", "Write add(a, b)."],
        "mt-bench": ["Write a poem", "Say hi."]}


@pytest.fixture(scope="module")
def datasets_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval_datasets")
    for name, texts in ROWS.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [t, "second turn"]}) + "\n"
                                                      for t in texts))
    return folder


@pytest.fixture(scope="module")
def bench(engine_dir, datasets_dir):  # noqa: F811
    cfg = AcceptanceBenchConfig(engine_dir, datasets=tuple(ROWS), datasets_dir=datasets_dir, samples=3,
                                max_new_tokens=MAX_NEW, seed=SEED)
    lines: list[str] = []
    return cfg, run_acceptance_bench(cfg, progress=lines.append), lines


def test_keys_and_tau(bench):
    cfg, result, lines = bench
    assert {"datasets", "domains", "conditional_acceptance", "macro", "identity", "policy"} <= set(result)
    assert result["policy"] == f"fixed:{GAMMA}" and result["block_size"] == GAMMA
    assert list(result["datasets"]) == list(ROWS) and len(lines) == 2 * len(ROWS)
    for name, row in result["datasets"].items():
        assert {"acceptance_length", "samples", "conditional_acceptance", "tokens_per_s"} <= set(row)
        assert 1.0 <= row["acceptance_length"] <= GAMMA + 1
        assert row["acceptance_length"] == round(row["committed_in_rounds"] / row["rounds"], 4)
        assert row["tokens_per_s"] > 0 and row["output_tokens"] <= row["samples"] * MAX_NEW
        assert 0 < row["mean_verify_len"] <= GAMMA
    json.dumps(result)


def test_samples_and_seeded_shuffle(bench):
    _, result, _ = bench
    order = list(range(len(ROWS["gsm8k"])))
    random.Random(SEED).shuffle(order)
    assert result["datasets"]["gsm8k"]["rows"] == order[:3] == select_rows(ROWS["gsm8k"], 3, SEED)
    assert result["datasets"]["gsm8k"]["samples"] == 3
    for name in ("math500", "humaneval", "mt-bench"):       # fewer rows than --samples: all, in file order
        assert result["datasets"][name]["rows"] == list(range(len(ROWS[name])))
        assert result["datasets"][name]["samples"] == len(ROWS[name])


def test_conditional_acceptance(bench):
    _, result, _ = bench
    assert set(result["conditional_acceptance"]) == set(ROWS)
    for name, values in result["conditional_acceptance"].items():
        row = result["datasets"][name]
        assert len(values) == GAMMA and values == row["conditional_acceptance"]
        assert 0 < row["reached_per_position"][0] <= row["rounds"]   # rounds near max_new_tokens verify fewer
        for v, a, n in zip(values, row["accepted_per_position"], row["reached_per_position"]):
            assert (v is None) == (n == 0) and (v is None or 0 <= v <= 1 and v == round(a / n, 4))


def test_domains_and_identity(bench):
    _, result, _ = bench
    tau = {n: r["acceptance_length"] for n, r in result["datasets"].items()}
    assert result["domains"]["math"] == pytest.approx((tau["gsm8k"] + tau["math500"]) / 2, abs=1e-4)
    assert result["domains"]["code"] == pytest.approx(tau["humaneval"], abs=1e-4)
    assert result["domains"]["chat"] == pytest.approx(tau["mt-bench"], abs=1e-4)
    assert result["macro"] == pytest.approx(sum(result["domains"].values()) / 3, abs=1e-3)
    assert result["identity"] == {"identical": True, "checked": len(ROWS)}
    assert all(r["identical"] is True for r in result["datasets"].values())


def test_write_reports(bench, tmp_path):
    _, result, _ = bench
    paths = write_reports(result, tmp_path / "reports")
    data = paths["conditional_acceptance"].read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 2000
    assert json.loads(paths["json"].read_text())["datasets"] == result["datasets"]
    md = paths["markdown"].read_text()
    assert "| method | gsm8k | math500 | math avg | humaneval | code avg | mt-bench | chat avg | macro |" in md


def test_fixed_k_and_partial_domains(engine_dir, datasets_dir):  # noqa: F811
    cfg = AcceptanceBenchConfig(engine_dir, datasets=("humaneval",), datasets_dir=datasets_dir, samples=1,
                                policy="fixed:2", max_new_tokens=6, temperature=0.7, warmup=False)
    result = run_acceptance_bench(cfg)
    row = result["datasets"]["humaneval"]
    assert result["policy"] == "fixed:2" and row["samples"] == 1
    assert row["rows"] == select_rows(ROWS["humaneval"], 1, cfg.seed)
    assert row["conditional_acceptance"][2:] == [None] * (GAMMA - 2) and row["mean_verify_len"] <= 2
    assert result["domains"] == {"math": None, "code": row["acceptance_length"], "chat": None}
    assert result["macro"] == row["acceptance_length"]
    assert result["identity"] == {"identical": None, "checked": 0} and row["identical"] is None


def test_single_user_ar_baseline(engine_dir, datasets_dir):  # noqa: F811
    """`ar` is the speed baseline (τ = 1); max_concurrency=1 runs one request at a time."""
    cfg = AcceptanceBenchConfig(engine_dir, datasets=("gsm8k",), datasets_dir=datasets_dir, samples=2,
                                policy="ar", max_new_tokens=5, warmup=False, max_concurrency=1)
    result = run_acceptance_bench(cfg)
    row = result["datasets"]["gsm8k"]
    assert result["policy"] == "ar" and row["acceptance_length"] == 1.0 and row["mean_verify_len"] == 0
    assert row["tokens_per_s"] > 0 and result["config"]["max_concurrency"] == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="dspark"), "policy: .*FIXED block.*fixed:K"),
    (dict(max_concurrency=0), "max_concurrency"),
    (dict(policy="threshold:0.5"), "policy: .*fixed:K"),
    (dict(policy="nope"), "policy: expected one of"),
    (dict(datasets=("gsm8k", "aime25")), r"aime25\.jsonl"),
    (dict(samples=0), "samples"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
])
def test_bad_config_raises(engine_dir, datasets_dir, kwargs, match):  # noqa: F811
    with pytest.raises(ConfigError, match=match):
        AcceptanceBenchConfig(engine_dir, **{"datasets": ("gsm8k",), "datasets_dir": datasets_dir, **kwargs})


def test_k_above_block_size(engine_dir, datasets_dir):  # noqa: F811
    cfg = AcceptanceBenchConfig(engine_dir, datasets=("gsm8k",), datasets_dir=datasets_dir, policy="fixed:9")
    with pytest.raises(ConfigError, match=f"fixed:9 .*fixed:1..fixed:{GAMMA}"):
        run_acceptance_bench(cfg)


def test_cli(engine_dir, datasets_dir, tmp_path, capsys):  # noqa: F811
    common = ["bench", "acceptance", "--engine-dir", str(engine_dir), "--datasets-dir", str(datasets_dir)]
    rc = cli_main(common + ["--datasets", "math500,mt-bench", "--samples", "1", "--max-new-tokens", "4",
                            "--no-warmup", "--json", str(tmp_path / "a.json"), "--out-dir", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == 0 and f"| fixed:{GAMMA} |" in out and "[math500]" in err and "greedy identity vs ar: True" in out
    saved = json.loads((tmp_path / "a.json").read_text())
    assert set(saved["datasets"]) == {"math500", "mt-bench"} and saved["datasets"]["math500"]["samples"] == 1
    assert (tmp_path / "out" / "acceptance_conditional.png").stat().st_size > 0
    assert cli_main(common + ["--datasets", "gsm8k", "--policy", "dspark-async"]) == 2
    assert "error: policy:" in capsys.readouterr().err
    assert cli_main(common + ["--datasets", "livecodebench"]) == 2
    assert "livecodebench.jsonl" in capsys.readouterr().err


def test_partial_results_after_each_dataset(engine_dir, datasets_dir):  # noqa: F811
    """An interrupted long run keeps its finished datasets: on_dataset sees each partial result."""
    cfg = AcceptanceBenchConfig(engine_dir, datasets=("gsm8k", "mt-bench"), datasets_dir=datasets_dir, samples=1,
                                max_new_tokens=4, warmup=False)
    seen = []
    result = run_acceptance_bench(cfg, on_dataset=lambda partial: seen.append(json.loads(json.dumps(partial))))
    assert [sorted(p["datasets"]) for p in seen] == [["gsm8k"], ["gsm8k", "mt-bench"]]
    assert [p["complete"] for p in seen] == [False, True] and result["complete"]
    assert seen[0]["domains"]["chat"] is None and seen[-1]["datasets"] == result["datasets"]


def test_cli_json_holds_finished_datasets_when_interrupted(engine_dir, datasets_dir, tmp_path, monkeypatch):  # noqa: F811
    from dspark_export.bench import acceptance as acc

    real = acc._run_dataset

    def stop_on_second(name, *a, **kw):
        if name == "mt-bench":
            raise KeyboardInterrupt
        return real(name, *a, **kw)

    monkeypatch.setattr(acc, "_run_dataset", stop_on_second)
    out = tmp_path / "partial.json"
    rc = cli_main(["bench", "acceptance", "--engine-dir", str(engine_dir), "--datasets-dir", str(datasets_dir),
                   "--datasets", "gsm8k,mt-bench", "--samples", "1", "--max-new-tokens", "4", "--no-warmup",
                   "--json", str(out)])
    assert rc == 130
    saved = json.loads(out.read_text())
    assert list(saved["datasets"]) == ["gsm8k"] and saved["complete"] is False
