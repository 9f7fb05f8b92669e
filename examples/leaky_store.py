"""A store of your own, profiled by import path: `component: "examples.leaky_store:LeakyStore"`.

It subclasses `StoreBase`, so it writes only what it does (`store`, `nbytes`, `close`) and
inherits the rest of the store protocol (no hits, nothing held outside MLX). With `leak` it
keeps layer 0's keys of every request and says so in `nbytes`: memory at rest grows by exactly
those bytes per request, all reported, which `scenarios/import_path_leak.yaml` expects the
`unbounded` detector to report past its budget (an honest store that never evicts is not a
leak). `examples` is found in the repository root, and in any folder in the copy an installed
kvmem ships (`harness/shipped/examples`), after a package of your own of that name.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from harness import Geometry, StoreBase


class LeakyStore(StoreBase):
    """Never serves a hit; with `leak`, keeps layer 0's keys of every request it stores."""

    def __init__(self, geometry: Geometry, leak: bool = True):
        super().__init__(geometry)
        self.leak = leak
        self.kept: list[mx.array] = []

    def store(self, tokens: tuple[int, ...], caches: list[KVCache]) -> None:
        if self.leak:  # the whole keys buffer, spare slots included, as a careless copy would
            self.kept.append(caches[0].keys)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.kept)

    def close(self) -> None:
        self.kept.clear()
