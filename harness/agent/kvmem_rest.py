"""What a point at rest measures beside MLX's counters: the MLX bytes that only unreachable
reference cycles hold, who holds the live arrays (`kvmem_holders`), and the freed heap handed
back so that RSS shows what is held.

Standalone, as `kvmem_agent` is (the standard library, and MLX where the process has it): the
agent imports it in a server, kvmem's probe in a variant's process, so both measure alike.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

if __package__:  # harness.agent.kvmem_rest, in kvmem
    from . import kvmem_holders
else:  # kvmem_rest, beside kvmem_agent on a server's PYTHONPATH
    import kvmem_holders  # type: ignore[import-not-found, no-redef]


def _libc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim` from the symbols already loaded, or None (macOS, musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


_MALLOC_TRIM = _libc_trim()


def release_freed_heap() -> None:
    """Hand memory glibc keeps after `free` back to the kernel, so RSS shows what is held.

    On the CPU backend MLX buffers come from malloc; once freed, glibc keeps many of their pages
    mapped, and RSS at a quiescent point would read them as host memory still in use.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def unreachable() -> list:
    """The objects a collection would free now, found without freeing them.

    With DEBUG_SAVEALL the collector moves what it finds unreachable into `gc.garbage` instead of
    freeing it; they are taken out again, so once the caller drops the list they are garbage
    again, freed at the next collection as in the program. (Their finalizers and weak-reference
    callbacks run now, as in any collection, and the objects that survive move to the oldest
    generation.)
    """
    flags, before = gc.get_debug(), len(gc.garbage)
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(flags)
    found = gc.garbage[before:]
    del gc.garbage[before:]
    return found


class Rest(NamedTuple):
    """What a point at rest measured: the MLX bytes only unreachable cycles hold (each array's
    own bytes, shared buffers counted per array), and the census of who holds the live arrays
    (`kvmem_holders.Census`; None where not asked)."""

    cyclic: int
    census: Any


def at_rest(cycles: bool, holders: bool, skip_threads: Collection[int] = (),
            skip_frame: Any = None, skip_modules: Collection[str] = ()) -> Rest:
    """Measure a point at rest, with nothing in flight: cycle garbage where `cycles`, the
    holders where `holders` (one collection serves both: the walk names the cycles it found),
    then hand the freed heap back (the walk's own too) before the counters are read. The walk
    skips `skip_threads`, in the calling thread `skip_frame` and what it called, and the
    globals of `skip_modules`. In a process without MLX there is nothing to measure but the
    heap."""
    try:
        import mlx.core as mx
    except ImportError:
        release_freed_heap()
        return Rest(0, None)
    garbage = unreachable() if cycles else []
    census = None
    if holders:
        census = kvmem_holders.census(mx, garbage=garbage, skip_threads=skip_threads,
                                      skip_frame=skip_frame, skip_modules=skip_modules)
    cyclic = sum(obj.nbytes for obj in garbage if isinstance(obj, mx.array))
    del garbage  # the cycles are garbage again, freed whenever the collector next runs
    release_freed_heap()
    return Rest(cyclic, census)
