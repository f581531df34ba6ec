"""The package's layer rules (docs/ARCHITECTURE.md, "Layers"), checked over every import in src/.

Layers, bottom to top: the base modules (errors, progress, datasets, figures) → {modeling, plugins} → exporter →
engines → runtime → {bench, report, training} → pipeline → cli. A module imports only from its own unit
and from units below it; the members of one brace do not import each other; and no module imports a
private name (``_name``) of another module, nor a private module (``_name.py``) from outside its package.
Imports inside functions count too (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "dspark_export"
PACKAGE = "dspark_export"

#: unit → its layer (higher imports lower; equal layers are siblings that must not import each other)
LAYERS = {
    "errors": 0, "progress": 0, "datasets": 0, "figures": 0, "__init__": 0,
    "modeling": 1, "plugins": 1,
    "exporter": 2,
    "engines": 3,
    "runtime": 4,
    "bench": 5, "report": 5, "training": 5,
    "pipeline": 6, "serve": 6,
    "cli": 7,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, imported names) of every import in the file ([] names for `import x`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [alias.name for alias in node.names]
            # `from pkg import submodule` names a module: count it as importing pkg.submodule
            if (SRC.parent / module.replace(".", "/")).is_dir():
                for name in names:
                    sub = SRC.parent / module.replace(".", "/") / name
                    if sub.with_suffix(".py").is_file() or sub.is_dir():
                        out.append((node.lineno, f"{module}.{name}", []))
                    else:
                        out.append((node.lineno, module, [name]))
            else:
                out.append((node.lineno, module, names))
    return out


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def layer_breaks() -> list[str]:
    breaks = []
    for path in sorted(SRC.rglob("*.py")):
        here = _module_name(path)
        unit = _unit(here)
        assert unit in LAYERS, f"{path}: unit {unit!r} has no layer; add it to LAYERS and docs/ARCHITECTURE.md"
        for line, module, names in _imports(path):
            where = f"{path.relative_to(SRC.parent)}:{line}"
            if module != PACKAGE and not module.startswith(PACKAGE + "."):
                continue
            other = _unit(module)
            if other != unit:
                if LAYERS[other] > LAYERS[unit]:
                    breaks.append(f"{where}: {unit} (layer {LAYERS[unit]}) imports {module} (layer {LAYERS[other]})")
                elif LAYERS[other] == LAYERS[unit] and LAYERS[unit] > 0:
                    breaks.append(f"{where}: {unit} imports its sibling {module}")
            if module != here:
                for name in names:
                    if _private(name):
                        breaks.append(f"{where}: imports the private name {name} of {module}")
                private_parts = [p for p in module.split(".") if _private(p)]
                if private_parts:
                    owner = module.rpartition("." + private_parts[0])[0]
                    if not here.startswith(owner + ".") and here != owner:
                        breaks.append(f"{where}: imports the private module {module} from outside {owner}")
    return breaks


def test_no_layer_breaks():
    breaks = layer_breaks()
    assert not breaks, "layer breaks (docs/ARCHITECTURE.md, Layers):\n" + "\n".join(breaks)


@pytest.mark.parametrize("unit, source, expected", [
    ("engines", "from ..runtime.scheduler import x\n", "engines (layer 3) imports dspark_export.runtime.scheduler (layer 4)"),
    ("training", "from ..bench import common\n", "training imports its sibling dspark_export.bench.common"),
    ("runtime", "from ..engines.sps import _rows\n", "imports the private name _rows of dspark_export.engines.sps"),
    ("runtime", "from ..modeling._atomic import x\n", "imports the private module dspark_export.modeling._atomic"),
    ("runtime", "from ..engines import sps\nimport dspark_export.errors\n", None),
])
def test_the_checker_reports_what_it_should(tmp_path, monkeypatch, unit, source, expected):
    """The checker itself: upward and sibling imports and private names are reported; a downward import is not."""
    root = tmp_path / PACKAGE
    for name in ("engines", "runtime", "bench", "training", "modeling"):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text("")
    for module in ("engines/sps.py", "bench/common.py", "modeling/_atomic.py", "errors.py", "__init__.py"):
        (root / module).write_text("")
    (root / unit / "probe.py").write_text(source)
    monkeypatch.setitem(globals(), "SRC", root)
    breaks = layer_breaks()
    if expected is None:
        assert breaks == [], breaks
    else:
        assert any(expected in b for b in breaks), breaks
