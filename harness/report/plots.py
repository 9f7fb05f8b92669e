"""Plots: a variant's memory against its steps (or a server's time), the variants of a scenario
overlaid, and the summary's small series of active memory.

Figures are drawn on matplotlib's Agg canvas directly, never through pyplot's global state, and
written atomically; pandas and matplotlib are imported where a plot is drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..agent.kvmem_sample import IN_FLIGHT
from ..common.files import atomic_write
from ..common.units import MiB
from ..judge.detectors import DETECTORS, Marker
from ..judge.records import Finding

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SERIES_POINTS = 64
PLOT_POINTS = 4000
# A server's run is drawn in this many time buckets, however long it ran; its requests' ticks
# only up to MAX_TICKS requests, their latency as points up to LATENCY_POINTS.
BUCKETS = 500
MAX_TICKS = 200
LATENCY_POINTS = 500
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
                 budget: int | None = None, requests: pd.DataFrame | None = None) -> None:
    """A variant's memory by step (a server's by time, with its requests' latency below when
    `requests` is given), written to `path`: see `draw_variant`."""
    _write(draw_variant(frame, findings, title, budget, requests), path)


def draw_variant(frame: pd.DataFrame, findings: list[Finding], title: str,
                 budget: int | None = None, requests: pd.DataFrame | None = None) -> Figure:
    """A variant's memory by step (a server's by time): active memory with its step-peak band,
    what the components report beside their budget and their own cap, the analytic minimum,
    RSS, and each finding's steps. Returned unwritten, so what is drawn can be read."""
    x, xlabel = _axis(frame)
    if x == "time":
        return _draw_server(frame, findings, title, budget, requests)
    base = frame["active"].iloc[0]
    thin = _thin(frame)
    fig, ax = _figure()
    ax.fill_between(thin[x], (thin["active"] - base) / MiB, (thin["peak"] - base) / MiB,
                    color="tab:blue", alpha=0.2, step="post", label="step peak")
    ax.step(thin[x], (thin["active"] - base) / MiB, where="post", color="tab:blue",
            label="MLX active")
    ax.step(thin[x], thin["logical"] / MiB, where="post", color="tab:green",
            linestyle="--", label="logical (components' nbytes)")
    _limits(ax, thin, x, budget)
    ax.step(thin[x], thin["minimum"] / MiB, where="post", color="black", linestyle=":",
            label="analytic minimum")
    ax.step(thin[x], (thin["rss"] - frame["rss"].iloc[0]) / MiB, where="post",
            color="tab:gray", alpha=0.7, label="process RSS")
    _markers(ax, frame, findings, x)
    _finish(fig, ax, xlabel, "MiB above baseline", title)
    return fig


def _markers(ax: Axes, frame: pd.DataFrame, findings: list[Finding], x: str) -> None:
    """Each finding's listed steps (spread over the run), at its marker's level."""
    base = frame["active"].iloc[0]
    by_step = frame.set_index("step")
    for finding in findings:
        entry = DETECTORS.get(finding.kind)
        marker = entry.marker if entry else UNKNOWN_MARKER
        steps = [s for s in finding.steps if s in by_step.index]
        ax.scatter(by_step.loc[steps, x] if x != "step" else steps,
                   (by_step.loc[steps, marker.level] - base) / MiB, marker=marker.symbol,
                   color=marker.color, zorder=5, label=f"{finding.kind} ({finding.count})")


