"""Detectors: functions from one run's samples to a finding, registered in `DETECTORS`.

The registry drives everything a detector touches: `detect()` runs each entry, a scenario's
`detect.<name>` block is validated against the entry's thresholds class (`DetectSpec`),
`expect.<name>` defaults to the entry's `expected`, and the plot marks its steps with the
entry's marker. Adding a detector is one function, one thresholds class and one registry entry,
all in this module. Each thresholds class holds its defaults; docs/detectors.md gives every
rule with them (a test holds the page to the classes).

Notation (harness.judge.frames): all bytes above the run's baseline b; per step `active` a,
the step's `peak` p, the components' `logical` bytes l, the analytic `minimum` m, the step's
own input `work` w, process `rss`. At rest means the quiescent points q (the idle sample after
each request or chat turn, the baseline excluded); there c = the MLX bytes unreachable
reference cycles hold (`cyclic`, found without freeing them) and u = a − b − l − c is the
memory nothing accounts for. Each byte at rest is attributed once: cycle garbage to
gc_deferred, reported bytes to unbounded, the rest to leak or retained, split by S (the trend
test T and the split S: harness.judge.trend). Active bytes are exact on a given backend, so
detectors on active memory use small floors; the step peak is noisy (an allocator thread frees
inputs asynchronously), so the spike detector needs a floor of a few MiB.

spike      s_i = max(a_{i-1}, a_i); excess_i = p_i − s_i − w_i; ratio_i = (p_i − b) / max(s_i − b, 1);
           flagged where excess_i > min_bytes and ratio_i ≥ min_ratio.
growth     excess_i = (a_i − a_{i-1}) − max(m_i − m_{i-1}, 0) over prefill and decode steps whose
           previous step holds tokens; flagged where excess_i > min_bytes.
leak       T(u) with floor min_bytes, and u not in step (S); the rate per request (or turn).
unbounded  T(l) with floor min_bytes; an error when l at the last point > budget, a warning
           with no budget stated.
plateau    a − b at rest rose by at least min_bytes, then held (flat: each |Δ| and their sum
           < flat over the last `hold` deltas or more, more than any pause before).
preallocated  on runs of requests with no store, session or server, at a decode step one
           token after another of the same request: spare = l − m > m and > 512 (m_i − m_{i-1});
           a warning, at the largest spare.
retained   excess_i = a_i − b − l_i − c_i (c_i the larger measurement at rest around step i),
           over every step but a server's in flight, > max(min_bytes, ratio × l_i); else T(u)
           with floor min_rate in step (S); nothing when T(u) rises not in step (leak's), or
           when memory is kept at rest but l is 0 at every point (no accounting to hold to).
aliased    over_i = l_i − (a_i − b) > min_bytes on a prefill or decode step and the step
           before it: the same arrays counted twice.
host_memory  o = rss − active − cache on CPU (its buffers live in RSS), else rss; rise_i =
           o_i − o_0 at rest > min_bytes and > a_i − b.
gc_deferred  c_q > min_bytes at a quiescent point.
pooled     MLX's buffer cache at a quiescent point > min_bytes (on CPU twice its default limit
           when unset; elsewhere checked only with a stated min_bytes).

A per-step detector reports, through `from_hits`, the step of its largest excess, that excess in
bytes, how many steps it hit and the first MAX_STEPS_LISTED of them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ..agent.kvmem_agent import IN_FLIGHT
from ..common.strict import Strict, registered
from ..common.units import Size, mib
from .frames import (
    point_name,
    quiescent,
    spike_ratios,
    transients,
    unexplained,
    where,
)
from .records import Finding
from .trend import Trend, held, in_step, rising

# numpy and pandas are imported where a frame is read: the scenario schema imports this module
# for the registry alone, and rejecting a bad file must not wait for them.
if TYPE_CHECKING:
    import pandas as pd

MAX_STEPS_LISTED = 20
MAX_WARMUP = 2**31 - 1          # an int32, as every count of a scenario
Presence = Literal["none", "detected"]


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
    return Finding(kind=kind, step=int(hits["step"][worst]), bytes=int(excess[worst]),
                   count=len(hits), message=message(worst),
                   steps=hits["step"].head(MAX_STEPS_LISTED).tolist())


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


class TrendThresholds(Thresholds):
    """How a series at rest must rise to count (`rising`): past `warmup` quiescent points,
    every delta positive or a line fit with r² ≥ `r2`; and not held: a series whose last
    `hold` deltas or more are flat, longer than any pause while it rose, has filled and
    stopped. Each detector adds its own floor."""

    warmup: Annotated[int, Field(ge=0, le=MAX_WARMUP)] = 1
    r2: Annotated[float, Field(ge=0.0, le=1.0)] = 0.9
    hold: Annotated[int, Field(ge=1, le=MAX_WARMUP)] = 3


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
    unit = point_name(points)
    return Finding(
        kind="leak", step=int(points["step"].iloc[-1]), bytes=round(trend.rate),
        count=trend.deltas,
        message=f"memory at rest that no component reports grows {trend.rate:,.0f} B per "
                f"{unit}{_since(trend, points, unit)} over {trend.deltas} {unit}s after a "
                f"warm-up of {t.warmup} (fit r²={trend.r2:.3f})",
        steps=points["step"].iloc[trend.start:].head(MAX_STEPS_LISTED).tolist())


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
    unit, reported = point_name(points), points["logical"].iloc[-1]
    if t.budget is not None and reported <= t.budget:
        return None
    over = (f"over the budget of {mib(t.budget)} MiB" if t.budget is not None else
            "with no budget stated (detect.unbounded.budget)")
    return Finding(
        kind="unbounded", step=int(points["step"].iloc[-1]), bytes=round(trend.rate),
        count=trend.deltas,
        message=f"components report {mib(reported)} MiB at rest, {over}, growing "
                f"{trend.rate:,.0f} B per {unit}{_since(trend, points, unit)} over "
                f"{trend.deltas} {unit}s with no plateau (fit r²={trend.r2:.3f})",
        steps=points["step"].iloc[trend.start:].head(MAX_STEPS_LISTED).tolist(),
        severity="error" if t.budget is not None else "warning")


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
    unit = point_name(points)
    first = len(points) - 1 - tail
    return Finding(
        kind="plateau", step=int(points["step"].iloc[first]), bytes=int(total[-1]), count=tail,
        message=f"memory at rest rose to {mib(total[-1])} MiB by step "
                f"{points['step'].iloc[first]} and held there over the last {tail} {unit}s: "
                "filled, not leaking",
        steps=points["step"].iloc[first:].head(MAX_STEPS_LISTED).tolist())


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
    unit, last = point_name(points), points.index[-1]
    return Finding(
        kind="retained", step=int(points["step"][last]), bytes=int(at_rest[last]),
        count=trend.deltas,
        message=f"allocator holds {mib(at_rest[last])} MiB beyond the "
                f"{mib(points['logical'][last])} MiB the components report at rest, rising "
                f"{trend.rate:,.0f} B per {unit} in step with them (fit r²={trend.r2:.3f})",
        steps=points["step"].head(MAX_STEPS_LISTED).tolist())


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


class DetectSpec(Strict):
    """`detect:` in a scenario: each registered detector's thresholds under its name.

    Validated against the registry as it stands when a scenario is read (`registered`), so a
    detector registered after import is known and a name not registered is unknown; the
    thresholds are held as extra fields, so a spec pickles (to a variant's child) by value.
    """

    model_config = ConfigDict(extra="allow", defer_build=True)

    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any: ...


def _thresholds() -> dict[str, tuple[Any, Any]]:
    return {name: (d.thresholds, d.thresholds()) for name, d in DETECTORS.items()}


# `detect:`'s validator (the schema's field takes it as its BeforeValidator), and its default.
detect_spec = registered(DetectSpec, _thresholds)
Detect = Annotated[DetectSpec, BeforeValidator(detect_spec)]


def detect(frame: pd.DataFrame, thresholds: DetectSpec, backend: str) -> list[Finding]:
    """Every registered detector over one run's samples, each with its `thresholds.<name>`."""
    found = (d.find(frame, getattr(thresholds, name), backend) for name, d in DETECTORS.items())
    return [finding for finding in found if finding is not None]
