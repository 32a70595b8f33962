"""Lazy re-exports: `from package import name` imports the defining module only then.

Package roots use it so that `prefect-accelerate --help` never imports Prefect or torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` that loads `name` from `exports[name]` on first use."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
