"""`reference.rotating`: mlx-lm's `RotatingKVCache` as a cache that allocates its whole window
once (seed 002; the class and what it fixes are in `reference_impl.rotating_window`).

The batch variant's module is imported here for what it does when it runs: it tells the single
class which batch class `merge` makes. It imports nothing from this module, so the two stay
apart.
"""

from __future__ import annotations

from typing import Any

from harness.common.moved import forward
from harness.components.protocols import with_estimate
from harness.models.geometry import LayerSpec

from . import rotating_batch  # noqa: F401  # sets PreallocatedRotatingKVCache.batch
from .rotating_window import PreallocatedRotatingKVCache, estimate_bytes, window_size

__all__ = ["PreallocatedRotatingKVCache", "rotating"]


@with_estimate(estimate_bytes)
def rotating(spec: LayerSpec, max_size: int | None = None, keep: int = 0) -> PreallocatedRotatingKVCache:
    """Factory for `reference.rotating`: `max_size` defaults to the layer's window."""
    return PreallocatedRotatingKVCache(window_size(spec, max_size), keep)


def __getattr__(name: str) -> Any:
    """`PreallocatedBatchRotatingKVCache` moved to `reference_impl.rotating_batch`: this path
    warns, and works until kvmem 0.3.0 removes it."""
    return forward(__name__, name, "reference_impl.rotating_batch",
                   names=("PreallocatedBatchRotatingKVCache",))
