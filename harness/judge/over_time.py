"""Memory against the clock, for a process sampled without request boundaries (`kvmem record`):
the `drift` detector and the least-squares line it fits.

A recorded process has no requests and no samples at rest, only samples on the agent's period
("serve"), so the detectors of steps and of memory at rest have nothing to read there. What can
be read is the trend: MLX active memory (and RSS) against time. A run that has request
boundaries, or three samples at rest or more, is left to those detectors: drift never reads
it, so one cause is never reported twice. (A server's open-loop run marks no request; one too
short to rest three times is read as a recording is.)

drift      over the samples on the period ("serve"), on a run with no "request" sample and
           fewer than 3 at rest, for MLX active memory a and RSS alike: the least-squares line
           of a − a_0 against time, slope σ (bytes per second), r², span T, fitted growth
           G = σ T, last sample L = a_last − a_0. An error where either series has G > budget
           or L > budget, or σ > rate; else a warning where either has σ > 0, G ≥ min_bytes
           and r² ≥ r2 (memory held outside MLX drifts as MLX's does). The message gives σ, G,
           L and r² of both lines and the verdict on each that breaches or grows; the finding's
           bytes are the slope of the first of them that decides its severity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BeforeValidator, Field

from ..common.units import SIZE_TEXT, MiB, Size, format_bytes, parse_size, written_as
from .records import Finding, Severity, listed
from .thresholds import Thresholds

if TYPE_CHECKING:
    import numpy.typing as npt
    import pandas as pd

MIN_SAMPLES = 3  # a line through fewer says nothing
MAX_AT_REST = 3  # a run with this many samples at rest or more has memory at rest to judge
SERIES = (("active", "MLX active memory"), ("rss", "RSS"))  # what drift fits, in this order


def parse_rate(value: Any) -> int:
    """Bytes per second from `5 MiB/s`, `5 MiB` or 5242880 (the `/s` is optional)."""
    if isinstance(value, str) and value.rstrip().endswith("/s"):
        value = value.rstrip()[:-2]
    return parse_size(value)


Rate = Annotated[int, BeforeValidator(parse_rate),
                 written_as(SIZE_TEXT + r"(/s)?\s*", {"type": "integer", "minimum": 0}, "5 MiB/s")]


class DriftThresholds(Thresholds):
    """`budget`: the most MLX active memory, and the most RSS, above the first sample (judged on
    the fitted growth over the run and on the last sample); `rate`: the most bytes per second
    either fitted line may climb. Without either, growth of at least `min_bytes` over the run on
    a line that fits (r² ≥ `r2`) is a warning."""

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


@dataclass(frozen=True)
class Judged:
    """One series of a recording against drift's thresholds: its line, the budgets it breaches
    and whether it grows enough, on a line that fits, to be worth a warning."""

    line: Line
    text: str  # `MLX active memory grows ... against the first`
    breaches: list[str]
    growing: bool

    def said(self, t: DriftThresholds) -> str:
        """Its line, with its verdict where it has one."""
        verdict = "; ".join(self.breaches) if self.breaches else (
            _within(t) if self.growing else "")
        return f"{self.text}; {verdict}" if verdict else self.text


def _judge(rows: pd.DataFrame, column: str, name: str, t: DriftThresholds) -> Judged | None:
    line = fit(rows["time"], rows[column])
    if line is None:
        return None
    last = int(rows[column].iloc[-1]) - int(rows[column].iloc[0])
    growing = line.slope > 0 and line.growth >= t.min_bytes and line.r2 >= t.r2
    return Judged(line, f"{name} {describe(rows, column, line)}", _breaches(t, line, last),
                  growing)


def drift(frame: pd.DataFrame, t: DriftThresholds, backend: str) -> Finding | None:
    """Drift: MLX active memory, or RSS, of a recorded process trending up against time.

    An error when a stated budget is breached by either (`budget`: the fitted growth over the
    run, or the last sample, above it; `rate`: the slope above it); otherwise a warning where a
    line climbs at least `min_bytes` over the run and fits (r² ≥ `r2`): a process that
    allocates and frees as it works scatters around a flat line, fits poorly, and gives
    nothing. RSS is judged as MLX is: a command that holds bytes on the host, or does its MLX
    work where the agent cannot read MLX's counters, drifts there alone.
    """
    rows = in_flight(frame)
    if rows is None:
        return None
    judged = [j for column, name in SERIES if (j := _judge(rows, column, name, t)) is not None]
    lead = (next((j for j in judged if j.breaches), None)
            or next((j for j in judged if j.growing), None))
    if lead is None:
        return None
    severity: Severity = "error" if lead.breaches else "warning"
    return Finding(
        kind="drift", step=int(rows["step"].iloc[-1]), bytes=round(lead.line.slope),
        count=len(rows), message="; ".join(j.said(t) for j in judged),
        steps=listed(rows["step"]), severity=severity)