def buckets(times: pd.Series, span: tuple[float, float], count: int) -> pd.Series:
    """Each time's bucket among `count` equal ones over `span`: a server's run is drawn per
    bucket, so what the plot costs and how it reads do not depend on how long the run was. A
    missing time has none (<NA>): grouping by buckets leaves it out."""
    start, stop = span
    width = (stop - start) / count or 1.0
    return ((times - start) // width).clip(0, count - 1).astype("Int64")


def _edges(span: tuple[float, float], count: int) -> np.ndarray:
    """The `count` + 1 edges of `buckets` over `span`."""
    import numpy as np

    return np.linspace(span[0], span[1], count + 1)


def _flat(edges: np.ndarray, values: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """x and y drawing each bucket's value flat across its width (two points a bucket), with a
    gap where a bucket has none: an isolated bucket still shows."""
    import numpy as np

    full = values.reindex(range(len(edges) - 1)).to_numpy(dtype=float)
    return np.column_stack([edges[:-1], edges[1:]]).ravel(), np.repeat(full, 2)


def _span(*times: pd.Series) -> tuple[float, float]:
    """The time the run covers, from its first sample (or request) to its last."""
    start = min(float(t.min()) for t in times if len(t))
    stop = max(float(t.max()) for t in times if len(t))
    return start, max(stop, start + 1e-9)


def _draw_server(frame: pd.DataFrame, findings: list[Finding], title: str, budget: int | None,
                 requests: pd.DataFrame | None) -> Figure:
    """A server's run against time: memory at rest as the line, what requests in flight took as
    a band per bucket (lowest active to highest peak), the components' bytes and limits, RSS at
    rest, the requests' ticks when they are few, each finding's listed steps; below, when the
    requests are given, their latency."""
    base = frame["active"].iloc[0]
    latency = requests if requests is not None and not requests.empty else None
    span = _span(frame["time"], *([] if latency is None else [latency["sent"].dropna()]))
    count = max(1, min(BUCKETS, len(frame) // 4))
    edges, at = _edges(span, count), buckets(frame["time"], span, count)
    fig, ax, below = _server_figure(latency is not None)
    flight = frame["phase"].isin(IN_FLIGHT)
    xs, low = _flat(edges, (frame["active"] - base)[flight].groupby(at[flight]).min() / MiB)
    _, high = _flat(edges, (frame["peak"] - base)[flight].groupby(at[flight]).max() / MiB)
    ax.fill_between(xs, low, high, color="tab:blue", alpha=0.25, linewidth=0,
                    label=f"in flight: lowest active to highest peak, per {_width(span, count)}")
    rest = _at_rest(frame, at)
    each = frame.groupby(at).max(numeric_only=True)
    if len(rest) < 2:  # a recorded process, never at rest: memory as it stood, per bucket
        _over_time(ax, frame.groupby(at)[["active", "rss"]].last(), edges, base,
                   frame["rss"].iloc[0])
    else:
        ax.plot(rest["time"], (rest["active"] - base) / MiB, color="tab:blue", marker="o",
                markersize=2.5, linewidth=1.2, label="MLX active at rest")
        ax.plot(rest["time"], (rest["rss"] - frame["rss"].iloc[0]) / MiB, color="tab:gray",
                alpha=0.7, linewidth=1, label="process RSS at rest")
    ax.plot(*_flat(edges, each["logical"] / MiB), color="tab:green", linestyle="--",
            label="logical (components' nbytes)")
    _limits(ax, _by_bucket(each, edges), "time", budget)
    if (frame["minimum"] > 0).any():
        ax.plot(*_flat(edges, each["minimum"] / MiB), color="black", linestyle=":",
                label="analytic minimum")
    ticks = 0 < _requests_in(frame) <= MAX_TICKS
    if ticks:
        _request_ticks(ax, frame, "time")
    _markers(ax, frame, findings, "time")
    xlabel = "seconds since the baseline" + (" (ticks: requests sent)" if ticks else "")
    _finish(fig, ax, xlabel if below is None else "", "MiB above baseline", title)
    if below is not None and latency is not None:
        _draw_latency(below, latency, span, count)
        below.set_xlabel(xlabel)
        fig.tight_layout()
    return fig


def _over_time(ax: Axes, last: pd.DataFrame, edges: np.ndarray, base: int, rss: int) -> None:
    """MLX active and RSS as each bucket's last sample: a process with no samples at rest
    (`kvmem record`) is read by its trend over time."""
    ax.plot(*_flat(edges, (last["active"] - base) / MiB), color="tab:blue", linewidth=1.2,
            label="MLX active")
    ax.plot(*_flat(edges, (last["rss"] - rss) / MiB), color="tab:gray", alpha=0.7,
            linewidth=1, label="process RSS")


def _server_figure(latency: bool) -> tuple[Figure, Axes, Axes | None]:
    """One axis, or memory above latency (3:1) sharing the time axis."""
    if not latency:
        fig, ax = _figure()
        return fig, ax, None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7.5))
    FigureCanvasAgg(fig)
    ax, below = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    return fig, ax, below


def _width(span: tuple[float, float], count: int) -> str:
    """A bucket's width in words: `2.5 s`, `7.2 s`, `0.04 s`."""
    return f"{(span[1] - span[0]) / count:.3g} s"


def _at_rest(frame: pd.DataFrame, at: pd.Series) -> pd.DataFrame:
    """The samples at rest, at most 2 × BUCKETS: past that, each bucket's highest, so a rise is
    kept and a run that rests after every request does not draw thousands of markers."""
    idle = frame["phase"] == "idle"
    rest = frame[idle]
    if len(rest) <= 2 * BUCKETS:
        return rest
    return frame.loc[rest["active"].groupby(at[idle]).idxmax().to_numpy()]


def _by_bucket(each: pd.DataFrame, edges: np.ndarray) -> pd.DataFrame:
    """Per-bucket values as rows at each bucket's left edge, for lines drawn step-wise."""
    rows = each.reindex(range(len(edges) - 1))
    return rows.assign(time=edges[:-1])


def _requests_in(frame: pd.DataFrame) -> int:
    """How many requests a server's run sent."""
    return int(frame.loc[frame["phase"] == "request", "request"].nunique())


def _draw_latency(ax: Axes, requests: pd.DataFrame, span: tuple[float, float],
                  count: int) -> None:
    """Each request's latency by when it was sent: total (done − sent) and time to its first
    token (first − sent), as points when they are few, else per bucket (`_latency_bands`); a
    request that did not end "ok" (a client that disconnected on purpose) as a red x along the
    top, labelled with its status. Headroom above the highest value keeps the legend
    and the failures off the data."""
    sent = requests["sent"]
    ok = requests["status"] == "ok"
    total = (requests["done"] - sent).where(ok)
    first = requests["first"] - sent if "first" in requests else total * float("nan")
    shown = [(label, seconds, color) for label, seconds, color in (
        ("total", total, "tab:orange"), ("to first token", first, "tab:purple"))
        if seconds.notna().any()]
    top = 0.0
    if len(requests) <= LATENCY_POINTS:
        for label, seconds, color in shown:
            ax.scatter(sent, seconds, s=9, color=color, alpha=0.8, linewidth=0, label=label)
            top = max(top, float(seconds.max()))
    else:
        top = _latency_bands(ax, sent, shown, span, count)
    for status, marked in sent[~ok].groupby(requests["status"][~ok]):
        marked = marked.dropna()
        if len(marked) > LATENCY_POINTS:
            marked = marked.groupby(buckets(marked, span, count)).min()
        ax.scatter(marked, [0.95] * len(marked), transform=ax.get_xaxis_transform(),
                   marker="x", color="red", s=16, zorder=5,
                   label=f"{status} ({int((requests['status'] == status).sum())})")
    ax.set_ylim(0, top * 1.7 or 1.0)
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(0, 0.9), fontsize=7, ncol=5, frameon=False)


def _latency_bands(ax: Axes, sent: pd.Series, shown: list[tuple[str, pd.Series, str]],
                   span: tuple[float, float], count: int) -> float:
    """Each bucket's median latency as a line, its 5th to 95th percentile as a band; the highest
    value drawn."""
    edges, at = _edges(span, count), buckets(sent, span, count)
    top = 0.0
    for label, seconds, color in shown:
        by = seconds.groupby(at)
        xs, high = _flat(edges, by.quantile(0.95))
        ax.fill_between(xs, _flat(edges, by.quantile(0.05))[1], high, color=color, alpha=0.2,
                        linewidth=0, label=f"{label}: 5th–95th percentile")
        ax.plot(*_flat(edges, by.median()), color=color, linewidth=1.2, label=f"{label}: median")
        top = max(top, float(by.quantile(0.95).max()))
    return top


def _limits(ax: Axes, thin: pd.DataFrame, x: str, budget: int | None) -> None:
    """What the reported bytes are held to, as lines beside them: the scenario's budget, and the
    cap the cache gives itself where the agent read one, so "over its cap" is seen."""
    if budget is not None:
        ax.axhline(budget / MiB, color="tab:green", linestyle=(0, (1, 3)), linewidth=1,
                   label="budget (detect.unbounded.budget)")
    if "cap" in thin and (thin["cap"] > 0).any():
        ax.step(thin[x], thin["cap"].where(thin["cap"] > 0) / MiB, where="post",
                color="tab:red", linestyle="-.", linewidth=1, label="the cache's own cap")


def plot_overlay(frames: dict[str, pd.DataFrame], title: str, path: Path) -> None:
    """Every variant's active memory (and peak band) on one axis; frames must have samples."""
    fig, ax = _figure()
    xlabel = "step"
    for name, frame in frames.items():
        base = frame["active"].iloc[0]
        thin = _thin(frame)
        x, xlabel = _axis(frame)
        line, = ax.step(thin[x], (thin["active"] - base) / MiB, where="post", label=name)
        ax.fill_between(thin[x], (thin["active"] - base) / MiB,
                        (thin["peak"] - base) / MiB, color=line.get_color(), alpha=0.15,
                        step="post")
    _finish(fig, ax, xlabel if xlabel == "step" else "seconds since the baseline",
            "MiB above baseline (band: step peak)", title)
    _write(fig, path)


def _figure() -> tuple[Figure, Axes]:
    """A report-sized figure on an Agg canvas, with one axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 5.5))
    FigureCanvasAgg(fig)
    return fig, fig.subplots()


def _finish(fig: Figure, ax: Axes, xlabel: str, ylabel: str, title: str) -> None:
    """Label and legend a figure's axis."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()


def _write(fig: Figure, path: Path) -> None:
    """Write a figure atomically."""
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
