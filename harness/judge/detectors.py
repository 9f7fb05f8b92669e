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
baseline excluded); there c = the MLX bytes unreachable reference cycles hold (`cyclic`,
found without freeing them) and u = a − b − l − c is the memory nothing accounts for: no
component reports it, and no cycle holds it. Each byte at rest is so attributed once: cycle
garbage to gc_deferred, reported bytes to unbounded, the rest to leak or retained.

The trend test T(x) over a series past `warmup` points: not held, i.e. its last `hold` deltas
or more are flat (each |Δ| and their sum < the floor) and more than any flat run while it
rose (a cache that filled and stopped); from its onset, the last point of a flat start
(values within the floor of the first), at least 3 points; deltas d_k and a least-squares
line with slope σ and coefficient of determination r²; the rate is median(d) when every
d_k > 0, else σ; x rises when rate ≥ its floor and either every d_k > 0 or r² ≥ r2. The split
S: over every quiescent point, the rises of u (positive Δu) where l rose too, by more than
Δu / 20, against those where l did not; u rose "in step" when the first sum ≥ the second. Leak and retained
take the two sides of S, so one rising excess gives one of them, not both.

leak (warmup 1, min_bytes 64 KiB, r2 0.9, hold 3; expected none)
    T(u) with floor min_bytes, and u not in step (S): memory at rest that nothing accounts for
    keeps rising. Reports the rate from the onset, per request (or chat turn). A store that
    grows by design and reports it is not a leak (unbounded), nor is memory that fills and
    holds (plateau).
unbounded (budget None, warmup 1, min_bytes 64 KiB, r2 0.9, hold 3; expected none)
    T(l) with floor min_bytes: the reported bytes keep growing with no plateau. With a budget,
    an error when l at the last quiescent point > budget (nothing within it); with none, a
    warning, which a scenario's default expectation lets pass and a stated one does not.
plateau (min_bytes 1 MiB, flat 64 KiB, hold 3; checked only when stated)
    t = a − b at rest rose by at least min_bytes, then held: its last `hold` deltas or more
    are flat (each |Δ| and their sum < flat) and more than any flat run before. Filled to a
    level, not leaking.
preallocated (no settings; checked only when stated)
    Judged on runs of requests with no store, session or server, where l at a decode step is
    the live request's caches (and a real model's logits in flight). At each decode step i one
    token after a decode step of the same request: t_i = m_i − m_{i-1}, what one more token
    needs now; spare_i = l_i − m_i. Flagged where spare_i > m_i (less than half of it used) and
    spare_i > 512 t_i (more spare slots than twice mlx-lm's 256-slot growth step, which a
    growing cache never holds at a decode step); a warning, reported at the largest spare.
retained (min_bytes 1 MiB, ratio 0.25, warmup 1, min_rate 64 KiB, r2 0.9, hold 3; expected none)
    excess_i = a_i − b − l_i − c_i, where a step's c_i is the larger of the measurements at
    rest before and after it, over every step but a server's in flight (its requests' working
    memory is reported by nothing: there l is what it stores). Nothing when memory is kept
    at rest (a − b − c > min_bytes at a quiescent point) but l is 0 at every one: a component
    with no byte accounting, with nothing to hold the allocator to. When T(u) with floor min_rate
    rises and u is not in step (S), nothing: that excess is leak's (give both the same
    warm-up). Otherwise flagged where
    excess_i > max(min_bytes, ratio × l_i) at any step, reported at the largest; else where
    T(u) rises in step: small waste in every entry stored (a slice that keeps unused slots
    alive), reported as the excess at the last quiescent point.
