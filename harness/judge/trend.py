"""The trend test over a series at rest (one point per request or chat turn), and the split of
a rising excess between what rose in step with the reported bytes and what did not.

T(x) over a series past `warmup` points: not held, i.e. its last `hold` deltas or more are
flat (each |Δ| and their sum < the floor) and more than any flat run while it rose (a cache
that filled and stopped); from its onset, the last point of a flat start (values within the
floor of the first), at least 3 points; deltas d_k and a least-squares line with slope σ and
coefficient of determination r²; the rate is median(d) when every d_k > 0, else σ; x rises
when rate ≥ its floor and either every d_k > 0 or r² ≥ r2.

The split S: over every quiescent point, the rises of u (positive Δu, u the memory nothing
accounts for: `frames.unexplained`) where the reported bytes l rose too, by more than Δu / 20,
against those where l did not; u rose "in step" when the first sum ≥ the second. Leak and
retained take the two sides of S, so one rising excess gives one of them, not both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .frames import quiescent, unexplained

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd


@dataclass(frozen=True)
class Trend:
    """A series that keeps rising: bytes per point, the line fit's r², how many deltas, and
    the point where the rise begins (after a flat start)."""

    rate: float
    r2: float
    deltas: int
    start: int = 0


def _fit(values: np.ndarray) -> tuple[float, float]:
    """Slope and r² of the least-squares line through `values` at 0, 1, 2..."""
    import numpy as np

    x = np.arange(len(values), dtype=float)
    slope, intercept = np.polyfit(x, values, 1)
    total = ((values - values.mean()) ** 2).sum()
    r2 = 1.0 - ((values - (slope * x + intercept)) ** 2).sum() / total if total else 0.0
    return float(slope), float(r2)


def _runs(flat: np.ndarray) -> list[int]:
    """The lengths of the runs of True in `flat`, in order."""
    runs, length = [], 0
    for value in flat:
        if value:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return [*runs, length] if length else runs


def held(values: np.ndarray, floor: float, hold: int) -> int:
    """How many flat deltas end the series when they make it held, else 0: each |Δ| < floor
    and together less than floor (a slow rise is not flat), at least `hold` of them and more
    than any flat run before them (a pause while it rose), after a rise of at least floor."""
    import numpy as np

    deltas = np.diff(values)
    flat = np.abs(deltas) < floor
    if len(deltas) == 0 or not flat[-1]:
        return 0
    runs = _runs(flat)
    tail, pauses = runs[-1], runs[:-1]
    rose = bool((deltas[: len(deltas) - tail] >= floor).any())
    still = abs(deltas[len(deltas) - tail:].sum()) < floor
    return tail if rose and still and tail >= hold and tail > max(pauses, default=0) else 0


def onset(values: np.ndarray, floor: float) -> int:
    """Where a rise begins: the last point of the flat start (values within `floor` of the
    first), so a rate is fitted where the growth is, not over a fill or a warm-up before it."""
    import numpy as np

    away = np.flatnonzero(np.abs(values - values[0]) >= floor)
    return max(int(away[0]) - 1, 0) if len(away) else 0


def rising(values: pd.Series, min_rate: float, r2: float, hold: int = 3) -> Trend | None:
    """The trend test: not held (`held`); from its onset, at least 3 values; the rate is the
    median delta when every delta is positive, else the fitted slope; rising when rate ≥
    min_rate and either every delta is positive or the fit's r² ≥ r2."""
    import numpy as np

    if len(values) < 3:
        return None
    whole = values.to_numpy(dtype=float)
    if held(whole, min_rate, hold):
        return None
    start = onset(whole, min_rate)
    series = whole[start:]
    if len(series) < 3:
        return None
    deltas = np.diff(series)
    slope, fit = _fit(series)
    every = bool((deltas > 0).all())
    rate = float(np.median(deltas)) if every else slope
    if rate < min_rate or not (every or fit >= r2):
        return None
    return Trend(rate, fit, len(deltas), start)


# The most waste per byte stored that still counts as in step: a 13-token entry in a 256-slot
# block (mlx-lm's KVCache step) wastes 19 times what it reports.
MAX_WASTE = 20


def in_step(frame: pd.DataFrame) -> bool:
    """Whether the unexplained memory at rest rose in step with the reported bytes.

    Over every quiescent point (no warm-up, so leak and retained split the same way): the
    rises of the excess between points where the reported bytes also rose, by more than
    1/MAX_WASTE of that rise, against those where they did not. Waste proportional to what is
    held comes with what is stored; a leak rises while the store's own count stands still,
    or merely wanders (a full store replacing entries of different lengths).
    """
    import numpy as np

    points = quiescent(frame)
    rise = np.diff(unexplained(points, frame).to_numpy(dtype=float)).clip(min=0)
    grew = np.diff(points["logical"].to_numpy(dtype=float)) * MAX_WASTE > rise
    return bool(rise[grew].sum() >= rise[~grew].sum())

