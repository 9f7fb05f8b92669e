"""Detectors: functions from one run's samples to a finding, registered in `DETECTORS`.

The registry drives everything a detector touches: `detect()` runs each entry, a scenario's
`detect.<name>` block is validated against the entry's thresholds class, `expect.<name>` defaults
to the entry's `expected`, and the plot marks its steps with the entry's marker. Adding a
detector is one function, one thresholds class and one registry entry, all in this module.

All byte figures are taken above the run's baseline b, the first sample, taken after the
synthetic K/V pools are drawn and before anything is cached. Per step i the samples hold `active`
(a), the step's `peak` (p), the components' `logical` bytes (l), the analytic `minimum` (m), the
step's own input `work` (w) and process `rss`. Active bytes are exact on a given backend, so
detectors on active memory use small floors; the step peak is noisy (an allocator thread frees
inputs asynchronously), so the spike detector needs a floor of a few MiB.

spike (min_bytes 4 MiB, min_ratio 1.05; checked only when stated)
    s_i = max(a_{i-1}, a_i);  excess_i = p_i − s_i − w_i;  ratio_i = (p_i − b) / max(s_i − b, 1)
    flagged where excess_i > min_bytes and ratio_i ≥ min_ratio.
growth (min_bytes 512 KiB; checked only when stated)
    excess_i = (a_i − a_{i-1}) − max(m_i − m_{i-1}, 0), over prefill and decode steps whose
    previous step holds tokens (a sequence's first step is its allocation); flagged where
    excess_i > min_bytes.
leak (warmup 1, min_bytes 64 KiB, r2 0.9; expected none)
    Over the idle points past the baseline and `warmup` more (at least 3): deltas d_k of active
    memory, and a least-squares line with slope σ and coefficient of determination r². The
    rate is median(d) when every d_k > 0, else σ; flagged when rate ≥ min_bytes and either
    every d_k > 0 or r² ≥ r2. Reports the rate, per request (or chat turn).
retained (min_bytes 1 MiB, ratio 0.25; expected none)
    excess_i = a_i − b − l_i; flagged where excess_i > max(min_bytes, ratio × l_i).
host_memory (min_bytes 32 MiB; expected none)
    o = rss − active − MLX cache on the CPU backend (its buffers live in RSS), else rss;
    rise_i = o_i − o_0 at each idle point; flagged where rise_i > min_bytes and
    rise_i > a_i − b.

A per-step detector reports, through `from_hits`, the step of its largest excess, that excess in
bytes, how many steps it hit and the first MAX_STEPS_LISTED of them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from .units import Size, mib

MAX_STEPS_LISTED = 20
MAX_WARMUP = 2**31 - 1          # an int32, as every count of a scenario
Presence = Literal["none", "detected"]


@dataclass
class Finding:
    kind: str
    step: int
    bytes: int
    count: int
    message: str
    steps: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class Thresholds(BaseModel):
    """A detector's settings, `detect.<name>` in a scenario: sizes take units, numbers are
    finite and strict (a bool is not 1), and an unknown key is an error, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def from_hits(kind: str, hits: pd.DataFrame, excess: pd.Series,
              message: Callable[[Hashable], str]) -> Finding | None:
    """The finding of a per-step detector, reported at the hit with the largest excess.

    `message` is given that step's row label, to describe it. No hits, no finding.
    """
    if hits.empty:
        return None
    worst = excess[hits.index].idxmax()
    return Finding(kind, int(hits["step"][worst]), int(excess[worst]), len(hits), message(worst),
                   hits["step"].head(MAX_STEPS_LISTED).tolist())


def _previous_active(frame: pd.DataFrame) -> pd.Series:
    return frame["active"].shift(1, fill_value=frame["active"].iloc[0])


def transients(frame: pd.DataFrame) -> pd.Series:
    """Per step: peak beyond the larger of active before and after, less the step's own input."""
    settled = np.maximum(_previous_active(frame), frame["active"])
    return frame["peak"] - settled - frame["work"]