aliased (min_bytes 1 MiB; expected none)
    over_i = l_i − (a_i − b); flagged where over_i > min_bytes on a prefill or decode step
    and on the step before it, also prefill or decode: the components report more than
    exists, the same arrays counted twice while the request computes (a fetch that hands out
    the store's own cache objects). A lazy copy shares its source's buffer until the next
    write, and a store row is a handover: each counts twice for one row only.
host_memory (min_bytes 32 MiB; expected none)
    o = rss − active − MLX cache on the CPU backend (its buffers live in RSS), else rss;
    rise_i = o_i − o_0 at each idle point; flagged where rise_i > min_bytes and
    rise_i > a_i − b.
gc_deferred (min_bytes 64 KiB; expected none)
    c_q at each quiescent point (0 when `sampling.find_cycles` is false); flagged where
    c_q > min_bytes: unreachable reference cycles hold MLX buffers until the collector runs.
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
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..common.units import Size, mib

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
    """What a detector found. `severity` "warning": shown and recorded, but a scenario's default
    expectation of none is not failed by it (growth with no budget stated); only an expectation
    the scenario states is."""

    kind: str
    step: int
    bytes: int
    count: int
    message: str
    steps: list[int] = field(default_factory=list)
    severity: Literal["error", "warning"] = "error"

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
        f"memory ({ratios[at]:.2f}x) at {where(frame, at)}"))


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
        f"+{mib(excess[at])} MiB at {where(frame, at)}"))


# A server's rows while requests are in flight (harness.run.server_engine): its logical bytes
# are what it stores (its prompt cache), not its requests' working memory, which nothing there
# reports; such rows are judged at rest only.
IN_FLIGHT = ("request", "serve")


def where(frame: pd.DataFrame, at: Hashable) -> str:
    """A row as a finding names it: `step 105 (idle)`; on a server's run with its request too,
    `step 105 (idle, request 13)`."""
    step, phase, request = frame["step"][at], frame["phase"][at], frame["request"][at]
    if request >= 0 and frame["phase"].isin(IN_FLIGHT).any():
        return f"step {step} ({phase}, request {request})"
    return f"step {step} ({phase})"


def quiescent(frame: pd.DataFrame) -> pd.DataFrame:
    """Samples taken with nothing in flight: after each request, or each chat turn."""
    idle = frame[frame["phase"] == "idle"]
    return idle.iloc[1:]  # the first is the baseline


def unexplained(rows: pd.DataFrame, frame: pd.DataFrame) -> pd.Series:
    """Active memory above the run's baseline that neither the components' reported bytes nor
    unreachable cycles (gc_deferred's) account for: what the allocator holds that nothing
    says it keeps."""
    return rows["active"] - frame["active"].iloc[0] - rows["logical"] - cycles_around(rows, frame)


def cycles_around(rows: pd.DataFrame, frame: pd.DataFrame) -> pd.Series:
    """What cycle garbage may hold at each of `rows`: measured at idle points only, so a step
    takes the larger of the measurements at rest before and after it (garbage made during a
    request is still there at its end, unless the collector ran)."""
    import numpy as np

    measured = frame["cyclic"].where(frame["phase"] == "idle")
    spread = np.maximum(measured.ffill().fillna(0), measured.bfill().fillna(0))
    return spread.loc[rows.index]


class TrendThresholds(Thresholds):
    """How a series at rest must rise to count (`rising`): past `warmup` quiescent points,
    every delta positive or a line fit with r² ≥ `r2`; and not held: a series whose last
    `hold` deltas or more are flat, longer than any pause while it rose, has filled and
    stopped. Each detector adds its own floor."""

    warmup: Annotated[int, Field(ge=0, le=MAX_WARMUP)] = 1
    r2: Annotated[float, Field(ge=0.0, le=1.0)] = 0.9
    hold: Annotated[int, Field(ge=1, le=MAX_WARMUP)] = 3


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


def _unit(points: pd.DataFrame) -> str:
    return "turn" if (points["turn"] >= 0).any() else "request"


class LeakThresholds(TrendThresholds):
    min_bytes: Size = 64 * 2**10


def _since(trend: Trend, points: pd.DataFrame, unit: str) -> str:
    """` from request 9` where the rise begins after a flat start, else nothing."""
    if trend.start == 0:
        return ""
    label = points["turn" if unit == "turn" else "request"].iloc[trend.start]
    return f" from {unit} {label}"


