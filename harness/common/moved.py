"""Names that moved keep their old import path for one release (docs/api.md, "Deprecation").

A module that names moved is left in place holding only a module `__getattr__` (PEP 562) that
calls `forward`: the name is found where it lives now, and the caller is warned with a
`DeprecationWarning` that names the new path, so code written against the old one runs on,
and says what to change, until the release that removes it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Collection
from typing import Any

REMOVED_IN = "0.3.0"  # kept through the next release (0.2.0), gone in the one after


def forward(old: str, name: str, new: str, names: Collection[str] | None = None) -> Any:
    """`name` looked up on the module `old` that no longer holds it: taken from `new`, where
    it moved, with a warning naming that path. `names`, if given, are the only names that
    moved (the rest of `old` is its own); any other name is an AttributeError, as usual."""
    moved = not name.startswith("__") and (names is None or name in names)
    value = getattr(importlib.import_module(new), name, None) if moved else None
    if value is None:
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    warnings.warn(f"{old}.{name} has moved: import it from {new} ({old} is removed in kvmem "
                  f"{REMOVED_IN})", DeprecationWarning, stacklevel=3)
    return value
