"""The count of live MLX buffers at rest: a detector of buffers that pile up while bytes hardly
move, with the projection to the backend's limit (formula: harness.judge.detectors).

Metal caps live buffers (499,000 by default): mlx-lm PR #1642's `ArraysCache.advance` kept one
4-byte scalar alive per decoded token in a graph it never evaluated, and the server failed with
"[metal::malloc] Resource limit (499000) exceeded" hours later, under every byte threshold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from ..common.units import KiB, Size, exact_bytes
from .frames import point_name, quiescent
from .records import Finding, listed
from .thresholds import MAX_WARMUP, TrendThresholds
from .trend import rising

if TYPE_CHECKING:
    import pandas as pd

# Which backends name their limit: the projection says whose it is.
BACKEND_NAMES = {"metal": "Metal", "cuda": "CUDA", "cpu": "the CPU backend"}


class BuffersThresholds(TrendThresholds):
    """`min_buffers`: the buffers a point at rest must add (the trend's floor);
    `max_bytes_per_buffer`: memory at rest grows by less than this per buffer added, or the
    buffers are real entries (unbounded's and leak's to judge); `limit`: the live buffers to
    project to, where the scenario states one (else the bound of `expect.buffers`, else the
    backend's own)."""

    min_buffers: Annotated[int, Field(ge=1, le=MAX_WARMUP)] = 8
    max_bytes_per_buffer: Size = KiB
    limit: Annotated[int, Field(ge=1)] | None = None


def counted(points: pd.DataFrame) -> pd.Series:
    """Live buffers at each of `points`, NaN where not counted (-1: in flight, or a point at
    rest the walk skipped; it walks the baseline, each power of two and the last); all NaN for
    samples written before buffers were counted."""
    if "buffers" not in points:
        return points["step"].astype(float) * float("nan")
    return points["buffers"].where(points["buffers"] >= 0).astype(float)


def _served(frame: pd.DataFrame, first: int, last: int) -> tuple[float, str]:
    """How much was served between two rows: tokens where the frame counts them (decode steps
    of kvmem's own loop, the tokens a server's request marks carry), else points at rest
    (requests or turns), else seconds (a run with no request boundaries)."""
    between = frame.loc[first:last].iloc[1:]
    tokens = int((between["phase"] == "decode").sum())
    if "request" in set(between["phase"]):
        tokens += int(between.loc[between["phase"] == "request", "tokens"].sum())
    if tokens:
        return float(tokens), "token"
    points = quiescent(frame).loc[first:last]
    if (points["request"] >= 0).any() or (points["turn"] >= 0).any():
        return float(len(points) - 1), point_name(points)
    return float(frame["time"][last] - frame["time"][first]), "second"


def _projection(live: int, rate: float, unit: str, limit: int | None, stated: bool,
                backend: str) -> str:
    """`: Metal's 499,000 live buffers in about 498,000 more tokens`, or nothing without a
    limit."""
    if limit is None:
        return ""
    whose = (f"the stated limit of {limit:,} buffers" if stated else
             f"{BACKEND_NAMES.get(backend, backend)}'s {limit:,} live buffers")
    if live >= limit:
        return f": {live:,} live, over {whose}"
    return f": {whose} in about {(limit - live) / rate:,.0f} more {unit}s"


def buffers(frame: pd.DataFrame, t: BuffersThresholds, backend: str) -> Finding | None:
    """Buffers: the live MLX buffers at rest keep rising past the warm-up while memory at rest
    grows by less than `max_bytes_per_buffer` per buffer added: small arrays piling up (a
    scalar per decoded token kept by a graph never evaluated), which no byte threshold sees
    and a buffer limit ends. The rate is per token where the frame counts tokens, else per
    request (or turn), else per second; projected to the stated limit (`limit`) or the
    backend's (`frame.attrs["buffer_limit"]`, read where the run was)."""
    buffers_at = counted(quiescent(frame).iloc[t.warmup:]).dropna()
    if len(buffers_at) < 3:
        return None
    # Between the points counted, the count is read as linear: the trend is per point at rest.
    points = quiescent(frame).loc[buffers_at.index[0]:buffers_at.index[-1]]
    trend = rising(counted(points).interpolate(), t.min_buffers, t.r2, t.hold)
    if trend is None:
        return None
    span = buffers_at.loc[points.index[trend.start]:]
    if len(span) < 2:
        return None
    first, last = span.index[0], span.index[-1]
    added, spanned = int(span[last] - span[first]), len(points.loc[first:last]) - 1
    grown = int(frame["active"][last] - frame["active"][first])
    if added <= 0 or grown >= t.max_bytes_per_buffer * added:
        return None
    served, unit = _served(frame, first, last)
    rate = added / served if served > 0 else float(added)
    limit = t.limit if t.limit is not None else frame.attrs.get("buffer_limit")
    live = int(span[last])
    projection = _projection(live, rate, unit, limit, t.limit is not None, backend)
    return Finding(
        kind="buffers", step=int(frame["step"][last]), bytes=round(grown / spanned),
        count=spanned,
        message=f"live MLX buffers at rest grow {rate:+,.2f} a {unit} "
                f"({exact_bytes(max(grown, 0) / added)} each), {int(span[first]):,} to {live:,} "
                f"over {spanned} {point_name(points)}s while memory at rest grew {exact_bytes(grown)} "
                f"(fit r²={trend.r2:.3f}){projection}",
        steps=listed(points.loc[first:last, "step"]))
