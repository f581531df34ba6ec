"""scripts/soak.py on the tiny engine directory with a small N, so the script cannot rot."""

from __future__ import annotations

import json

from ..script_loader import load_script


def _script():
    return load_script("soak.py")


def test_soak_script_small(rel_engine_dir, tmp_path, capsys):
    out = tmp_path / "soak.json"
    rc = _script().main(["--engine-dir", str(rel_engine_dir), "--requests", "48", "--policies", "fixed:4,dspark,ar",
                         "--min-new", "4", "--max-new", "16", "--max-prompt", "80", "--in-flight", "6",
                         "--max-slots", "4", "--bad-every", "10", "--cancel-every", "8", "--warmup", "12",
                         "--json", str(out)])
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"], report
    reasons = report["finish_reasons"]
    assert sum(reasons.values()) == 48 and reasons.get("None", 0) == 0
    assert reasons["error"] == 4 and reasons["cancelled"] >= 4          # 4 invalid on purpose; cancels mid-stream
    assert report["greedy_checked"] >= 8 and report["greedy_mismatches"] == []
    assert report["problems"] == [] and 0 <= abs(report["rss_drift"]) < 0.05


def test_soak_detects_a_wrong_token(rel_engine_dir, monkeypatch):
    """The greedy check is not vacuous: a soak record whose tokens were altered is reported."""
    soak = _script()
    from dspark_export.runtime.api import Runtime

    rt = Runtime.open(rel_engine_dir, policy="ar")
    records = soak.make_records(lambda t: rt.encode(t, chat=True), list(soak.FALLBACK_TEXTS), ["fixed:4"], 6, 4, 8,
                                40, 512, 0, 0, seed=1)
    for r in records:
        r.params["temperature"] = 0.0
    report = soak.run_soak(rt, records, in_flight=3, warmup=2, max_slots=2)
    assert report["problems"] == []
    records[2].tokens = records[2].tokens[:-1] + [(records[2].tokens[-1] + 1) % 256]
    check = soak.check_greedy(rt, records)
    assert check["greedy_checked"] == 6 and [m["request"] for m in check["greedy_mismatches"]] == [2]
