"""The processes of a command `kvmem record` follows: each one's rows as its agent sends them,
their sum, the process tree around them, and what could not be seen.

The first process's agent is asked through `Agented` (its answer is handed to `kept`); every
other Python process the command starts connects on its own (`Followers`) and is asked here.
The report's samples are the processes' sum: at every time one of them sampled, each at its
latest sample (nothing before its first, nor after the last of one that exited), on the clock
the processes share (`time.monotonic`, system-wide). The first process's holder walks (`Walk`)
are placed on those samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shlex
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import psutil

from ..agent.kvmem_sample import PHASES, Sample
from ..run.agented import Followers, ServerError
from ..run.holders_log import HolderLog
from ..run.holders_log import frame as holders_frame
from ..run.probe import ROW

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import pandas as pd

REPLY_TIMEOUT = 30.0  # seconds an agent may take to answer a drain
# A process's columns as kept (a Sample's numbers), and those its rows add to the report's.
KEPT = ("time", "active", "peak", "cache", "rss", "logical", "cyclic", "cap")
SUMMED = KEPT[1:]


@dataclasses.dataclass
class Process:
    """One process of the command as its agent said hello, and the rows it sent (KEPT's
    numbers, in an array that doubles as needed: a long recording reads them every second);
    `connection` is None for the first, which `Agented` asks."""

    pid: int
    parent: int | None
    command: str
    forked: bool
    connection: Connection | None = None
    exited: bool = False  # its agent hung up before the recording ended
    _rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((64, len(KEPT))))
    _count: int = 0

    @classmethod
    def said(cls, hello: dict[str, Any], connection: Connection | None = None) -> Process:
        return cls(int(hello.get("pid", 0)), hello.get("parent"),
                   _brief(shlex.join(hello.get("argv") or [])), bool(hello.get("forked")),
                   connection)

    def keep(self, rows: list[tuple]) -> None:
        """Add the rows an agent sent (`Sample`s as plain tuples)."""
        while self._count + len(rows) > len(self._rows):
            self._rows = np.concatenate([self._rows, np.zeros_like(self._rows)])
        for row in rows:
            sample = Sample._make(row)
            self._rows[self._count] = [getattr(sample, name) for name in KEPT]
            self._count += 1

    def array(self) -> np.ndarray:
        return self._rows[:self._count]

    def __len__(self) -> int:
        return self._count

    def facts(self) -> dict[str, Any]:
        rows = self.array()
        last = rows[-1] if len(rows) else np.zeros(len(KEPT))
        active = KEPT.index("active")
        return {"pid": self.pid, "parent": self.parent, "command": self.command,
                "forked": self.forked, "samples": len(rows), "active": int(last[active]),
                "active_max": int(rows[:, active].max()) if len(rows) else 0,
                "rss": int(last[KEPT.index("rss")]), "exited": self.exited}


def origin(processes: list[Process]) -> float | None:
    """The clock reading the report's times count from: the earliest sample of any process
    (None before one)."""
    firsts = [process.array()[0, 0] for process in processes if len(process)]
    return float(min(firsts)) if firsts else None


def combine(processes: list[Process]) -> np.ndarray:
    """The processes' rows as one series of `ROW`s: at every time one of them sampled, the sum
    of each one's latest sample (nothing before its first, nor after the last of one that
    exited); times from the earliest sample, on the clock the processes share."""
    kept = [(process, process.array()) for process in processes if len(process)]
    if not kept:
        return np.zeros(0, ROW)
    times = np.unique(np.concatenate([rows[:, 0] for _, rows in kept]))
    out = np.zeros(len(times), ROW)
    out["step"] = np.arange(len(times))
    out["phase"] = PHASES.index("serve")
    out["request"] = out["turn"] = -1
    out["buffers"] = out["arrays"] = -1  # a recording has no point at rest to count them at
    out["time"] = times - times[0]
    for process, rows in kept:
        latest = np.searchsorted(rows[:, 0], times, side="right") - 1
        live = (latest >= 0) & (~process.exited | (times <= rows[-1, 0]))
        for column in SUMMED:
            values = rows[:, KEPT.index(column)]
            out[column] += np.where(live, values[latest.clip(0)], 0).astype(np.int64)
    return out


@dataclasses.dataclass(frozen=True)
class Walk:
    """One walk of the first process's holders: when its agent answered (`time.monotonic`, the
    samples' clock), the groups as plain tuples, and what the walk cost (`census`)."""

    time: float
    groups: list[tuple]
    census: dict[str, Any]


FIRST_WALKS_AFTER = 8.0  # seconds: after the first walk, none before this


def next_walk(elapsed: float) -> float:
    """The first power of two seconds after `elapsed`, FIRST_WALKS_AFTER at the earliest: the
    recording walks O(log t) times. Each walk leaves a little heap behind the first times
    (instance dicts it made, a fragmented arena); walks at 1, 2 and 4 s would read as RSS
    growing over a short recording of a flat command."""
    return max(FIRST_WALKS_AFTER, 2.0 ** (math.floor(math.log2(max(elapsed, 0.5))) + 1))