def leak(frame: pd.DataFrame, t: LeakThresholds, backend: str) -> Finding | None:
    """Leak: memory at rest that no component reports (nor cycle garbage) keeps rising past the
    warm-up without levelling off, and not in step with what the components report (that is
    `retained`'s waste per entry).

    A store that grows by design reports what it holds, so its growth is not a leak (see
    `unbounded`); memory that fills and holds is not either (see `plateau`). A trend over
    requests rather than a set of steps, so it states its own figures: the rate per request
    (or turn), fitted from where the rise begins.
    """
    points = quiescent(frame).iloc[t.warmup:]
    trend = rising(unexplained(points, frame), t.min_bytes, t.r2, t.hold)
    if trend is None or in_step(frame):
        return None
    unit = _unit(points)
    return Finding(
        "leak", int(points["step"].iloc[-1]), round(trend.rate), trend.deltas,
        f"memory at rest that no component reports grows {trend.rate:,.0f} B per {unit}"
        f"{_since(trend, points, unit)} over {trend.deltas} {unit}s after a warm-up of "
        f"{t.warmup} (fit r²={trend.r2:.3f})",
        points["step"].iloc[trend.start:].head(MAX_STEPS_LISTED).tolist())


class UnboundedThresholds(TrendThresholds):
    budget: Size | None = None
    min_bytes: Size = 64 * 2**10


def unbounded(frame: pd.DataFrame, t: UnboundedThresholds, backend: str) -> Finding | None:
    """Unbounded: the bytes the components report at rest keep rising, with no plateau.

    Honest growth: the store says what it holds, it just never stops holding more. Past a
    stated budget that is an error; within it, nothing; with no budget stated, a warning
    (nothing says how much is too much, but nothing says it stops either).
    """
    points = quiescent(frame).iloc[t.warmup:]
    trend = rising(points["logical"], t.min_bytes, t.r2, t.hold)
    if trend is None:
        return None
    unit, reported = _unit(points), points["logical"].iloc[-1]
    if t.budget is not None and reported <= t.budget:
        return None
    where = (f"over the budget of {mib(t.budget)} MiB" if t.budget is not None else
             "with no budget stated (detect.unbounded.budget)")
    return Finding(
        "unbounded", int(points["step"].iloc[-1]), round(trend.rate), trend.deltas,
        f"components report {mib(reported)} MiB at rest, {where}, growing {trend.rate:,.0f} B "
        f"per {unit}{_since(trend, points, unit)} over {trend.deltas} {unit}s with no plateau "
        f"(fit r²={trend.r2:.3f})",
        points["step"].iloc[trend.start:].head(MAX_STEPS_LISTED).tolist(),
        "error" if t.budget is not None else "warning")


class PlateauThresholds(Thresholds):
    """`min_bytes`: how far memory at rest must have risen; `flat`: a change smaller than this
    is no change; `hold`: flat deltas at the end, more than any pause while it rose."""

    min_bytes: Size = 2**20
    flat: Size = 64 * 2**10
    hold: Annotated[int, Field(ge=1, le=MAX_WARMUP)] = 3


def plateau(frame: pd.DataFrame, t: PlateauThresholds, backend: str) -> Finding | None:
    """Plateau: memory at rest rose, then held: a cache filling to its budget, not a leak.

    Said so that a reader of the plot does not take the rise for a leak (a cache filling to a
    48 GiB budget reads as one); leak and unbounded stay silent on such a series.
    """
    points = quiescent(frame)
    total = (points["active"] - frame["active"].iloc[0]).to_numpy(dtype=float)
    tail = held(total, t.flat, t.hold) if len(total) >= 2 else 0
    if not tail or total[-1] - total[0] < t.min_bytes:
        return None
    unit = _unit(points)
    first = len(points) - 1 - tail
    return Finding(
        "plateau", int(points["step"].iloc[first]), int(total[-1]), tail,
        f"memory at rest rose to {mib(total[-1])} MiB by step {points['step'].iloc[first]} and "
        f"held there over the last {tail} {unit}s: filled, not leaking",
        points["step"].iloc[first:].head(MAX_STEPS_LISTED).tolist())


