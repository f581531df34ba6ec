"""`dspark-export report`: the HTML page, its figures, the manifest re-seal, and the screenshot script."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dspark_export.cli import main as cli_main
from dspark_export.engines.inspect import inspect_engine_dir
from dspark_export.engines.manifest import Manifest
from dspark_export.pipeline import BuildConfig, build_engine_dir, reprofile
from dspark_export.training.calibration import Rounds, fit_sts, reliability_bins

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import screenshot_report  # noqa: E402

BUCKETS = dict(target_buckets=(1, 2, 4, 8), request_buckets=(1, 2), max_context=64, profile_context=16,
               profile_repeats=2)
PNG = b"\x89PNG\r\n\x1a\n"


def _calibration(block: int) -> dict:
    """A real STS fit (with reliability bins) on synthetic rounds whose logits are twice too sharp."""
    rng = np.random.default_rng(0)
    z = rng.normal(1.0, 2.0, size=(4000, block))
    rounds = Rounds(z.astype(np.float32), rng.random((4000, block)) < 1 / (1 + np.exp(-z / 2)),
                    np.ones((4000, block), bool), ["x"] * 4000)
    fit = fit_sts(rounds)
    return {"method": "sts", **fit, "fitted_on": "synthetic rounds",
            "reliability": reliability_bins(rounds, fit["confidence_temperature"])}


@pytest.fixture(scope="module")
def engine_dir(tiny_target_dir, tmp_path_factory):
    """A tiny engine directory built from a drafter folder with a calibration.json (the shipped layout)."""
    import torch

    from dspark_export.modeling.checkpoint import save_drafter
    from dspark_export.modeling.config import DrafterConfig
    from dspark_export.modeling.drafter import init_drafter
    from dspark_export.modeling.target import load_target

    tmp = tmp_path_factory.mktemp("report")
    target = load_target(tiny_target_dir)
    drafter = init_drafter(target, DrafterConfig.from_target(target.config, block_size=4, markov_rank=8))
    ckpt = save_drafter(drafter, tmp / "drafter", include_embeddings=False, dtype=torch.float16)
    (ckpt / "calibration.json").write_text(json.dumps(_calibration(4)))
    out = tmp / "eng"
    build_engine_dir(BuildConfig(out=out, target=str(tiny_target_dir), drafter=str(ckpt), **BUCKETS))
    return out


@pytest.fixture
def copy_dir(engine_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(engine_dir, dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


def _error(err: str) -> str:
    """The one error line (progress lines may precede it; no trace without --verbose)."""
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _images(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'<img src="data:image/png;base64,([^"]+)"', html)]


def test_build_writes_a_listed_report_and_inspect_passes(engine_dir):
    m = Manifest.load(engine_dir)
    report = {rel for rel in m.data["files"] if rel.startswith("report/")}
    assert {"report/index.html", "report/report.json", "report/latency.png", "report/sps.png", "report/drafter.png",
            "report/reliability.png", "report/ece.png"} <= report
    assert m.data["report"]["path"] == "report/index.html"
    assert m.data["calibration"] == {"path": "drafter/calibration.json", "method": "sts"}
    inspect_engine_dir(engine_dir)  # every file listed and intact
    html = (engine_dir / "report" / "index.html").read_text()
    images = _images(html)
    assert len(images) == 5 and all(png.startswith(PNG) for png in images)
    # the inlined figures are the PNG files next to the page
    assert {(engine_dir / "report" / f).read_bytes() for f in ("latency.png", "sps.png", "drafter.png",
                                                                 "reliability.png", "ece.png")} == set(images)
    assert "SPS(B) between buckets" in html and "staircase" not in html   # ORT engines run a pass's own rows
    assert m.data["source"]["drafter"]["approximations"] == []    # an imported checkpoint drafts exactly
    assert "<b>Drafting:</b> exact (drafts as the checkpoint" in html


def test_report_data_follows_the_engine_directory(engine_dir):
    data = json.loads((engine_dir / "report" / "report.json").read_text())
    sps = json.loads((engine_dir / "profile" / "sps.json").read_text())
    assert [r["B"] for r in data["profile"]["target"]] == [1, 2, 4, 8]
    assert [r["median_ms"] for r in data["profile"]["target"]] == [r["median_ms"] for r in sps["target"]]
    for i, row in enumerate(data["profile"]["target"]):  # served by the fastest engine whose bucket holds B
        later = sps["target"][i:]
        best = min(later, key=lambda r: (r["median_ms"], r["B"]))
        assert row["served_by"] == best["B"] and row["effective_sps"] == pytest.approx(1000 / best["median_ms"], 1e-3)
    assert [r["R"] for r in data["profile"]["drafter_block"]] == [1, 2]
    att = data["profile"]["attention"]
    assert (att["ms_per_row_entry"], att["ms_per_slot_entry"], att["max_error_pct"]) == \
        (sps["attention"]["ms_per_row_entry"], sps["attention"]["ms_per_slot_entry"], sps["attention"]["max_error_pct"])
    assert [(r["S"], r["Q"], r["P"], r["median_ms"]) for r in att["layouts"]] == \
        [(r["S"], r["Q"], r["P"], r["median_ms"]) for r in sps["attention"]["layouts"]] and att["layouts"]
    engines = {e["graph"]: e for e in data["engines"]}
    assert engines["target"]["buckets"] == [1, 2, 4, 8] and engines["verify"]["buckets"] == [1, 2]
    files = Manifest.load(engine_dir).data["files"]
    assert engines["target"]["data_bytes"] == files["graphs/target.onnx.data"]["bytes"]
    cal = data["calibration"]
    assert cal["matches_engine"] is True and cal["source"] == "drafter/calibration.json"
    assert cal["engine_temperatures"] == Manifest.load(engine_dir).runtime["confidence_temperature"]
    assert data["acceptance"] is None and data["serve"] is None and data["peers"] is None
    html = (engine_dir / "report" / "index.html").read_text()
    assert "Acceptance (offline protocol)" not in html and "Peer benchmark" not in html
    assert "Layout cost" in html and html.count("<td class=\"n\">", html.index("Layout cost")) >= 7


def _acceptance_result(engine_dir) -> dict:
    """The shape `bench acceptance` writes (two datasets, γ = 4)."""
    row = lambda tau: {"domain": "math", "samples": 2, "acceptance_length": tau, "rounds": 10,  # noqa: E731
                       "mean_verify_len": 4.0, "tokens_per_s": 50.0, "identical": True,
                       "conditional_acceptance": [0.5, 0.25, None, None]}
    return {"config": {"max_new_tokens": 8, "temperature": 0.0}, "engine_dir": str(engine_dir), "policy": "fixed:4",
            "block_size": 4, "datasets": {"gsm8k": row(1.5), "math500": row(1.25)},
            "domains": {"math": 1.375, "code": None, "chat": None}, "macro": 1.375,
            "conditional_acceptance": {"gsm8k": [0.5, 0.25, None, None], "math500": [0.5, 0.25, None, None]},
            "identity": {"identical": True, "checked": 2}}


def test_cli_report_regenerates_in_place_with_benchmarks(copy_dir, tmp_path, capsys):
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps(_acceptance_result(copy_dir)))
    serve = tmp_path / "serve.json"
    serve.write_text(json.dumps({"config": {"max_new_tokens": 8}, "results": [
        {"policy": p, "concurrency": c, "throughput_tokens_per_s": 10.0 * c, "per_user_tokens_per_s": 10.0 / c,
         "mean_verify_len": 1.0, "acceptance_length": 1.2, "mean_step_ms": 5.0, "scheduler_ms": 0.01,
         "identical": True} for p in ("ar", "dspark") for c in (1, 2)]}))
    peers = tmp_path / "peers.json"
    peers.write_text(json.dumps({"config": {"prompts": ["a"], "max_new_tokens": 8},
                                 "best_dspark": {"policy": "dspark", "tokens_per_s": 30.0, "ratio_to_ar": 1.5},
                                 "dspark_speedup_over": {"onnxruntime-genai": None}, "results": [
        {"system": "dspark-export ar", "tokens_per_s": 20.0, "ratio_to_ar": 1.0, "tokens": 8},
        {"system": "dspark-export dspark", "tokens_per_s": 30.0, "ratio_to_ar": 1.5, "tokens": 8},
        {"system": "onnxruntime-genai", "tokens_per_s": None, "ratio_to_ar": None, "skipped": "not installed"}]}))
    before = (copy_dir / "report" / "report.json").read_bytes()
    code = cli_main(["report", str(copy_dir), "--acceptance", str(acc), "--serve", str(serve), "--peers", str(peers)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["html"] == str(copy_dir.resolve() / "report" / "index.html")
    assert (copy_dir / "report" / "report.json").read_bytes() != before
    inspect_engine_dir(copy_dir)  # re-sealed: still intact, nothing unlisted
    html = (copy_dir / "report" / "index.html").read_text()
    assert len(_images(html)) == 8 and "math500" in html and "not installed" in html and "×1.50 our ar" in html
    assert {"acceptance.png", "serve.png", "peers.png"} <= {p.name for p in (copy_dir / "report").iterdir()}
    assert not [p for p in copy_dir.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_report_outside_leaves_the_engine_directory_alone(copy_dir, tmp_path, capsys):
    manifest = (copy_dir / "manifest.json").read_bytes()
    out = tmp_path / "elsewhere"
    assert cli_main(["report", str(copy_dir), "--out", str(out)]) == 0
    assert (copy_dir / "manifest.json").read_bytes() == manifest
    assert (out / "index.html").is_file() and (out / "sps.png").read_bytes().startswith(PNG)
    capsys.readouterr()
    code = cli_main(["report", str(copy_dir), "--out", str(copy_dir / "graphs" / "r")])
    _, err = capsys.readouterr()
    assert code == 2 and "inside the engine directory" in _error(err)
    assert not (copy_dir / "graphs" / "r").exists()


@pytest.mark.parametrize("content, match", [("{", "not a readable JSON"), ("[]", "expected a JSON object"),
                                            ('{"x": 1}', "missing \\['datasets', 'block_size'\\]")])
def test_bad_benchmark_json_is_a_one_line_error(engine_dir, tmp_path, capsys, content, match):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    code = cli_main(["report", str(engine_dir), "--out", str(tmp_path / "r"), "--acceptance", str(bad)])
    _, err = capsys.readouterr()
    assert code == 2 and re.search(match, _error(err)) and str(bad) in err


def test_altered_engine_directory_is_refused(copy_dir, tmp_path, capsys):
    (copy_dir / "profile" / "sps.json").write_text("{}")
    code = cli_main(["report", str(copy_dir), "--out", str(tmp_path / "r")])
    _, err = capsys.readouterr()
    assert code == 2 and "'profile/sps.json'" in _error(err)


def test_reprofile_refreshes_the_report(copy_dir):
    reprofile(copy_dir, context_len=8, repeats=1)
    data = json.loads((copy_dir / "report" / "report.json").read_text())
    assert data["profile"]["context_len"] == 8
    inspect_engine_dir(copy_dir)


def test_untrained_engine_without_calibration(tiny_target_dir, tmp_path):
    out = tmp_path / "eng"
    build_engine_dir(BuildConfig(out=out, target=str(tiny_target_dir), drafter="untrained", block_size=4,
                                 markov_rank=8, **BUCKETS))
    data = json.loads((out / "report" / "report.json").read_text())
    assert data["calibration"]["source"] is None and data["calibration"]["calibrated"] is False
    html = (out / "report" / "index.html").read_text()
    assert "No calibration file is recorded" in html and len(_images(html)) == 3
    approx = Manifest.load(out).data["source"]["drafter"]["approximations"]    # a fresh drafter: int8 head
    assert approx and all(f"<code>{a['name']} = {a['value']}</code>" in html for a in approx) and "exact (" not in html


def test_screenshot_script_checks_images(engine_dir, tmp_path):
    page = tmp_path / "index.html"
    page.write_text('<img src="data:image/png;base64,' + base64.b64encode(PNG + b"junk").decode() + '">'
                    '<img src="missing.png">')
    lines = screenshot_report.check_images(page)
    assert lines[0].startswith("BROKEN img #1") and "missing.png does not exist" in lines[1]
    ok = screenshot_report.check_images(engine_dir / "report" / "index.html")
    assert len(ok) == 5 and all(line.startswith("ok ") for line in ok)


needs_chromium = pytest.mark.skipif(
    not any(shutil.which(b) for b in screenshot_report.BROWSERS),
    reason=f"no Chromium on PATH (looked for {', '.join(screenshot_report.BROWSERS)}): `bash scripts/test_deps.sh` "
           "installs it as root (Debian: apt-get install chromium)")


@needs_chromium
def test_screenshot_in_headless_chromium(engine_dir, tmp_path):
    """The report as Chromium shows it: every figure decoded, on the page and drawn (not blank). The window is
    tall enough for a page that also lists the profile's warnings (a build timed on a loaded machine has a few,
    each a line above the last figure)."""
    shot = tmp_path / "shot.png"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "screenshot_report.py"),
                           str(engine_dir / "report" / "index.html"), "--out", str(shot), "--height", "4000"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shown = [line for line in proc.stdout.splitlines() if "in Chromium" in line]
    assert [line.split(":")[0] for line in shown] == [f"ok img #{n} in Chromium" for n in range(1, 6)], proc.stdout
    w, h = screenshot_report.png_size(shot.read_bytes())
    assert w == 1280 and 500 < h <= 4000


@needs_chromium
def test_chromium_finds_what_the_file_check_cannot(tmp_path):
    """PNGs whose signature and IHDR are fine but whose pixels are garbled or missing pass the file check;
    in Chromium they do not decode. A white PNG decodes but is blank; a figure below the window is unseen."""
    import io

    from PIL import Image, ImageDraw

    def png(blank: bool) -> bytes:
        im, buf = Image.new("RGB", (200, 100), "white"), io.BytesIO()
        if not blank:
            ImageDraw.Draw(im).line((0, 0, 199, 99), fill="black", width=3)
        im.save(buf, "PNG")
        return buf.getvalue()

    good = png(blank=False)
    srcs = [good, png(blank=True), good[:33] + bytes(40) + good[73:], good[:40]]
    page = tmp_path / "page.html"
    page.write_text("<html><head></head><body>" + "".join(
        f'<p><img src="data:image/png;base64,{base64.b64encode(s).decode()}"></p>' for s in srcs)
        + '<p><img src="missing.png"></p><div style="height: 600px"></div><img src="ok.png"></body></html>')
    (tmp_path / "ok.png").write_bytes(good)
    assert [line.split(" ")[0] for line in screenshot_report.check_images(page)] == ["ok"] * 4 + ["BROKEN", "ok"]
    lines = screenshot_report.screenshot(page, tmp_path / "shot.png", 800, 700, screenshot_report.find_browser(None),
                                         timeout=120)
    assert lines[0].startswith("ok img #1 in Chromium: 200x100 shown 200x100"), lines
    assert "blank" in lines[1] and lines[1].startswith("BROKEN img #2")
    assert all(line.startswith(f"BROKEN img #{n} in Chromium: not decoded") for n, line in zip((3, 4, 5), lines[2:5]))
    assert "missing.png" in lines[4]
    assert lines[5].startswith("BROKEN img #6") and "outside the 800x700 screenshot" in lines[5], lines
    assert len(lines) == 6


def test_inspect_shows_the_calibration_and_report(engine_dir, capsys):
    assert cli_main(["inspect", str(engine_dir), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    cal = json.loads((engine_dir / "drafter" / "calibration.json").read_text())
    assert d["calibration"]["path"] == "drafter/calibration.json" and d["calibration"]["reliability_bins"] is True
    assert d["calibration"]["temperatures"] == cal["confidence_temperature"] and d["calibration"]["calibrated"]
    assert d["calibration"]["ece_after"] == cal["ece_after"]
    assert d["report"]["path"] == "report/index.html"
    assert cli_main(["inspect", str(engine_dir)]) == 0
    text = capsys.readouterr().out
    assert "calibration  STS temperatures" in text and "drafter/calibration.json (sts, 4000 rounds; mean ECE" in text