def spike_ratios(frame: pd.DataFrame) -> pd.Series:
    """Per step: peak over the larger of active before and after, both above the baseline."""
    base = frame["active"].iloc[0]
    settled = np.maximum(_previous_active(frame), frame["active"]) - base
    return (frame["peak"] - base) / settled.clip(lower=1)


class SpikeThresholds(Thresholds):
    min_bytes: Size = 4 * 2**20
    min_ratio: Annotated[float, Field(ge=1.0)] = 1.05


def spike(frame: pd.DataFrame, t: SpikeThresholds, backend: str) -> Finding | None:
    """Transient spike: a step whose peak rises above both the memory before and after it.

    A concatenation that builds a new buffer while the old one is alive is the typical cause.
    """
    excess, ratios = transients(frame), spike_ratios(frame)
    hits = frame[(excess > t.min_bytes) & (ratios >= t.min_ratio)]
    return from_hits("spike", hits, excess, lambda at: (
        f"{len(hits)} transient spike(s); largest +{mib(excess[at])} MiB above the settled "
        f"memory ({ratios[at]:.2f}x) at step {frame['step'][at]} ({frame['phase'][at]})"))


class GrowthThresholds(Thresholds):
    min_bytes: Size = 512 * 2**10


def growth(frame: pd.DataFrame, t: GrowthThresholds, backend: str) -> Finding | None:
    """Growth step: active memory rising by more than the tokens of that step explain.

    Compared between consecutive token steps on one live sequence. A cache growing in blocks,
    or logits kept per step, shows here.
    """
    previous = frame.shift(1)
    eligible = frame["phase"].isin(["prefill", "decode"]) & (previous["tokens"] > 0)
    explained = (frame["minimum"] - previous["minimum"]).clip(lower=0)
    excess = frame["active"] - previous["active"] - explained
    hits = frame[eligible & (excess > t.min_bytes)]
    return from_hits("growth", hits, excess, lambda at: (
        f"{len(hits)} step(s) grew active memory beyond their tokens; largest "
        f"+{mib(excess[at])} MiB at step {frame['step'][at]} ({frame['phase'][at]})"))


def quiescent(frame: pd.DataFrame) -> pd.DataFrame:
    """Samples taken with nothing in flight: after each request, or each chat turn."""
    idle = frame[frame["phase"] == "idle"]
    return idle.iloc[1:]  # the first is the baseline


class LeakThresholds(Thresholds):
    warmup: Annotated[int, Field(ge=0, le=MAX_WARMUP)] = 1
    min_bytes: Size = 64 * 2**10
    r2: Annotated[float, Field(ge=0.0, le=1.0)] = 0.9


def _fit(values: np.ndarray) -> tuple[float, float]:
    """Slope and r² of the least-squares line through `values` at 0, 1, 2..."""
    x = np.arange(len(values), dtype=float)
    slope, intercept = np.polyfit(x, values, 1)
    total = ((values - values.mean()) ** 2).sum()
    r2 = 1.0 - ((values - (slope * x + intercept)) ** 2).sum() / total if total else 0.0
    return float(slope), float(r2)


def leak(frame: pd.DataFrame, t: LeakThresholds, backend: str) -> Finding | None:
    """Leak: active memory at quiescent points keeps rising past the warm-up.

    A trend over requests rather than a set of steps, so it states its own figures: the rate
    per request (or turn) at the last point, over every delta.
    """
    points = quiescent(frame).iloc[t.warmup:]
    if len(points) < 3:
        return None
    active = points["active"].to_numpy(dtype=float)
    deltas = np.diff(active)
    slope, r2 = _fit(active)
    rising = bool((deltas > 0).all())
    rate = float(np.median(deltas)) if rising else slope
    if rate < t.min_bytes or not (rising or r2 >= t.r2):
        return None
    unit = "turn" if (points["turn"] >= 0).any() else "request"
    return Finding(
        "leak", int(points["step"].iloc[-1]), round(rate), len(deltas),
        f"memory at rest grows {rate:,.0f} B per {unit} over {len(deltas)} {unit}s "
        f"after a warm-up of {t.warmup} (fit r²={r2:.3f})",
        points["step"].head(MAX_STEPS_LISTED).tolist())


