"""Reports: samples.csv, summary.json and memory.png per variant, an overlay per scenario.

Every file is written to a temporary name beside its target and renamed into place, so a
crash or a bad later input never leaves half a report, nor destroys one already written.

pandas and matplotlib are imported where a report is drawn: `reserve` and `ReportError` serve
every command, which must start (and refuse bad input) without them. Figures are drawn on
matplotlib's Agg canvas directly, never through pyplot's global state.
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

from ..common.files import UMASK, atomic_write
from ..judge.detectors import DETECTORS, IN_FLIGHT, Finding, Marker
from ..judge.summary import Summary

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LOCK_NAME = ".kvmem.lock"
SERIES_POINTS = 64
PLOT_POINTS = 4000
# A finding read back from a summary whose detector is no longer registered.
UNKNOWN_MARKER = Marker("x", "red")


def series(frame: pd.DataFrame, points: int = SERIES_POINTS) -> list[int]:
    """Active bytes above the baseline, reduced to `points` bins (the max of each)."""
    import pandas as pd

    if frame.empty:
        return []
    active = frame["active"] - frame["active"].iloc[0]
    bins = pd.Series(range(len(active))) * points // len(active)
    return [int(v) for v in active.groupby(bins.values).max()]


def _thin(frame: pd.DataFrame) -> pd.DataFrame:
    """At most PLOT_POINTS rows, each bin keeping its maximum, so spikes survive."""
    if len(frame) <= PLOT_POINTS:
        return frame
    bins = frame["step"] * PLOT_POINTS // len(frame)
    return frame.groupby(bins.values).max(numeric_only=True)


def _axis(frame: pd.DataFrame) -> tuple[str, str]:
    """The x column and its label: a server's run is drawn against time, others by step."""
    if "time" in frame and frame["phase"].isin(IN_FLIGHT).any():
        return "time", "seconds since the baseline (ticks: requests sent)"
    return "step", "step (prefill chunk, decode token, fetch, store)"


def _request_ticks(ax: Axes, frame: pd.DataFrame, x: str) -> None:
    """A short tick at the bottom of the axis where each request of a server's run began."""
    if x != "time":
        return
    starts = frame[frame["phase"] == "request"].groupby("request")[x].min()
    ax.vlines(starts, 0, 0.03, transform=ax.get_xaxis_transform(), colors="tab:gray",
              linewidth=0.6, zorder=1)


def plot_variant(frame: pd.DataFrame, findings: list[Finding], title: str, path: Path) -> None:
    mib = 2**20
    base = frame["active"].iloc[0]
    thin = _thin(frame)
    x, xlabel = _axis(frame)
    fig, ax = _figure()
    ax.fill_between(thin[x], (thin["active"] - base) / mib, (thin["peak"] - base) / mib,
                    color="tab:blue", alpha=0.2, step="post", label="step peak")
    ax.step(thin[x], (thin["active"] - base) / mib, where="post", color="tab:blue",
            label="MLX active")
    ax.step(thin[x], thin["logical"] / mib, where="post", color="tab:green",
            linestyle="--", label="logical (components' nbytes)")
    ax.step(thin[x], thin["minimum"] / mib, where="post", color="black", linestyle=":",
            label="analytic minimum")
    ax.step(thin[x], (thin["rss"] - frame["rss"].iloc[0]) / mib, where="post",
            color="tab:gray", alpha=0.7, label="process RSS")
    _request_ticks(ax, frame, x)
    by_step = frame.set_index("step")
    for finding in findings:
        entry = DETECTORS.get(finding.kind)
        marker = entry.marker if entry else UNKNOWN_MARKER
        steps = [s for s in finding.steps if s in by_step.index]
        ax.scatter(by_step.loc[steps, x] if x != "step" else steps,
                   (by_step.loc[steps, marker.level] - base) / mib, marker=marker.symbol,
                   color=marker.color, zorder=5, label=f"{finding.kind} ({finding.count})")
    _save(fig, ax, xlabel, "MiB above baseline", title, path)


def plot_overlay(frames: dict[str, pd.DataFrame], title: str, path: Path) -> None:
    """Every variant's active memory (and peak band) on one axis; frames must have samples."""
    mib = 2**20
    fig, ax = _figure()
    xlabel = "step"
    for name, frame in frames.items():
        base = frame["active"].iloc[0]
        thin = _thin(frame)
        x, xlabel = _axis(frame)
        line, = ax.step(thin[x], (thin["active"] - base) / mib, where="post", label=name)
        ax.fill_between(thin[x], (thin["active"] - base) / mib,
                        (thin["peak"] - base) / mib, color=line.get_color(), alpha=0.15,
                        step="post")
    _save(fig, ax, xlabel if xlabel == "step" else "seconds since the baseline",
          "MiB above baseline (band: step peak)", title, path)


def _figure() -> tuple[Figure, Axes]:
    """A report-sized figure on an Agg canvas, with one axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 5.5))
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _save(fig: Figure, ax: Axes, xlabel: str, ylabel: str, title: str, path: Path) -> None:
    """Label, legend and write a figure atomically."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))


class ReportError(OSError):
    """The report folder cannot be used: not a folder, not writable, or another run holds it."""


@contextmanager
def reserve(out: Path) -> Iterator[None]:
    """Hold `out` for one run: it must be (or become) a writable folder that no other run holds.

    Checked before anything runs, so a bad `--out` never costs a suite's worth of work. The lock
    is an advisory `flock` on `out/.kvmem.lock`, released when the run ends or its process dies;
    the file names the holder's pid. Every step, the pid's write included, is a ReportError
    when it fails (a full disk), never an OSError from the middle of a command.
    """
    def refused(exc: OSError) -> ReportError:
        return ReportError(f"{out}: cannot write reports there: {exc.strerror or exc}")

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
                  findings: list[Finding]) -> None:
    """samples.csv, summary.json and (for a run with samples) memory.png into `out`, as a unit.

    The files go into a fresh folder beside `out`, which then takes the place of the old one:
    a write that fails (full disk, a name too long) leaves the previous report whole.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.new."))
    try:
        frame.to_csv(staging / "samples.csv", index=False)
        if not frame.empty:
            title = f"{summary.scenario} / {summary.variant} ({summary.backend})"
            plot_variant(frame, findings, title, staging / "memory.png")
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
