"""Rows of one numpy dtype, appended one at a time, in memory or spilled to a file.

A run's samples and its requests are kept so. In memory the array doubles as needed (under 100
bytes a row). With a spool file, a run of any length holds one block of rows at a time: a full
block, or one older than SPILL_SECONDS, is appended to the file, so a soak's memory stays flat
and a run that is killed still leaves what it sampled up to its last few seconds on disk.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

BLOCK = 4096
SPILL_SECONDS = 5.0


class Rows:
    """Appended rows of `dtype`; `spool`, when given, is the file they are spilled to."""

    def __init__(self, dtype: np.dtype, capacity: int = BLOCK, spool: Path | None = None):
        self.dtype = dtype
        self._block = np.zeros(capacity, dtype=dtype)
        self._n = 0  # rows in the block
        self._spilled = 0  # rows in the file
        self._spool = spool
        self._fd: int | None = None
        self._spilled_at = time.monotonic()
        self._tail: np.void | None = None  # the last row spilled, while the block is empty
        if spool is not None:
            self._fd = os.open(spool, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)

    def append(self, row: tuple) -> None:
        if self._n == len(self._block):
            if self._fd is None:
                self._block = np.resize(self._block, 2 * len(self._block))
            else:
                self.spill()
        self._block[self._n] = row
        self._n += 1
        if self._fd is not None and time.monotonic() - self._spilled_at > SPILL_SECONDS:
            self.spill()

    def spill(self) -> None:
        """Write the block's rows to the spool file (without one, nothing to do)."""
        self._spilled_at = time.monotonic()
        if self._fd is None or not self._n:
            return
        self._tail = self._block[self._n - 1].copy()
        data = self._block[: self._n].tobytes()
        written = 0
        while written < len(data):
            written += os.write(self._fd, data[written:])
        self._spilled += self._n
        self._n = 0

    def __len__(self) -> int:
        return self._spilled + self._n

    def last(self) -> np.void | None:
        """The latest row, or None before the first."""
        return self._block[self._n - 1] if self._n else self._tail

    def all(self) -> np.ndarray:
        """Every row, in order (read back from the spool file where there is one)."""
        if self._spool is None:
            return self._block[: self._n]
        self.spill()
        return read(self._spool, self.dtype)

    def close(self) -> None:
        """Spill what is left and close the file."""
        if self._fd is not None:
            self.spill()
            os.close(self._fd)
            self._fd = None


def read(path: Path, dtype: np.dtype) -> np.ndarray:
    """The whole rows a spool file holds (a row cut short by a kill is left out)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return np.zeros(0, dtype=dtype)
    whole = len(data) - len(data) % dtype.itemsize
    return np.frombuffer(data[:whole], dtype=dtype).copy()
