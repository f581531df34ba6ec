"""Docstrings say what, why, shapes, units and sources; measurement histories (results of runs, A/B
comparisons, before → after timings) go to reports/measurement_history.md, where they can carry their
commands and go stale without misleading a reader of the code. This lint holds that over src/.

What counts as a measurement history (the project's pattern; a worked example computed from stated
numbers is not one): an "A/B"; "N repeats"; a number → number change; "took N ms"; "measured ..." with a
number and a unit; two results set against each other ("N ms against M ms", "0.53 against 0.47"); a
figure with a unit given for SmolLM2 on a machine ("SmolLM2: 3.3 s", "SmolLM2 greedy: 14 tokens/s").
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dspark_export"
UNIT = r"(?:ms|µs|s|tok/s|tokens/s|MB|GB|%)"
NUM = r"[~≈]?\d[\d.,]*"
PATTERNS = {
    "A/B": re.compile(r"\bA/B\b"),
    "N repeats": re.compile(r"\b\d+\s+repeats\b"),
    "x → y": re.compile(rf"{NUM}\s*{UNIT}?\s*(?:→|->)\s*{NUM}"),
    "took N": re.compile(rf"\btook\s+{NUM}\s*{UNIT}\b"),
    "measured ... N unit": re.compile(rf"\b[Mm]easured\b[^.;]{{0,160}}?{NUM}\s*{UNIT}(?![\w])"),
    "N against M": re.compile(rf"{NUM}\s*{UNIT}?\s+(?:against|vs\.?|versus)\s+{NUM}"),
    "SmolLM2: N unit": re.compile(rf"\bSmolLM2\b[^.;()]{{0,60}}?:\s*[^.;]{{0,40}}?{NUM}\s*{UNIT}(?![\w])"),
}


def histories(root: Path = SRC) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node, clean=False) or ""
            for name, pattern in PATTERNS.items():
                for m in pattern.finditer(doc):
                    where = f"{path.relative_to(root)}:{getattr(node, 'lineno', 1)} {getattr(node, 'name', '<module>')}"
                    found.append(f"{where} [{name}]: ...{doc[max(0, m.start() - 40):m.end() + 20]!r}...")
    return found


def test_no_measurement_history_in_docstrings():
    found = histories()
    assert not found, ("measurement histories belong in reports/measurement_history.md (with their commands), "
                       "not in docstrings:\n" + "\n".join(found))


def test_the_pattern_finds_histories_and_spares_worked_examples(tmp_path):
    (tmp_path / "m.py").write_text('''
def a():
    """Margin 0 → 0.2: C = 1 0.99 → 1.05 (4 repeats)."""
def b():
    """A 170-token chunk took 552 ms over capacity 512."""
def c():
    """Measured on 2 CPU cores: bfloat16 batch 64 gives ~197 tok/s."""
def d():
    """On a CPU the drafter block can cost half a target pass (SmolLM2: 16 ms vs 26 ms at R=1)."""
def e():
    """Worked example: buckets {2: 100, 4: 90} steps/s, Θ = 2.9·90 = 261 tokens/s; d(1) = 10 ms."""
def f():
    """Reads the [V, H] head (113 MB in fp32 for SmolLM2); top-k keeps values >= the k-th largest."""
''')
    found = histories(tmp_path)
    assert {line.split()[1] for line in found} == {"a", "b", "c", "d"}, found
