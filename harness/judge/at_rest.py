"""Detectors of memory at rest (the idle sample after each request or turn): leak, unbounded
growth or memory over its budget, a plateau, retained buffers, host memory, cycle garbage, the
buffer pool, a cache over its own cap, and accounting that claims more than is held (formulas:
harness.judge.detectors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from ..agent.kvmem_sample import IN_FLIGHT
from ..common.units import KiB, MiB, Size, exact_bytes, mib
from .frames import point_name, quiescent, unexplained, where
from .records import Finding, Severity, from_hits, listed
from .thresholds import MAX_WARMUP, Thresholds, TrendThresholds
from .trend import Trend, held, in_step, rising

if TYPE_CHECKING:
    import pandas as pd


class LeakThresholds(TrendThresholds):
    min_bytes: Size = 64 * KiB


def _since(trend: Trend, points: pd.DataFrame, unit: str) -> str:
    """` from request 9` where the rise begins after a flat start, else nothing."""
    if trend.start == 0:
        return ""
    label = points["turn" if unit == "turn" else "request"].iloc[trend.start]
    return f" from {unit} {label}"


def _trending(kind: str, points: pd.DataFrame, trend: Trend, rate: float, head: str,
              middle: str = "", tail: str = "", severity: Severity = "error") -> Finding:
    """A finding of a rise over the points at rest, in the words every trend uses: `head`, the
    rate per request (or turn) from where the rise begins, over how many, `middle`, the fit,
    `tail`."""
    unit = point_name(points)
    return Finding(
        kind=kind, step=int(points["step"].iloc[-1]), bytes=round(rate), count=trend.deltas,
        message=f"{head} {exact_bytes(rate)} per {unit}{_since(trend, points, unit)} over "
                f"{trend.deltas} {unit}s{middle} (fit r²={trend.r2:.3f}){tail}",
        steps=listed(points["step"].iloc[trend.start:]),
        severity=severity, per=unit)


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
    return _trending("leak", points, trend, trend.rate,
                     "memory at rest that no component reports grows",
                     middle=f" after a warm-up of {t.warmup}")


def held_at_rest(points: pd.DataFrame, frame: pd.DataFrame) -> pd.Series:
    """The bytes the components hold at rest: their count, as far as MLX memory confirms it.

    Memory confirms what MLX holds above the baseline b, and of the count the baseline already
    had (l_0: a cache a server reloaded before its first sample), as much as MLX held in all
    then (a_0): h = min(l, a − b + min(l_0, a_0)). Claimed is not held: a cache reloaded with a
    lazy `mx.load` counts arrays MLX has not allocated, a wrong counter counts what it never
    kept; such a count is `overclaimed`'s (or nothing's), never memory over a budget or a cap.
    A baseline that holds other memory (a model's weights) can confirm up to that much of a
    lazily reloaded count: the samples cannot tell those bytes apart.
    """
    import numpy as np

    base = frame.iloc[0]
    confirmed = min(base["logical"], base["active"])
    above = (points["active"] - base["active"]).clip(lower=0) + confirmed
    return np.minimum(points["logical"], above)


@dataclass(frozen=True)
class Limit:
    """The one rule for memory at rest over a bound, a budget or a cap: held bytes over it by
    more than `slack_bytes` and `slack_ratio` of it, where the run ends; `admitted`, also at
    more than half of the points at rest since it first went over.

    A budget the scenario states is the user's own hard bound: `Limit()`, one byte over where
    the run ends is over. A cap the cache enforces when the next request is admitted (mlx-lm's
    prompt cache) leaves the entry a request stores over it until then, now and then and by a
    little: that is the cap working, and `over_cap` judges it with the slack of its thresholds.
    """

    slack_bytes: int = 0
    slack_ratio: float = 0.0
    admitted: bool = False

    def over(self, kept: pd.Series, bound: pd.Series | int) -> pd.Series:
        """Per point: whether `kept` is over `bound` by more than the slack."""
        excess = kept - bound
        return (excess > self.slack_bytes) & (excess > self.slack_ratio * bound)

    def breached(self, over: pd.Series) -> bool:
        """Over where the run ends (and, `admitted`, at most points since it first was)."""
        if over.empty or not over.iloc[-1]:
            return False
        return not self.admitted or bool(over.loc[over.idxmax():].mean() > 0.5)


class UnboundedThresholds(TrendThresholds):
    budget: Size | None = None
    min_bytes: Size = 64 * KiB


def unbounded(frame: pd.DataFrame, t: UnboundedThresholds, backend: str) -> Finding | None:
    """Unbounded: the bytes the components hold at rest (`held_at_rest`) end over the
    scenario's budget, whether they grew there, held flat there or started there; or, with no budget
    stated and no cap of the cache's own, they keep rising with no plateau.

    Honest growth: the store says what it holds, it just never stops holding more. Past a
    stated budget that is an error, however the held bytes got there (`Limit()`); within it,
    nothing. With no budget stated, a cache that reports its own cap is bounded by it, and
    `over_cap` judges that bound (its registry entry answers for this one there); with
    neither, growth is a warning (nothing says how much is too much, but nothing says it
    stops either).
    """
    points = quiescent(frame).iloc[t.warmup:]
    if points.empty or (t.budget is None and _own_cap(points)):
        return None
    kept = held_at_rest(points, frame)
    trend = rising(kept, t.min_bytes, t.r2, t.hold)
    if t.budget is None:
        return None if trend is None else _trending(
            "unbounded", points, trend, trend.rate,
            f"components hold {mib(kept.iloc[-1])} MiB at rest, with no budget stated "
            "(detect.unbounded.budget), growing", middle=" with no plateau", severity="warning")
    over = Limit().over(kept, t.budget)
    if not Limit().breached(over):
        return None
    if trend is None:
        return _over_budget(points, kept, over, t.budget)
    return _trending("unbounded", points, trend, trend.rate,
                     f"components hold {mib(kept.iloc[-1])} MiB at rest, over the budget of "
                     f"{mib(t.budget)} MiB, growing", middle=" with no plateau")


def _own_cap(points: pd.DataFrame) -> bool:
    """Whether the agent read a cap the cache allows itself, at the last point at rest."""
    return "cap" in points and bool(points["cap"].iloc[-1] > 0)


def _over_budget(points: pd.DataFrame, kept: pd.Series, over: pd.Series,
                 budget: int) -> Finding:
    """Held bytes at rest over the budget without rising: held there since the first point
    over it (the first point at rest, for a server restarted onto a cache it reloaded and
    holds)."""
    unit, first = point_name(points), over.idxmax()
    since = ("from the first point at rest" if first == points.index[0]
             else f"since {unit} {points.loc[first, 'turn' if unit == 'turn' else 'request']}")
    return Finding(
        kind="unbounded", step=int(points["step"].iloc[-1]), bytes=int(kept.iloc[-1] - budget),
        count=int(over.sum()),
        message=f"components hold {mib(kept.iloc[-1])} MiB at rest, over the budget of "
                f"{mib(budget)} MiB {since}, not rising: over it at {int(over.sum())} of "
                f"{len(points)} points at rest",
        steps=listed(points["step"][over]))


class PlateauThresholds(Thresholds):
    """`min_bytes`: how far memory at rest must have risen; `flat`: a change smaller than this
    is no change; `hold`: flat deltas at the end, more than any pause while it rose."""

    min_bytes: Size = MiB
    flat: Size = 64 * KiB
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
        steps=listed(points["step"].iloc[first:]))


class RetainedThresholds(TrendThresholds):
    min_bytes: Size = MiB
    ratio: Annotated[float, Field(ge=0.0)] = 0.25
    min_rate: Size = 64 * KiB


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
                f"{exact_bytes(trend.rate)} per {unit} in step with them (fit r²={trend.r2:.3f})",
        steps=listed(points["step"]))


class HostThresholds(TrendThresholds):
    """`min_bytes`: a rise from the baseline flagged at once; `min_rate`: what at least half of
    the requests of a sustained rise add each, `min_trend_bytes` what they add in all. RSS is
    noisy (allocator arenas, Python's own objects, pages), hence a high floor for one rise; a
    rise that comes back request after request is a trend that noise does not make."""

    min_bytes: Size = 32 * MiB
    min_rate: Size = 256 * KiB
    min_trend_bytes: Size = 8 * MiB


def _outside_mlx(rows: pd.DataFrame, backend: str) -> pd.Series:
    """Process memory MLX does not count: on CPU its buffers live in RSS, so they come out."""
    if backend == "cpu":
        return rows["rss"] - rows["active"] - rows["cache"]
    return rows["rss"]


def host_memory(frame: pd.DataFrame, t: HostThresholds, backend: str) -> Finding | None:
    """Host memory: process memory outside MLX rose past a floor from the baseline, or rises
    request after request (`_host_trend`) while staying under it.

    Raw bytes held outside MLX never reach MLX's counters. Measured from the baseline to each
    quiescent point. A store that keeps a NumPy copy of every request adds 1 MiB a request
    under a 32 MiB floor for a whole short run: its trend is what gives it away.
    """
    points, base = quiescent(frame), frame.iloc[:1]
    rise = _outside_mlx(points, backend) - _outside_mlx(base, backend).iloc[0]
    active_rise = points["active"] - base["active"].iloc[0]
    hits = points[(rise > t.min_bytes) & (rise > active_rise)]
    found = from_hits("host_memory", hits, rise, lambda at: (
        f"process memory outside MLX grew {mib(rise[at])} MiB while MLX active grew "
        f"{mib(active_rise[at])} MiB (at step {frame['step'][at]})"))
    if found is not None:
        return found
    return _host_trend(points, _host(points, backend) - _host(base, backend).iloc[0], t)


def _host(rows: pd.DataFrame, backend: str) -> pd.Series:
    """What the trend follows: process memory outside MLX; elsewhere than CPU, where RSS may hold
    MLX's own buffers (unified memory), only what it holds beyond them."""
    outside = _outside_mlx(rows, backend)
    return outside if backend == "cpu" else outside - rows["active"]


def host_rate(frame: pd.DataFrame, t: HostThresholds, backend: str) -> int | None:
    """What at least half of the points at rest past the warm-up add to process memory outside
    MLX (the lower median of its deltas, as the trend reads a request's rise), the figure the
    gate holds host memory to request by request; None with fewer than two such points."""
    points = quiescent(frame).iloc[t.warmup:]
    if len(points) < 2:
        return None
    deltas = _host(points, backend).astype(float).diff().dropna().sort_values()
    return int(deltas.iloc[(len(deltas) - 1) // 2])


def _host_trend(points: pd.DataFrame, rise: pd.Series, t: HostThresholds) -> Finding | None:
    """A sustained rise: T(rise) with floor `min_rate` past the warm-up, whose typical request
    (the lower median delta from the onset: at least half of them add this much) adds
    `min_rate` or more, and `min_trend_bytes` or more over the requests it spans. The median
    ignores a one-off step (an allocator arena, a thread's stack) however large it is."""
    judged = rise.iloc[t.warmup:]
    trend = rising(judged, t.min_rate, t.r2, t.hold)
    if trend is None:
        return None
    deltas = judged.iloc[trend.start:].astype(float).diff().dropna().sort_values()
    rate = float(deltas.iloc[(len(deltas) - 1) // 2])
    if rate < t.min_rate or rate * trend.deltas < t.min_trend_bytes:
        return None
    window = points.iloc[t.warmup:]
    return _trending("host_memory", window, trend, rate, "process memory outside MLX grows",
                     tail=f", {mib(judged.iloc[-1])} MiB above the baseline at rest; the "
                          f"components report {mib(window['host'].iloc[-1])} MiB outside MLX")


class GcThresholds(Thresholds):
    min_bytes: Size = 64 * KiB


def gc_deferred(frame: pd.DataFrame, t: GcThresholds, backend: str) -> Finding | None:
    """Deferred by the cycle collector: MLX memory that unreachable reference cycles hold at
    rest, freed only when Python's cycle collector runs, whenever that is in a server.

    Reference cycles (an entry holding a helper closure that refers back to the entry) keep
    their arrays after the entry is dropped. The engine finds them at each idle point without
    freeing them (`cyclic`, harness.agent.kvmem_agent.at_rest).
    """
    points = quiescent(frame)
    held_by_cycles = points["cyclic"]
    hits = points[held_by_cycles > t.min_bytes]
    return from_hits("gc_deferred", hits, held_by_cycles, lambda at: (
        f"unreachable reference cycles hold {mib(held_by_cycles[at])} MiB of MLX memory at rest "
        f"(step {frame['step'][at]}), freed only when the cycle collector runs"))


# Twice MLX's default cache limit on the CPU backend (32 MiB). Metal's and CUDA's defaults
# follow the device's memory, so no fixed floor fits them; there a scenario states one.
POOLED_CPU_FLOOR = 64 * MiB


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


class OverCapThresholds(Thresholds):
    """The slack of a cap enforced when the next request is admitted, the one place kvmem
    states it (`Limit`): over by more than `min_bytes` and `ratio` of the cap."""

    min_bytes: Size = 64 * KiB
    ratio: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.05


def over_cap(frame: pd.DataFrame, t: OverCapThresholds, backend: str) -> Finding | None:
    """Over its own cap: at rest, the components hold (`held_at_rest`) more than the bytes
    they allow themselves, a limit the agent reads from a server (`server.cap`: mlx_lm.server's
    `--prompt-cache-bytes`), so the cap is a budget no scenario restates. mlx-lm #1807 (a
    hybrid model's cache grows past it) and PR #1409 (the cap ignored with `--kv-bits`) are
    this. Judged by `Limit` as a cap enforced at admission: mlx-lm's leaves the entry a
    request stores over it until the next is admitted, at one point in a few and by a little,
    which is the cap working. Where no budget is stated it answers for `unbounded` too (the
    cap is the bound then). Nothing where no cap is known."""
    if "cap" not in frame:  # samples written before caps were read
        return None
    points = quiescent(frame)
    capped = points[points["cap"] > 0]
    kept = held_at_rest(capped, frame)
    limit = Limit(t.min_bytes, t.ratio, admitted=True)
    over = limit.over(kept, capped["cap"])
    if not limit.breached(over):
        return None
    excess, hits = kept - capped["cap"], capped[over]
    return from_hits("over_cap", hits, excess, lambda at: (
        f"the cache holds {mib(kept[at])} MiB at rest against its own "
        f"{mib(frame['cap'][at])} MiB cap, at {where(frame, at)}; over it at {len(hits)} of "
        f"{len(capped)} points at rest, the last among them"))


class OverclaimThresholds(Thresholds):
    """Claimed beyond held by more than `min_bytes` and `ratio` of the claim: a real cache's
    count runs a little over what it holds where entries share buffers (mlx-lm's prompt cache
    claims up to a third more, measured), a wrong one claims what is not held at all."""

    min_bytes: Size = MiB
    ratio: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.5


def overclaimed(frame: pd.DataFrame, t: OverclaimThresholds, backend: str) -> Finding | None:
    """Overclaimed: at the last point at rest, the components' accounting has grown more since
    the baseline than MLX holds above it, so their count is not their memory: a counter that
    adds what it does not keep (vllm-mlx's streaming prefix cache counts an entry mlx-lm's
    `insert_cache` then fails to store). Judged where the run ends, as a wrong count persists
    while a server's first points at rest read low against a baseline that held its warm-up's
    buffers; from the baseline's own count, so a server that reloaded a cache before its first
    sample is not read as claiming it. `unbounded` and `over_cap` judge the bytes held
    (`held_at_rest`), so a count no memory backs never reaches a budget or a cap."""
    points = quiescent(frame)
    held_above = points["active"] - frame["active"].iloc[0]
    claimed = points["logical"] - frame["logical"].iloc[0]
    excess = claimed - held_above
    over = (excess > t.min_bytes) & (excess > t.ratio * claimed)
    if points.empty or not over.iloc[-1]:
        return None
    at = points.index[-1]
    return Finding(
        kind="overclaimed", step=int(points["step"][at]), bytes=int(excess[at]),
        count=int(over.sum()),
        message=f"the components' accounting claims {mib(frame['logical'][at])} MiB at rest "
                f"({mib(claimed[at])} MiB more than at the baseline); "
                f"{mib(max(held_above[at], 0))} MiB are held above the baseline, at "
                f"{where(frame, at)}; over at {int(over.sum())} of {len(points)} points at rest",
        steps=listed(points["step"][over]))
