"""Stores with one memory bug each, for the detectors' canaries in `scenarios/canaries.yaml`.

Each has a switch between the bug and its fix, so a variant and its clean twin differ only in it:
- `EvictingStore`: keeps the newest `max_entries` requests (all when None) and reports them; with
  `broken_eviction` it drops an evicted entry from its list but not from its lookup index, so
  the arrays stay alive unreported (`leak`). Unlimited, it grows honestly (`unbounded`).
- `SlicingStore`: keeps each request trimmed to its tokens; `trim: slice` keeps views that pin
  the spare slots of every buffer while reporting the view (`retained`, a few % per entry).
- `CyclicStore`: each entry keeps the helper that copies it back out; with `cyclic` the helper
  closes over its own entry, so an evicted entry lives until the cycle collector runs
  (`gc_deferred`).
- `PoolingStore`: keeps nothing, but raises MLX's buffer cache limit (`cache_limit`, a size)
  while it is open, so the buffers every request frees stay pooled at rest (`pooled`); null
  leaves the limit as it is.

Loaded by import path, as `examples/leaky_store.py`: from the repository root, or from kvmem's
own copy in any folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import mlx.core as mx

from harness import Geometry, LayerCache, StoreBase, parse_size, state_range

TRIMS = ("slice", "copy")


def trimmed(caches: list[LayerCache], copy: bool = True) -> list[mx.array]:
    """Every layer's keys and values cut to the tokens held (`state_range`): new buffers, or
    (copy false) the views themselves, which keep the buffers' spare slots alive."""
    views = [x for cache in caches for x in state_range(cache, 0, cache.offset)[:2]]
    arrays = [mx.contiguous(x) for x in views] if copy else views
    mx.eval(arrays)
    return arrays


def _copies(arrays: list[mx.array]) -> list[mx.array]:
    return [mx.array(a) for a in arrays]


@dataclass(eq=False)
class Entry:
    """One stored request: its arrays and, for a hit, the helper that copies them out. Compared
    by identity, as an index finds it."""

    arrays: list[mx.array]
    copy_out: Callable[[], list[mx.array]] | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class CanaryStore(StoreBase):
    """Keeps each finished request as an `Entry`, the newest `max_entries` (all when None), and
    reports every byte of what it keeps. Serves no hits: the canaries look at what is kept."""

    def __init__(self, geometry: Geometry, max_entries: int | None = None):
        super().__init__(geometry)
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"max_entries must be at least 1 or null, got {max_entries}")
        self.max_entries = max_entries
        self.entries: list[Entry] = []

    def entry(self, caches: list[LayerCache]) -> Entry:
        return Entry(trimmed(caches))

    def store(self, tokens: tuple[int, ...], caches: list[LayerCache]) -> None:
        self.entries.append(self.entry(caches))
        while self.max_entries is not None and len(self.entries) > self.max_entries:
            self.evict(self.entries.pop(0))

    def evict(self, entry: Entry) -> None:
        """An entry has left `entries`; what else must let go of it."""

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def close(self) -> None:
        self.entries.clear()


class EvictingStore(CanaryStore):
    """Entries are also indexed for lookup, newest first; eviction must drop them from both."""

    def __init__(self, geometry: Geometry, max_entries: int | None = None,
                 broken_eviction: bool = False):
        super().__init__(geometry, max_entries)
        self.broken_eviction = broken_eviction
        self.index: list[Entry] = []

    def entry(self, caches: list[LayerCache]) -> Entry:
        made = super().entry(caches)
        self.index.insert(0, made)
        return made

    def evict(self, entry: Entry) -> None:
        if not self.broken_eviction:  # the bug: the index keeps the evicted arrays alive
            self.index.remove(entry)

    def close(self) -> None:
        super().close()
        self.index.clear()


class SlicingStore(CanaryStore):
    """Entries trimmed to their tokens by `slice` (views pinning the spare slots) or `copy`."""

    def __init__(self, geometry: Geometry, trim: str = "copy"):
        if trim not in TRIMS:
            raise ValueError(f"trim must be one of {TRIMS}, got {trim!r}")
        super().__init__(geometry)
        self.trim = trim

    def entry(self, caches: list[LayerCache]) -> Entry:
        return Entry(trimmed(caches, copy=self.trim == "copy"))


class CyclicStore(CanaryStore):
    """Each entry keeps a helper to copy it out on a hit; `cyclic` makes it close over the entry
    itself (entry -> helper -> entry), so a dropped entry waits for the cycle collector."""

    def __init__(self, geometry: Geometry, max_entries: int | None = 1, cyclic: bool = True):
        super().__init__(geometry, max_entries)
        self.cyclic = cyclic

    def entry(self, caches: list[LayerCache]) -> Entry:
        made = Entry(trimmed(caches))
        if self.cyclic:
            made.copy_out = lambda: _copies(made.arrays)
        else:
            made.copy_out = partial(_copies, made.arrays)
        return made


class PoolingStore(StoreBase):
    """Keeps nothing; with `cache_limit` (bytes) MLX's buffer cache may keep that much of what
    is freed, from construction until `close`, which restores the limit it found."""

    def __init__(self, geometry: Geometry, cache_limit: int | str | None = None):
        super().__init__(geometry)
        limit = None if cache_limit is None else parse_size(cache_limit)
        self._previous = None if limit is None else mx.set_cache_limit(limit)

    def store(self, tokens: tuple[int, ...], caches: list[LayerCache]) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return 0

    def close(self) -> None:
        if self._previous is not None:
            mx.set_cache_limit(self._previous)
            self._previous = None
