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

At rest means the quiescent points q (the idle sample after each request or chat turn, the
baseline excluded); there u = a − b − l is the memory no component reports. The trend test
T(x) over a series past `warmup` points (at least 3): deltas d_k and a least-squares line with
slope σ and coefficient of determination r²; the rate is median(d) when every d_k > 0, else σ;
x rises when rate ≥ its floor and either every d_k > 0 or r² ≥ r2. The split S: over every
quiescent point, the rises of u (positive Δu) where l rose too (Δl > 0) against those where l
did not; u rose "in step" when the first sum ≥ the second. Leak and retained take the two
sides of S, so one rising excess gives one of them, not both.

leak (warmup 1, min_bytes 64 KiB, r2 0.9; expected none)
    T(u) with floor min_bytes, and u not in step (S): memory at rest that the reported bytes
    do not explain keeps rising. Reports the rate, per request (or chat turn). A store that
    grows by design and reports it is not a leak (unbounded).
unbounded (budget None, warmup 1, min_bytes 64 KiB, r2 0.9; expected none)
    T(l) with floor min_bytes, and l at the last quiescent point > budget: the reported bytes
    keep growing past what the scenario allows. Reports the rate per request (or turn). With
    no budget (the default) it is not checked: nothing says how much is too much.
retained (min_bytes 1 MiB, ratio 0.25, warmup 1, min_rate 64 KiB, r2 0.9; expected none)
    excess_i = a_i − b − l_i. When T(u) with floor min_rate rises and u is not in step (S),
    nothing: that excess is leak's (give both the same warm-up). Otherwise flagged where
    excess_i > max(min_bytes, ratio × l_i) at any step, reported at the largest; else where
    T(u) rises in step: small waste in every entry stored (a slice that keeps unused slots
    alive), reported as the excess at the last quiescent point.
host_memory (min_bytes 32 MiB; expected none)
    o = rss − active − MLX cache on the CPU backend (its buffers live in RSS), else rss;
    rise_i = o_i − o_0 at each idle point; flagged where rise_i > min_bytes and
    rise_i > a_i − b.
gc_deferred (min_bytes 64 KiB; expected none)
    c_q = the MLX bytes `gc.collect()` freed just before quiescent sample q (the `collected`
    column; 0 when `sampling.collect_cycles` is false); flagged where c_q > min_bytes:
    reference cycles held MLX buffers until the cycle collector ran.
pooled (min_bytes None: 64 MiB on CPU, unchecked elsewhere; expected none)
    k_q = MLX's buffer cache (`cache`, freed buffers kept for reuse) at quiescent point q;
    flagged where k_q > min_bytes. MLX's default cache limit on the CPU backend is 32 MiB, so
    a run at the default never reaches it; a component that raises the limit can. On Metal
    and CUDA the default limit follows the device's memory: checked only with a stated
    min_bytes.

A per-step detector reports, through `from_hits`, the step of its largest excess, that excess in
bytes, how many steps it hit and the first MAX_STEPS_LISTED of them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .units import Size, mib

# numpy and pandas are imported where a frame is read: the scenario schema imports this module
# for the registry alone, and rejecting a bad file must not wait for them.
if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

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
    import numpy as np

    settled = np.maximum(_previous_active(frame), frame["active"])
    return frame["peak"] - settled - frame["work"]


def spike_ratios(frame: pd.DataFrame) -> pd.Series:
    """Per step: peak over the larger of active before and after, both above the baseline."""
    import numpy as np

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


def unexplained(rows: pd.DataFrame, frame: pd.DataFrame) -> pd.Series:
    """Active memory above the run's baseline that the components' reported bytes do not
    account for: what the allocator holds that no component says it keeps."""
    return rows["active"] - frame["active"].iloc[0] - rows["logical"]


class TrendThresholds(Thresholds):
    """How a series at rest must rise to count (`rising`): past `warmup` quiescent points,
    every delta positive or a line fit with r² ≥ `r2`. Each detector adds its own floor."""

    warmup: Annotated[int, Field(ge=0, le=MAX_WARMUP)] = 1
    r2: Annotated[float, Field(ge=0.0, le=1.0)] = 0.9


@dataclass(frozen=True)
class Trend:
    """A series that keeps rising: bytes per point, the line fit's r², how many deltas."""

    rate: float
    r2: float
    deltas: int


def _fit(values: np.ndarray) -> tuple[float, float]:
    """Slope and r² of the least-squares line through `values` at 0, 1, 2..."""
    import numpy as np

    x = np.arange(len(values), dtype=float)
    slope, intercept = np.polyfit(x, values, 1)
    total = ((values - values.mean()) ** 2).sum()
    r2 = 1.0 - ((values - (slope * x + intercept)) ** 2).sum() / total if total else 0.0
    return float(slope), float(r2)