class PreallocatedThresholds(Thresholds):
    """No settings: the bounds are what no growing cache reaches, so the finding means the same
    on every geometry (and states only facts: what the components report, what tokens need)."""


GROWTH_STEP = 256  # slots mlx-lm's KVCache and RotatingKVCache grow by


def preallocated(frame: pd.DataFrame, t: PreallocatedThresholds, backend: str) -> Finding | None:
    """Preallocated: at decode steps the caches report more than twice what their tokens need,
    spare capacity a cache growing with its tokens never holds: a window allocated up front,
    which costs its whole size from the first token. Informational, for a reader choosing a
    window: the cost of its size at this workload.

    Only where the reported bytes are the live request's: a store's entries, a session's
    logits or a server's prompt cache would read as spare. Prefill steps are left out: mlx-lm's
    RotatingKVCache keeps a chunk longer than its window until the next decode step.
    """
    if frame["phase"].isin(("fetch", "store", "evict", *IN_FLIGHT)).any() or (frame["turn"] >= 0).any():
        return None
    before = frame.shift(1)
    one_more = ((frame["phase"] == "decode") & (before["phase"] == "decode")
                & (frame["request"] == before["request"]) & (frame["tokens"] - before["tokens"] == 1))
    token = frame["minimum"] - before["minimum"]
    spare = frame["logical"] - frame["minimum"]
    hits = frame[one_more & (token > 0) & (spare > frame["minimum"])
                 & (spare > 2 * GROWTH_STEP * token)]

    def message(at: Hashable) -> str:
        reported, used = frame["logical"][at], frame["minimum"][at]
        return (f"the caches report {mib(reported)} MiB at {where(frame, at)} where the "
                f"request's {frame['tokens'][at]:,} tokens need {mib(used)} MiB "
                f"({used / reported:.0%} used): {mib(reported - used)} MiB allocated ahead of its "
                f"tokens, as a window allocated up front is from the first token")

    found = from_hits("preallocated", hits, spare, message)
    return None if found is None else replace(found, severity="warning")


class RetainedThresholds(TrendThresholds):
    min_bytes: Size = 2**20
    ratio: Annotated[float, Field(ge=0.0)] = 0.25
    min_rate: Size = 64 * 2**10


def retained(frame: pd.DataFrame, t: RetainedThresholds, backend: str) -> Finding | None:
    """Retained buffer: the allocator holds more than the components say they hold.

    A slice that keeps a whole pre-allocated buffer alive reports the slice's bytes while the
    buffer stays allocated. Where each entry wastes little, no step crosses the ratio, but the
    excess at rest keeps rising with every entry stored: that trend is flagged too. An excess
    at rest that keeps rising while the reported bytes do not is a leak, and left to `leak`;
    what unreachable cycles hold is gc_deferred's. Where memory is kept at rest and nothing at
    rest is reported (a store with no byte accounting), there is no report to hold the
    allocator to: the shape of that memory is leak's and plateau's to judge.
    """
    import numpy as np

    resting = quiescent(frame)
    kept = resting["active"] - frame["active"].iloc[0] - resting["cyclic"]
    if (kept > t.min_bytes).any() and not (resting["logical"] > 0).any():
        return None  # memory kept at rest, none of it reported: no accounting to hold it to
    points = resting.iloc[t.warmup:]
    at_rest = unexplained(points, frame)
    trend = rising(at_rest, t.min_rate, t.r2, t.hold)
    if trend is not None and not in_step(frame):
        return None
    excess = unexplained(frame, frame)
    judged = ~frame["phase"].isin(IN_FLIGHT)
    hits = frame[judged & (excess > np.maximum(t.min_bytes, t.ratio * frame["logical"]))]
    found = from_hits("retained", hits, excess, lambda at: (
        f"allocator holds {mib(excess[at])} MiB beyond the {mib(frame['logical'][at])} MiB the "
        f"components report, at {where(frame, at)}"))
    if found is not None or trend is None:
        return found
    unit, last = _unit(points), points.index[-1]
    return Finding(
        "retained", int(points["step"][last]), int(at_rest[last]), trend.deltas,
        f"allocator holds {mib(at_rest[last])} MiB beyond the {mib(points['logical'][last])} "
        f"MiB the components report at rest, rising {trend.rate:,.0f} B per {unit} in step "
        f"with them (fit r²={trend.r2:.3f})",
        points["step"].head(MAX_STEPS_LISTED).tolist())


