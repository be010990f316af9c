"""The compiled modules of the package (setup.py lists them), where the install built them.

Each is optional: setup.py builds it where a C compiler is, and its caller keeps the same
operation in Python. TRTLLM_ORCH_PURE_PYTHON=1 leaves every one out (the tests run both ways).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def load(name: str) -> ModuleType | None:
    """The compiled module `name` (a dotted path), or None where it was not built or where
    TRTLLM_ORCH_PURE_PYTHON=1 leaves it out."""
    if os.environ.get("TRTLLM_ORCH_PURE_PYTHON") == "1":
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
