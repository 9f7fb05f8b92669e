"""Plots: a variant's memory against its steps (or a server's time), the variants of a scenario
overlaid, and the summary's small series of active memory.

Figures are drawn on matplotlib's Agg canvas directly, never through pyplot's global state, and
written atomically; pandas and matplotlib are imported where a plot is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..agent.kvmem_agent import IN_FLIGHT
from ..common.files import atomic_write
from ..judge.detectors import DETECTORS, Marker
from ..judge.records import Finding

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

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


def plot_variant(frame: pd.DataFrame, findings: list[Finding], title: str, path: Path,
                 budget: int | None = None) -> None:
    """A variant's memory by step (a server's by time): active memory with its step-peak band,
    what the components report beside their budget and their own cap, the analytic minimum,
    RSS, and each finding's steps."""
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
    _limits(ax, thin, x, budget)
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


def _limits(ax: Axes, thin: pd.DataFrame, x: str, budget: int | None) -> None:
    """What the reported bytes are held to, as lines beside them: the scenario's budget, and the
    cap the cache gives itself where the agent read one, so "over its cap" is seen."""
    if budget is not None:
        ax.axhline(budget / 2**20, color="tab:green", linestyle=(0, (1, 3)), linewidth=1,
                   label="budget (detect.unbounded.budget)")
    if "cap" in thin and (thin["cap"] > 0).any():
        ax.step(thin[x], thin["cap"].where(thin["cap"] > 0) / 2**20, where="post",
                color="tab:red", linestyle="-.", linewidth=1, label="the cache's own cap")


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
