"""Report folders: samples.csv, summary.json and memory.png per variant (requests.csv and
holders.csv where the run has them), written as a unit, and
the reservation of the folder a run writes under. They are read back by harness.store.

Every file is written to a temporary name beside its target and renamed into place, so a
crash or a bad later input never leaves half a report, nor destroys one already written.
pandas and matplotlib are imported where a report is written: `reserve` and `ReportError`
serve every command, which must start (and refuse bad input) without them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.errors import BadInput, cannot_write
from ..common.files import UMASK
from ..judge.summary import Summary
from .plots import plot_variant

if TYPE_CHECKING:
    import pandas as pd

LOCK_NAME = ".kvmem.lock"
SAMPLES = "samples.csv"
REQUESTS = "requests.csv"
HOLDERS = "holders.csv"


class ReportError(BadInput):
    """The report folder cannot be used: not a folder, not writable, or another run holds it."""


@contextmanager
def reserve(out: Path) -> Iterator[None]:
    """Hold `out` for one run: it must be (or become) a writable folder that no other run holds.

    Checked before anything runs, so a bad `--out` never costs a suite's worth of work. The lock
    is an advisory `flock` on `out/.kvmem.lock`, released when the run ends or its process dies;
    the file names the holder's pid. Every step, the pid's write included, is bad input
    when it fails (a full disk), never an OSError from the middle of a command.
    """
    def refused(exc: OSError) -> BadInput:
        return cannot_write(out, exc)

    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        raise refused(exc) from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(lock, 100, 0).decode(errors="replace").strip() or "another process"
            raise ReportError(f"{out}: another kvmem run ({holder}) is writing reports there; "
                              "wait for it or choose another --out") from None
        try:
            os.ftruncate(lock, 0)
            os.write(lock, f"pid {os.getpid()}\n".encode())
        except OSError as exc:
            raise refused(exc) from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
        os.close(lock)


def write_variant(out: Path, frame: pd.DataFrame, summary: Summary,
                  requests: pd.DataFrame | None = None,
                  holders: pd.DataFrame | None = None) -> None:
    """samples.csv, summary.json, (for a run with samples) memory.png, (for a server's)
    requests.csv, each request's times, and (where the holders were walked) holders.csv, who
    held the arrays at each point at rest, into `out`, as a unit.

    The files go into a fresh folder beside `out`, which then takes the place of the old one:
    a write that fails (full disk, a name too long) leaves the previous report whole.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.new."))
    try:
        frame.to_csv(staging / SAMPLES, index=False)
        if requests is not None and not requests.empty:
            requests.to_csv(staging / REQUESTS, index=False)
        if holders is not None and not holders.empty:
            holders.to_csv(staging / HOLDERS, index=False)
        if not frame.empty:
            title = f"{summary.scenario} / {summary.variant} ({summary.backend})"
            detect = summary.detect  # a scenario's budget, or a recording's
            budget = (None if detect is None
                      else detect.unbounded.budget or detect.drift.budget)
            plot_variant(frame, summary.findings, title, staging / "memory.png", budget=budget,
                         requests=requests)
        (staging / "summary.json").write_text(summary.to_json())
        os.chmod(staging, 0o777 & ~UMASK)
        swap_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def swap_into_place(staging: Path, out: Path) -> None:
    """Rename `staging` to `out`; an old `out` is moved aside first and removed after."""
    if not out.exists():
        os.replace(staging, out)
        return
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old."))
    os.replace(out, old / out.name)
    try:
        os.replace(staging, out)
    except BaseException:
        os.replace(old / out.name, out)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
