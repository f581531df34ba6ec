"""scripts/gpu_check.sh: valid bash, and on a machine without a GPU it degrades to its documented "no GPU" table."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi: the script would "
                                                                    "run its GPU stages (minutes), not the no-GPU path")
def test_without_a_gpu_it_prints_the_table_and_exits_2(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    table = result.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("stage"))
    rows = {line.split()[0]: line.split()[1] for line in table[header + 1:]}
    assert rows == {"env": "no", "versions": "info", "install": "no", "kernels": "no", "trt-tests": "no",
                    "trt-dir": "no"}  # "no GPU" (first word)
    assert (tmp_path / "gpu_check.tsv").is_file() and (tmp_path / "versions.json").is_file()


def test_trt_tests_stage_is_not_ok_when_every_test_skipped(tmp_path):
    """GPU_CHECK_ASSUME_GPU=1 runs the GPU stages here; a stand-in `tensorrt` (imports, but is not the
    TensorRT bindings) makes the trt-tests stage run, every TensorRT test skip and pytest exit 0: the stage
    must read FAILED with the skip reason, not "ok"."""
    import os

    for name in ("triton", "polygraphy"):  # else the install stage would pip install them (network)
        pytest.importorskip(name)
    fake = tmp_path / "fake"
    (fake / "tensorrt").mkdir(parents=True)
    (fake / "tensorrt" / "__init__.py").write_text('__version__ = "0.0.0"  # a stand-in, no Builder\n')
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("DSPARK_ENGINE_DIR", "GPU_CHECK_BUDGET_S")}
    env.update(GPU_CHECK_ASSUME_GPU="1", PYTHONPATH=str(fake))
    result = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=400, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    rows = {}
    for line in (out / "gpu_check.tsv").read_text().splitlines():
        stage, status, _, detail = line.split("\t")
        rows[stage] = (status, detail)
    assert rows["trt-tests"][0] == "FAILED", rows
    assert "nothing passed" in rows["trt-tests"][1] and "SKIPPED" in rows["trt-tests"][1]
    assert " skipped" in (out / "trt-tests.log").read_text()
    assert rows["trt-dir"] == ("skipped", "set DSPARK_ENGINE_DIR to build a real engine directory")
