"""Size rules that keep the runtime readable (issue 20): every runtime module ≤ 450 lines, no class in the
package over 20 methods, and the speculative step (`Generator.speculative_step`) ≤ 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dspark_export"
MAX_RUNTIME_LINES, MAX_METHODS, MAX_STEP_LINES = 450, 20, 60


def test_runtime_modules_stay_short():
    long = {p.name: n for p in (SRC / "runtime").glob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_RUNTIME_LINES}
    assert not long, f"runtime modules over {MAX_RUNTIME_LINES} lines: {long}"


def test_no_class_has_more_than_20_methods():
    big = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                count = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if count > MAX_METHODS:
                    big.append(f"{path.relative_to(SRC)}: {node.name} has {count} methods")
    assert not big, "\n".join(big)


def test_the_speculative_step_fits_on_one_screen():
    tree = ast.parse((SRC / "runtime" / "generator.py").read_text(encoding="utf-8"))
    [step] = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "speculative_step"]
    assert step.end_lineno - step.lineno + 1 <= MAX_STEP_LINES
