"""A user's module beside the topology file: what ``module:function`` references (a reward, a learner factory) load.

Invariant: a module found in the given directory is loaded under a name of its own (``NAMESPACE.module``),
so it neither shadows nor is shadowed by an installed module of the same name; the directory is on
``sys.path`` only while it loads (for the helpers it imports from beside it).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def import_beside(mod_name: str, directory: str | None, namespace: str) -> Any:
    """``directory/mod_name.py`` when it exists, else the installed module ``mod_name``."""
    path = Path(directory or ".") / (mod_name.replace(".", "/") + ".py")
    if directory is None or not path.is_file():
        return importlib.import_module(mod_name)
    spec = importlib.util.spec_from_file_location(f"{namespace}.{mod_name}", path)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(directory)
    return mod
