"""Per-step memory probe: MLX counters and process RSS, in compact columns.

The MLX counters cost well under a microsecond each; what a step pays is the synchronize that
makes them exact (tens of microseconds, a round trip to MLX's worker thread) and the RSS read.
Rows go into a numpy structured array that doubles as needed (under 100 bytes a row), so a
million-step run stays under 100 MB and becomes a DataFrame only at the end.

`cyclic` is nonzero only at idle points: the MLX bytes that only Python's cycle collector would
free there (`cycle_garbage`), memory that unreachable reference cycles hold until it runs.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pandas as pd
import psutil

PHASES = ("idle", "prefill", "decode", "fetch", "store", "evict")

ROW = np.dtype([
    ("step", np.int64), ("phase", np.uint8), ("request", np.int32), ("turn", np.int32),
    ("tokens", np.int64), ("active", np.int64), ("peak", np.int64), ("cache", np.int64),
    ("rss", np.int64), ("logical", np.int64), ("host", np.int64), ("minimum", np.int64),
    ("work", np.int64), ("cyclic", np.int64),
])


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


def cycle_garbage() -> int:
    """The MLX bytes held by unreachable reference cycles, measured without freeing them.

    With DEBUG_SAVEALL the collector moves what it finds unreachable into `gc.garbage` instead
    of freeing it: the arrays among it are what a collection would free. The list is emptied
    again, so the cycles stay garbage, freed whenever the collector next runs, as in a server.
    (That garbage's finalizers and weak-reference callbacks run now, as in any collection, and
    the objects that survive move to the oldest generation.) Arrays that share a buffer count
    their own bytes each. Called where nothing is in flight.
    """
    flags, before = gc.get_debug(), len(gc.garbage)
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
    finally:
        gc.set_debug(flags)
    held = sum(obj.nbytes for obj in gc.garbage[before:] if isinstance(obj, mx.array))
    del gc.garbage[before:]
    return held


def current_rss() -> int:
    """This process's resident set size in bytes.

    On Linux one `pread` of /proc/<pid>/statm on a descriptor kept open (about 1.5 us, a tenth
    of psutil's open/read/close of the same file); elsewhere psutil. Readers are kept per pid,
    so a forked child never reads its parent's figure.
    """
    pid = os.getpid()
    reader = _RSS_READERS.get(pid)
    if reader is None:
        reader = _RSS_READERS[pid] = _rss_reader(pid)
    return reader()


def _rss_reader(pid: int) -> Callable[[], int]:
    if sys.platform.startswith("linux"):
        try:
            fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
        except OSError:
            pass
        else:
            page = os.sysconf("SC_PAGE_SIZE")
            return lambda: int(os.pread(fd, 128, 0).split()[1]) * page
    process = psutil.Process(pid)
    return lambda: process.memory_info().rss


_RSS_READERS: dict[int, Callable[[], int]] = {}


class Probe:
    """Brackets each step: `begin()` before the work, `end(...)` after it.

    The step peak is max(peak since reset, active before, active after), because
    `reset_peak_memory` sets the counter to zero rather than to the active bytes.
    `end` synchronizes the default stream and every stream given to `watch` (a real model's
    generation stream, where work is still queued when a decode step yields its token).
    """

    def __init__(self, capacity: int = 4096):
        self._rows = np.zeros(capacity, dtype=ROW)
        self._n = 0
        self._before = 0
        self._streams: list[mx.Stream | mx.ThreadLocalStream] = []

    def watch(self, stream: mx.Stream | mx.ThreadLocalStream) -> None:
        """Synchronize `stream` too before each reading."""
        self._streams.append(stream)

    def begin(self) -> None:
        # The previous step ended synchronized and only Python ran since (frees are immediate),
        # so active is exact here without a second synchronize, which costs ~10 us on CPU.
        self._before = mx.get_active_memory()
        mx.reset_peak_memory()

    def end(self, phase: str, request: int, turn: int, tokens: int,
            logical: int, host: int, minimum: int, work: int, cyclic: int = 0) -> None:
        for stream in self._streams:
            mx.synchronize(stream)
        mx.synchronize()
        active = mx.get_active_memory()
        peak = max(mx.get_peak_memory(), self._before, active)
        if self._n == len(self._rows):
            self._rows = np.resize(self._rows, 2 * len(self._rows))
        self._rows[self._n] = (
            self._n, PHASES.index(phase), request, turn, tokens, active, peak,
            mx.get_cache_memory(), current_rss(), logical, host, minimum, work, cyclic,
        )
        self._n += 1

    @property
    def steps(self) -> int:
        return self._n

    def rows(self) -> np.ndarray:
        return self._rows[: self._n]


class NullProbe(Probe):
    """The same loop with the measurement left out: the benchmark's reference."""

    def begin(self) -> None:
        pass

    def end(self, *args, **kwargs) -> None:
        self._n += 1


def to_frame(rows: np.ndarray) -> pd.DataFrame:
    """Samples as a DataFrame with the phase spelled out."""
    frame = pd.DataFrame(rows)
    frame["phase"] = pd.Categorical.from_codes(frame["phase"], categories=PHASES)
    return frame
