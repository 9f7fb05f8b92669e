"""The holders found at each point at rest (`harness.agent.kvmem_holders`), as the rows of a
variant's holders.csv: one row per group, written as they come.

A point at rest keeps its MAX_GROUPS largest groups and folds the rest into one row (`root`
"other"), so the rows still sum to what the arrays hold and a soak's log grows by a bounded
amount a point. In a variant's child the rows go straight to a spool file, flushed at each
point, so a run that is killed keeps what it walked; the parent reads them back.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

MAX_GROUPS = 40
# A group's fields, as harness.agent.kvmem_holders.Group has them (a test holds the two alike).
GROUP = ("holder", "path", "root", "bytes", "logical", "arrays", "buffers", "pending")
# The walk's own, on each of its rows: `approximate`, 1 where the MLX walked lacks
# get_array_buffer_size (bytes are the arrays' own); `objects` it visited; `seconds` it took.
WALK = ("approximate", "objects", "seconds")
COLUMNS = ("step", "request", "turn", *GROUP, *WALK)
HOLDERS_SPOOL = "holders.csv"
HolderRow = tuple  # (step, request, turn, *Group, *WALK)


def bounded(groups: Sequence[Sequence]) -> list[tuple]:
    """The largest MAX_GROUPS groups (they come largest first) and one row for the rest."""
    rows = [tuple(g) for g in groups]
    if len(rows) <= MAX_GROUPS:
        return rows
    kept, rest = rows[:MAX_GROUPS], rows[MAX_GROUPS:]
    counts = [sum(g[i] for g in rest) for i in range(GROUP.index("bytes"), len(GROUP))]
    return [*kept, (f"({len(rest)} smaller holders)", "", "other", *counts)]


class HolderLog:
    """The holder rows of one run: in memory, or appended to `spool` as they come."""

    def __init__(self, spool: Path | None = None):
        self._rows: list[HolderRow] = []
        self._file: IO[str] | None = None
        if spool is not None:
            self._file = spool.open("w", newline="", encoding="utf-8")
            self._writer = csv.writer(self._file)
            self._writer.writerow(COLUMNS)

    def add(self, step: int, request: int, turn: int, groups: Iterable[Sequence],
            approximate: bool = False, objects: int = 0, seconds: float = 0.0) -> None:
        walk = (int(approximate), objects, round(seconds, 4))
        rows = [(step, request, turn, *g, *walk) for g in bounded(list(groups))]
        if self._file is None:
            self._rows.extend(rows)
            return
        self._writer.writerows(rows)
        self._file.flush()

    def rows(self) -> list[HolderRow]:
        """The rows kept in memory (none where they went to a spool file: `read` it)."""
        return list(self._rows)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read(path: Path) -> list[HolderRow]:
    """The rows a spool file holds, typed as `COLUMNS` says (a row cut short is left out)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    kinds = [int, int, int, *(str if field in ("holder", "path", "root") else int
                               for field in GROUP), int, int, float]
    rows = []
    for row in list(csv.reader(io.StringIO(text)))[1:]:
        if len(row) == len(kinds):
            try:
                rows.append(tuple(kind(value) for kind, value in zip(kinds, row, strict=True)))
            except ValueError:
                continue
    return rows


def frame(rows: list[HolderRow]) -> pd.DataFrame:
    """The rows as holders.csv has them (pandas imported here: a variant's child, which only
    writes rows, starts without it)."""
    import pandas as pd

    return pd.DataFrame(rows, columns=list(COLUMNS))
