"""Every module of the package imports: a name moved between modules fails here, not in a user's command
(a module imported only by one CLI command is otherwise reached by no test)."""
import importlib
import importlib.util
import pkgutil

import pytest

import dspark_export

MODULES = sorted(m.name for m in pkgutil.walk_packages(dspark_export.__path__, "dspark_export."))


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    importlib.import_module(name)


def _script_imports():
    """(script, module, name) for every ``from dspark_export... import name`` in scripts/*.py, at any depth."""
    import ast
    from pathlib import Path

    out = []
    for path in sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dspark_export"):
                out += [(path.name, node.module, a.name) for a in node.names]
    return out


@pytest.mark.parametrize("script,module,name", _script_imports())
def test_script_imports_exist(script, module, name):
    """The scripts import inside functions, so a moved name breaks them only when run (scripts/bench_quant.py
    did): every name they import from the package exists where they look."""
    mod = importlib.import_module(module)
    assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}") is not None, \
        f"scripts/{script}: `from {module} import {name}`: {module} has no {name}"