class AliasThresholds(Thresholds):
    min_bytes: Size = 2**20


def aliased(frame: pd.DataFrame, t: AliasThresholds, backend: str) -> Finding | None:
    """Aliased: the components report more than MLX holds above the baseline.

    Every byte reported is an array alive since the baseline, so reporting more than exists
    counts the same arrays twice: a fetch that hands out the store's own cache objects (which
    the request then updates in place, and the store still counts), or two components
    holding one entry. Only where it outlives a write: on a prefill or decode step after
    another. A copy shares its source's buffer until the first write to either (MLX copies
    lazily), so a fetch's copy or a snapshot taken during a step counts twice for that one
    row; and at a store the request hands its caches over.
    """
    over = frame["logical"] - (frame["active"] - frame["active"].iloc[0])
    counted_twice = frame["phase"].isin(["prefill", "decode"]) & (over > t.min_bytes)
    hits = frame[counted_twice & counted_twice.shift(1, fill_value=False)]
    return from_hits("aliased", hits, over, lambda at: (
        f"components report {mib(over[at])} MiB more than MLX holds above the baseline at "
        f"{where(frame, at)}: the same arrays counted twice, as when a "
        f"fetch hands out the store's own cache objects"))


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
    """Deferred by the cycle collector: MLX memory that unreachable reference cycles hold at
    rest, freed only when Python's cycle collector runs, whenever that is in a server.

    Reference cycles (an entry holding a helper closure that refers back to the entry) keep
    their arrays after the entry is dropped. The engine finds them at each idle point without
    freeing them (`cyclic`, harness.run.probe.cycle_garbage).
    """
    points = quiescent(frame)
    held_by_cycles = points["cyclic"]
    hits = points[held_by_cycles > t.min_bytes]
    return from_hits("gc_deferred", hits, held_by_cycles, lambda at: (
        f"unreachable reference cycles hold {mib(held_by_cycles[at])} MiB of MLX memory at rest "
        f"(step {frame['step'][at]}), freed only when the cycle collector runs"))


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
# scenario can say whether it should, a plateau is what a filling cache does and preallocated
# what a window allocated up front does; unbounded growth with no budget stated is a warning,
# which the default expectation lets pass; the others are expected absent everywhere.
DETECTORS: dict[str, Detector] = {
    "spike": Detector(spike, SpikeThresholds, None, Marker("v", "tab:red", "peak")),
    "growth": Detector(growth, GrowthThresholds, None, Marker("^", "tab:orange")),
    "leak": Detector(leak, LeakThresholds, "none", Marker("o", "tab:purple")),
    "unbounded": Detector(unbounded, UnboundedThresholds, "none", Marker("P", "tab:green")),
    "plateau": Detector(plateau, PlateauThresholds, None, Marker("_", "tab:olive")),
    "preallocated": Detector(preallocated, PreallocatedThresholds, None, Marker("d", "tab:olive")),
    "retained": Detector(retained, RetainedThresholds, "none", Marker("s", "tab:brown")),
    "aliased": Detector(aliased, AliasThresholds, "none", Marker("*", "tab:red")),
    "host_memory": Detector(host_memory, HostThresholds, "none", Marker("D", "tab:pink")),
    "gc_deferred": Detector(gc_deferred, GcThresholds, "none", Marker("X", "tab:cyan")),
    "pooled": Detector(pooled, PooledThresholds, "none", Marker("h", "tab:gray")),
}


def detect(frame: pd.DataFrame, thresholds: BaseModel, backend: str) -> list[Finding]:
    """Every registered detector over one run's samples, each with its `thresholds.<name>`."""
    found = (d.find(frame, getattr(thresholds, name), backend) for name, d in DETECTORS.items())
    return [finding for finding in found if finding is not None]
