"""Load a file of `scripts/` as a module, for the tests that run each script so it cannot rot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(filename: str) -> ModuleType:
    """`scripts/<filename>` executed as a fresh module named `script_<stem>`."""
    spec = importlib.util.spec_from_file_location(f"script_{Path(filename).stem}", SCRIPTS / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while the module runs
    spec.loader.exec_module(module)
    return module
