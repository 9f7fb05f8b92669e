"""kvmem: memory profiling and regression gate for KV-cache strategies on MLX.

The names users write against (docs/api.md) are exported here, lazily (PEP 562): a name's
module is imported when the name is first used, so `import harness`, and the gate and the judge
beneath it, import no MLX. Where a name lives inside the package may change; `harness.NAME`
stays.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names for type checkers, re-exported ("X as X")
    from .common.units import format_bytes as format_bytes
    from .common.units import parse_size as parse_size
    from .components.protocols import Estimated as Estimated
    from .components.protocols import LayerCache as LayerCache
    from .components.protocols import Session as Session
    from .components.protocols import SessionBase as SessionBase
    from .components.protocols import Store as Store
    from .components.protocols import StoreBase as StoreBase
    from .components.protocols import TokenRanged as TokenRanged
    from .components.protocols import Trimmable as Trimmable
    from .components.protocols import join_ranges as join_ranges
    from .components.protocols import state_range as state_range
    from .components.protocols import with_estimate as with_estimate
    from .models.geometry import KIND_FULL as KIND_FULL
    from .models.geometry import KIND_RECURRENT as KIND_RECURRENT
    from .models.geometry import KIND_SLIDING as KIND_SLIDING
    from .models.geometry import Geometry as Geometry
    from .models.geometry import LayerSpec as LayerSpec

# Each exported name by the module that defines it.
_EXPORTS = {
    **dict.fromkeys(("LayerCache", "Trimmable", "TokenRanged", "Store", "StoreBase", "Session",
                     "SessionBase", "Estimated", "with_estimate", "state_range", "join_ranges"),
                    "harness.components.protocols"),
    **dict.fromkeys(("Geometry", "LayerSpec", "KIND_FULL", "KIND_SLIDING", "KIND_RECURRENT"),
                    "harness.models.geometry"),
    **dict.fromkeys(("parse_size", "format_bytes"), "harness.common.units"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