def rising(values: pd.Series, min_rate: float, r2: float) -> Trend | None:
    """The trend test: at least 3 values; the rate is the median delta when every delta is
    positive, else the fitted slope; rising when rate ≥ min_rate and either every delta is
    positive or the fit's r² ≥ r2."""
    import numpy as np

    if len(values) < 3:
        return None
    series = values.to_numpy(dtype=float)
    deltas = np.diff(series)
    slope, fit = _fit(series)
    every = bool((deltas > 0).all())
    rate = float(np.median(deltas)) if every else slope
    if rate < min_rate or not (every or fit >= r2):
        return None
    return Trend(rate, fit, len(deltas))


def in_step(frame: pd.DataFrame) -> bool:
    """Whether the unexplained memory at rest rose in step with the reported bytes.

    Over every quiescent point (no warm-up, so leak and retained split the same way): the
    rises of the excess between points where the reported bytes also rose, against those
    where they did not. Waste proportional to what is held comes with what is stored; a leak
    rises while the store's own count stands still.
    """
    import numpy as np

    points = quiescent(frame)
    rise = np.diff(unexplained(points, frame).to_numpy(dtype=float)).clip(min=0)
    grew = np.diff(points["logical"].to_numpy(dtype=float)) > 0
    return bool(rise[grew].sum() >= rise[~grew].sum())


def _unit(points: pd.DataFrame) -> str:
    return "turn" if (points["turn"] >= 0).any() else "request"


class LeakThresholds(TrendThresholds):
    min_bytes: Size = 64 * 2**10


def leak(frame: pd.DataFrame, t: LeakThresholds, backend: str) -> Finding | None:
    """Leak: memory at rest that no component reports keeps rising past the warm-up, and not
    in step with what the components report (that is `retained`'s waste per entry).

    A store that grows by design reports what it holds, so its growth is not a leak (see
    `unbounded`). A trend over requests rather than a set of steps, so it states its own
    figures: the rate per request (or turn) at the last point, over every delta.
    """
    points = quiescent(frame).iloc[t.warmup:]
    trend = rising(unexplained(points, frame), t.min_bytes, t.r2)
    if trend is None or in_step(frame):
        return None
    unit = _unit(points)
    return Finding(
        "leak", int(points["step"].iloc[-1]), round(trend.rate), trend.deltas,
        f"memory at rest that no component reports grows {trend.rate:,.0f} B per {unit} over "
        f"{trend.deltas} {unit}s after a warm-up of {t.warmup} (fit r²={trend.r2:.3f})",
        points["step"].head(MAX_STEPS_LISTED).tolist())


class UnboundedThresholds(TrendThresholds):
    budget: Size | None = None
    min_bytes: Size = 64 * 2**10


def unbounded(frame: pd.DataFrame, t: UnboundedThresholds, backend: str) -> Finding | None:
    """Unbounded: the bytes the components report at rest keep rising, past a stated budget.

    Honest growth: the store says what it holds, it just never stops holding more. Without a
    budget nothing says how much is too much, so nothing is checked.
    """
    points = quiescent(frame).iloc[t.warmup:]
    if t.budget is None or points.empty or points["logical"].iloc[-1] <= t.budget:
        return None
    trend = rising(points["logical"], t.min_bytes, t.r2)
    if trend is None:
        return None
    unit, held = _unit(points), points["logical"].iloc[-1]
    return Finding(
        "unbounded", int(points["step"].iloc[-1]), round(trend.rate), trend.deltas,
        f"components report {mib(held)} MiB at rest, over the budget of {mib(t.budget)} MiB, "
        f"growing {trend.rate:,.0f} B per {unit} over {trend.deltas} {unit}s "
        f"(fit r²={trend.r2:.3f})",
        points["step"].head(MAX_STEPS_LISTED).tolist())


class RetainedThresholds(TrendThresholds):
    min_bytes: Size = 2**20
    ratio: Annotated[float, Field(ge=0.0)] = 0.25
    min_rate: Size = 64 * 2**10


