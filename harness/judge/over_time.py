"""Memory against the clock, for a process sampled without request boundaries (`kvmem record`):
the `drift` detector and the least-squares line it fits.

A recorded process has no requests and no samples at rest, only samples on the agent's period
("serve"), so the detectors of steps and of memory at rest have nothing to read there. What can
be read is the trend: MLX active memory (and RSS) against time. A run that has request
boundaries, or three samples at rest or more, is left to those detectors: drift never reads
it, so one cause is never reported twice. (A server's open-loop run marks no request; one too
short to rest three times is read as a recording is.)

drift      over the samples on the period ("serve"), on a run with no "request" sample and
           fewer than 3 at rest: the least-squares line of a − a_0 against time, slope σ
           (bytes per second), r², span T, fitted growth G = σ T, last sample L = a_last − a_0.
           An error where G > budget or L > budget, or σ > rate; else a warning where σ > 0,
           G ≥ min_bytes and r² ≥ r2. The message gives σ, G, L and r², and RSS's own line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BeforeValidator, Field

from ..common.units import Size, format_bytes, parse_size
from .records import Finding, Severity, listed
from .thresholds import Thresholds

if TYPE_CHECKING:
    import numpy.typing as npt
    import pandas as pd

MiB = 2**20
MIN_SAMPLES = 3  # a line through fewer says nothing
MAX_AT_REST = 3  # a run with this many samples at rest or more has memory at rest to judge


def parse_rate(value: Any) -> int:
    """Bytes per second from `5 MiB/s`, `5 MiB` or 5242880 (the `/s` is optional)."""
    if isinstance(value, str) and value.rstrip().endswith("/s"):
        value = value.rstrip()[:-2]
    return parse_size(value)


Rate = Annotated[int, BeforeValidator(parse_rate)]


class DriftThresholds(Thresholds):
    """`budget`: the most MLX active memory above the first sample (judged on the fitted growth
    over the run and on the last sample); `rate`: the most bytes per second the fitted line may
    climb. Without either, growth of at least `min_bytes` over the run on a line that fits
    (r² ≥ `r2`) is a warning."""

    budget: Size | None = None
    rate: Rate | None = None
    min_bytes: Size = 1 * MiB
    r2: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5


@dataclass(frozen=True)
class Line:
    """A least-squares line through a series against time: its slope (per second), how well
    it fits (r², 0 for a series that never moves), and the seconds it spans."""

    slope: float
    r2: float
    seconds: float

    @property
    def growth(self) -> float:
        """What the line climbs over the whole span."""
        return self.slope * self.seconds


def fit(times: npt.ArrayLike, values: npt.ArrayLike) -> Line | None:
    """The line through `values` against `times` (a frame's columns, or the probe's rows while
    a recording runs); None with fewer than MIN_SAMPLES samples or no time between them."""
    import numpy as np

    x = np.asarray(times, dtype=float)
    y = np.asarray(values, dtype=float)
    if len(x) < MIN_SAMPLES or x[-1] <= x[0]:
        return None
    x = x - x[0]
    y = y - y[0]  # a line through small numbers: bytes above the first sample
    slope, intercept = np.polyfit(x, y, 1)
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - (slope * x + intercept)) ** 2).sum()) / total if total else 0.0
    return Line(float(slope), r2, float(x[-1]))


def in_flight(frame: pd.DataFrame) -> pd.DataFrame | None:
    """The samples drift reads: a run's samples on the period, where it has no request
    boundaries and fewer than MAX_AT_REST samples at rest; else None."""
    phase = frame["phase"]
    if (phase == "request").any() or int((phase == "idle").sum()) >= MAX_AT_REST:
        return None
    rows = frame[phase == "serve"]
    return rows if len(rows) >= MIN_SAMPLES else None


def per_second(value: float) -> str:
    """`10 MiB/s`, `-512 B/s`."""
    return f"{format_bytes(value)}/s"


def _breaches(t: DriftThresholds, line: Line, last: int) -> list[str]:
    """What each stated budget says of the run, breached ones only."""
    found = []
    if t.budget is not None and line.growth > t.budget:
        found.append(f"the fitted growth is over the budget of {format_bytes(t.budget)}")
    if t.budget is not None and last > t.budget:
        found.append(f"the last sample is over the budget of {format_bytes(t.budget)}")
    if t.rate is not None and line.slope > t.rate:
        found.append(f"faster than the {per_second(t.rate)} allowed")
    return found


def _within(t: DriftThresholds) -> str:
    stated = ([f"the budget of {format_bytes(t.budget)}"] if t.budget is not None else []) + (
        [f"{per_second(t.rate)}"] if t.rate is not None else [])
    return f"within {' and '.join(stated)}" if stated else "with no budget stated"


def describe(rows: pd.DataFrame, column: str, line: Line) -> str:
    """`grows 10 MiB/s over 20.0 s (fit r²=0.998): +200 MiB fitted, the last sample +199 MiB
    above the first`: one series' trend in the words drift and `kvmem record` print."""
    last = int(rows[column].iloc[-1]) - int(rows[column].iloc[0])
    verb = "grows" if line.slope >= 0 else "shrinks"
    return (f"{verb} {per_second(abs(line.slope))} over {line.seconds:.1f} s "
            f"(fit r²={line.r2:.3f}): {format_bytes(line.growth, signed=True)} fitted, the last "
            f"sample {format_bytes(last, signed=True)} against the first")


def drift(frame: pd.DataFrame, t: DriftThresholds, backend: str) -> Finding | None:
    """Drift: MLX active memory of a recorded process trending up against time.

    An error when a stated budget is breached (`budget`: the fitted growth over the run, or the
    last sample, above it; `rate`: the slope above it); otherwise a warning where the line
    climbs at least `min_bytes` over the run and fits (r² ≥ `r2`): a process that allocates and
    frees as it works scatters around a flat line, fits poorly, and gives nothing.
    """
    rows = in_flight(frame)
    line = None if rows is None else fit(rows["time"], rows["active"])
    if rows is None or line is None:
        return None
    last = int(rows["active"].iloc[-1]) - int(rows["active"].iloc[0])
    breaches = _breaches(t, line, last)
    growing = line.slope > 0 and line.growth >= t.min_bytes and line.r2 >= t.r2
    if not breaches and not growing:
        return None
    severity: Severity = "error" if breaches else "warning"
    rss = fit(rows["time"], rows["rss"])
    tail = "" if rss is None else f"; RSS {describe(rows, 'rss', rss)}"
    verdict = "; ".join(breaches) if breaches else _within(t)
    return Finding(
        kind="drift", step=int(rows["step"].iloc[-1]), bytes=round(line.slope), count=len(rows),
        message=f"MLX active memory {describe(rows, 'active', line)}; {verdict}{tail}",
        steps=listed(rows["step"]), severity=severity)