class RetainedThresholds(Thresholds):
    min_bytes: Size = 2**20
    ratio: Annotated[float, Field(ge=0.0)] = 0.25


def retained(frame: pd.DataFrame, t: RetainedThresholds, backend: str) -> Finding | None:
    """Retained buffer: the allocator holds more than the components say they hold.

    A slice that keeps a whole pre-allocated buffer alive reports the slice's bytes while the
    buffer stays allocated.
    """
    excess = frame["active"] - frame["active"].iloc[0] - frame["logical"]
    hits = frame[excess > np.maximum(t.min_bytes, t.ratio * frame["logical"])]
    return from_hits("retained", hits, excess, lambda at: (
        f"allocator holds {mib(excess[at])} MiB beyond the {mib(frame['logical'][at])} MiB the "
        f"components report, at step {frame['step'][at]} ({frame['phase'][at]})"))


class HostThresholds(Thresholds):
    min_bytes: Size = 32 * 2**20


def _outside_mlx(rows: pd.DataFrame, backend: str) -> pd.Series:
    """Process memory MLX does not count: on CPU its buffers live in RSS, so they come out."""
    if backend == "cpu":
        return rows["rss"] - rows["active"] - rows["cache"]
    return rows["rss"]


def host_memory(frame: pd.DataFrame, t: HostThresholds, backend: str) -> Finding | None:
    """Host memory: process RSS grows while MLX active memory does not.

    Raw bytes held outside MLX never reach MLX's counters. Measured from the baseline to each
    quiescent point.
    """
    points, base = quiescent(frame), frame.iloc[:1]
    rise = _outside_mlx(points, backend) - _outside_mlx(base, backend).iloc[0]
    active_rise = points["active"] - base["active"].iloc[0]
    hits = points[(rise > t.min_bytes) & (rise > active_rise)]
    return from_hits("host_memory", hits, rise, lambda at: (
        f"process memory outside MLX grew {mib(rise[at])} MiB while MLX active grew "
        f"{mib(active_rise[at])} MiB (at step {frame['step'][at]})"))


@dataclass(frozen=True)
class Marker:
    """How the plot marks a finding's steps: a matplotlib marker and colour, on the `active`
    line or at the step `peak`."""

    symbol: str
    color: str
    level: Literal["active", "peak"] = "active"


@dataclass(frozen=True)
class Detector:
    """One registry entry. `find(frame, thresholds, backend)` returns a finding or None;
    `expected` is what `expect.<name>` holds when a scenario states nothing (None: not checked)."""

    find: Callable[[pd.DataFrame, Any, str], Finding | None]
    thresholds: type[Thresholds]
    expected: Presence | None
    marker: Marker


# In the order findings are reported. A growing cache spikes and grows by design, so only the
# scenario can say whether it should; the other three are expected absent everywhere.
DETECTORS: dict[str, Detector] = {
    "spike": Detector(spike, SpikeThresholds, None, Marker("v", "tab:red", "peak")),
    "growth": Detector(growth, GrowthThresholds, None, Marker("^", "tab:orange")),
    "leak": Detector(leak, LeakThresholds, "none", Marker("o", "tab:purple")),
    "retained": Detector(retained, RetainedThresholds, "none", Marker("s", "tab:brown")),
    "host_memory": Detector(host_memory, HostThresholds, "none", Marker("D", "tab:pink")),
}


def detect(frame: pd.DataFrame, thresholds: BaseModel, backend: str) -> list[Finding]:
    """Every registered detector over one run's samples, each with its `thresholds.<name>`."""
    found = (d.find(frame, getattr(thresholds, name), backend) for name, d in DETECTORS.items())
    return [finding for finding in found if finding is not None]
