"""Every module of the package imports: a name moved between modules fails here, not in a user's command
(a module imported only by one CLI command is otherwise reached by no test)."""
import importlib
import pkgutil

import pytest

import dspark_export

MODULES = sorted(m.name for m in pkgutil.walk_packages(dspark_export.__path__, "dspark_export."))


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    importlib.import_module(name)