def holder_rows(walks: list[Walk], rows: np.ndarray, start: float | None) -> pd.DataFrame:
    """The walks as holders.csv's rows, each at the last of `rows` (`combine`'s, whose times
    count from `start`) at or before it; of two walks at one sample, the later."""
    at: dict[int, Walk] = {}
    if start is not None and len(rows):
        for walk in walks:
            index = int(np.searchsorted(rows["time"], walk.time - start, side="right")) - 1
            at[int(rows["step"][max(index, 0)])] = walk
    log = HolderLog()
    for step, walk in sorted(at.items()):
        log.add(step, -1, -1, walk.groups, bool(walk.census["approximate"]),
                int(walk.census["objects"]), float(walk.census["seconds"]))
    return holders_frame(log.rows())


class Family:
    """The command's processes as their agents said hello (the first one first), and the tree
    of processes seen under the command."""

    def __init__(self, first: dict[str, Any]):
        self.processes = [Process.said(first)]
        self.seen: dict[int, tuple[int, str]] = {}  # the process tree: pid → (parent, command)

    def kept(self, process: Process, answer: dict[str, Any]) -> None:
        process.keep(answer["rows"])
        if answer.get("replaced"):
            raise ServerError(f"{answer['replaced']} (process {process.pid})")

    def drain(self, followers: Followers | None, when: str) -> None:
        """Ask every child's agent at once (those new since the last drain too), then read
        each answer; one that hung up has exited."""
        if followers is not None:
            self.processes += [Process.said(hello, connection)
                               for connection, hello in followers.joined()]
        asked = []
        for process in self.processes[1:]:
            if process.exited or process.connection is None:
                continue
            try:
                process.connection.send({"op": "rows"})
                asked.append(process)
            except OSError:
                process.exited = True
        deadline = time.monotonic() + REPLY_TIMEOUT
        for process in asked:
            assert process.connection is not None
            try:
                if not process.connection.poll(max(0.0, deadline - time.monotonic())):
                    raise ServerError(f"the agent of process {process.pid} ({process.command}) "
                                      f"did not answer {when}")
                self.kept(process, process.connection.recv())
            except (EOFError, OSError):
                process.exited = True

    def look(self, pid: int) -> None:
        """Note every process of the tree under `pid`, the command's (its command line as it
        is now, for one not sampled: a fork that has not yet run its program reads as its
        parent)."""
        sampled = {process.pid for process in self.processes}
        try:
            top = psutil.Process(pid)
            tree = [top, *top.children(recursive=True)]
        except psutil.Error:
            return
        for member in tree:
            if member.pid in sampled and member.pid in self.seen:
                continue
            with contextlib.suppress(psutil.Error):
                self.seen[member.pid] = (member.ppid(),
                                         _brief(shlex.join(member.cmdline())) or member.name())

    def notes(self) -> list[str]:
        """What the recording could not see, each in a sentence."""
        notes = []
        sampled = {process.pid: process for process in self.processes}
        launchers = set()  # the processes that started a sampled one: a launcher script
        for process in self.processes:
            parent = process.parent
            while parent is not None and parent not in launchers:
                launchers.add(parent)
                parent = self.seen.get(parent, (None, ""))[0]
        unseen = [f"{command} (pid {pid})" for pid, (_, command) in self.seen.items()
                  if pid not in sampled and pid not in launchers]
        if unseen:
            notes.append(f"the command started {_count(len(unseen), 'process')} kvmem could not "
                         "sample (not Python, or started without the environment kvmem gave "
                         f"it): {'; '.join(unseen)}")
        unread = [f"{p.command} (pid {p.pid})" for p in self.processes if p.exited and not len(p)]
        if unread:
            notes.append(f"{_count(len(unread), 'process')} exited before kvmem read a sample "
                         f"of it: {'; '.join(unread)}")
        arrays = [process.array() for process in self.processes if len(process)]
        if arrays and not any(rows[:, KEPT.index("active")].any() for rows in arrays):
            notes.append(f"MLX active memory never moved from 0 B in the "
                         f"{_count(len(arrays), 'process')} kvmem sampled: whatever memory the "
                         "command uses, it is not MLX's there")
        return notes

    def per_process(self) -> pd.DataFrame:
        """Every process's own rows (`processes.csv`), on the report's clock."""
        import pandas as pd

        start = origin(self.processes)
        if start is None:
            return pd.DataFrame(columns=["pid", *KEPT])
        frames = [pd.DataFrame(process.array(), columns=list(KEPT)).assign(pid=process.pid)
                  for process in self.processes if len(process)]
        frame = pd.concat(frames, ignore_index=True)
        frame["time"] -= start
        return frame[["pid", *KEPT]].astype({name: "int64" for name in SUMMED})


def _brief(command: str, most: int = 100) -> str:
    """A command line on one line, cut to `most` characters (a `-c` script spans many)."""
    line = " ".join(command.split())
    return line if len(line) <= most else line[:most - 1] + "…"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "es" if noun.endswith("s") else "s")


