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