def retained(frame: pd.DataFrame, t: RetainedThresholds, backend: str) -> Finding | None:
    """Retained buffer: the allocator holds more than the components say they hold.

    A slice that keeps a whole pre-allocated buffer alive reports the slice's bytes while the
    buffer stays allocated. Where each entry wastes little, no step crosses the ratio, but the
    excess at rest keeps rising with every entry stored: that trend is flagged too. An excess
    at rest that keeps rising while the reported bytes do not is a leak, and left to `leak`.
    """
    import numpy as np

    points = quiescent(frame).iloc[t.warmup:]
    at_rest = unexplained(points, frame)
    trend = rising(at_rest, t.min_rate, t.r2)
    if trend is not None and not in_step(frame):
        return None
    excess = unexplained(frame, frame)
    hits = frame[excess > np.maximum(t.min_bytes, t.ratio * frame["logical"])]
    found = from_hits("retained", hits, excess, lambda at: (
        f"allocator holds {mib(excess[at])} MiB beyond the {mib(frame['logical'][at])} MiB the "
        f"components report, at step {frame['step'][at]} ({frame['phase'][at]})"))
    if found is not None or trend is None:
        return found
    unit, last = _unit(points), points.index[-1]
    return Finding(
        "retained", int(points["step"][last]), int(at_rest[last]), trend.deltas,
        f"allocator holds {mib(at_rest[last])} MiB beyond the {mib(points['logical'][last])} "
        f"MiB the components report at rest, rising {trend.rate:,.0f} B per {unit} in step "
        f"with them (fit r²={trend.r2:.3f})",
        points["step"].head(MAX_STEPS_LISTED).tolist())


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


class GcThresholds(Thresholds):
    min_bytes: Size = 64 * 2**10


def gc_deferred(frame: pd.DataFrame, t: GcThresholds, backend: str) -> Finding | None:
    """Deferred by the cycle collector: MLX memory that only `gc.collect()` freed at rest.

    Reference cycles (an entry holding a helper closure that refers back to the entry) keep
    their arrays until Python's cycle collector runs, whenever that is in a server. The engine
    collects at each idle point and records what that freed (`collected`).
    """
    points = quiescent(frame)
    freed = points["collected"]
    hits = points[freed > t.min_bytes]
    return from_hits("gc_deferred", hits, freed, lambda at: (
        f"the cycle collector freed {mib(freed[at])} MiB of MLX memory at rest (step "
        f"{frame['step'][at]}): reference cycles held it until then"))


# Twice MLX's default cache limit on the CPU backend (32 MiB). Metal's and CUDA's defaults
# follow the device's memory, so no fixed floor fits them; there a scenario states one.
POOLED_CPU_FLOOR = 64 * 2**20


class PooledThresholds(Thresholds):
    min_bytes: Size | None = None


def pooled(frame: pd.DataFrame, t: PooledThresholds, backend: str) -> Finding | None:
    """Pooled: MLX's buffer cache still holds freed buffers at rest, memory that is neither in
    use nor returned to the system. A cache limit raised above MLX's default does this."""
    floor = t.min_bytes if t.min_bytes is not None else (
        POOLED_CPU_FLOOR if backend == "cpu" else None)
    if floor is None:
        return None
    points = quiescent(frame)
    cache = points["cache"]
    hits = points[cache > floor]
    return from_hits("pooled", hits, cache, lambda at: (
        f"MLX's buffer cache holds {mib(cache[at])} MiB of freed buffers at rest (step "
        f"{frame['step'][at]}), with {mib(frame['active'][at] - frame['active'].iloc[0])} MiB "
        f"active above the baseline"))


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
# scenario can say whether it should; unbounded is checked only against a stated budget; the
# others are expected absent everywhere.
DETECTORS: dict[str, Detector] = {
    "spike": Detector(spike, SpikeThresholds, None, Marker("v", "tab:red", "peak")),
    "growth": Detector(growth, GrowthThresholds, None, Marker("^", "tab:orange")),
    "leak": Detector(leak, LeakThresholds, "none", Marker("o", "tab:purple")),
    "unbounded": Detector(unbounded, UnboundedThresholds, "none", Marker("P", "tab:green")),
    "retained": Detector(retained, RetainedThresholds, "none", Marker("s", "tab:brown")),
    "host_memory": Detector(host_memory, HostThresholds, "none", Marker("D", "tab:pink")),
    "gc_deferred": Detector(gc_deferred, GcThresholds, "none", Marker("X", "tab:cyan")),
    "pooled": Detector(pooled, PooledThresholds, "none", Marker("h", "tab:gray")),
}


def detect(frame: pd.DataFrame, thresholds: BaseModel, backend: str) -> list[Finding]:
    """Every registered detector over one run's samples, each with its `thresholds.<name>`."""
    found = (d.find(frame, getattr(thresholds, name), backend) for name, d in DETECTORS.items())
    return [finding for finding in found if finding is not None]
