"""Detectors of memory at rest (the idle sample after each request or turn): leak, unbounded
growth or memory over its budget, a plateau, retained buffers, host memory, cycle garbage, the
buffer pool, a cache over its own cap, and accounting that claims more than is held (formulas:
harness.judge.detectors)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from ..agent.kvmem_agent import IN_FLIGHT
from ..common.units import Size, mib
from .frames import point_name, quiescent, unexplained, where
from .records import Finding, Severity, from_hits, listed
from .thresholds import MAX_WARMUP, Thresholds, TrendThresholds
from .trend import Trend, held, in_step, rising

if TYPE_CHECKING:
    import pandas as pd


class LeakThresholds(TrendThresholds):
    min_bytes: Size = 64 * 2**10


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
        message=f"{head} {rate:,.0f} B per {unit}{_since(trend, points, unit)} over "
                f"{trend.deltas} {unit}s{middle} (fit r²={trend.r2:.3f}){tail}",
        steps=listed(points["step"].iloc[trend.start:]),
        severity=severity)


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


class UnboundedThresholds(TrendThresholds):
    budget: Size | None = None
    min_bytes: Size = 64 * 2**10


def unbounded(frame: pd.DataFrame, t: UnboundedThresholds, backend: str) -> Finding | None:
    """Unbounded: the bytes the components report at rest end over a budget, whether they grew
    there, held flat there or started there; or, with no budget, they keep rising with no
    plateau.

    Honest growth: the store says what it holds, it just never stops holding more. The budget
    is the scenario's, else the cache's own cap where the agent read one. Past it that is an
    error, however the reported bytes got there (past the cap, `over_cap` says it better and
    supersedes this); within it, nothing; with neither, growth is a warning (nothing says how
    much is too much, but nothing says it stops either).
    """
    points = quiescent(frame).iloc[t.warmup:]
    budget = t.budget if t.budget is not None else _own_cap(points)
    trend = rising(points["logical"], t.min_bytes, t.r2, t.hold)
    if points.empty or (budget is None and trend is None):
        return None
    unit, reported = point_name(points), points["logical"].iloc[-1]
    if budget is not None and reported <= budget:
        return None
    if budget is not None and trend is None:
        return _over_budget(points, budget, unit)
    over = (f"over the budget of {mib(budget)} MiB" if budget is not None else
            "with no budget stated (detect.unbounded.budget)")
    assert trend is not None
    return _trending("unbounded", points, trend, trend.rate,
                     f"components report {mib(reported)} MiB at rest, {over}, growing",
                     middle=" with no plateau",
                     severity="error" if budget is not None else "warning")


def _own_cap(points: pd.DataFrame) -> int | None:
    """The cap the components allowed themselves at the last point at rest, where one is known."""
    cap = int(points["cap"].iloc[-1]) if "cap" in points and not points.empty else 0
    return cap or None


def _over_budget(points: pd.DataFrame, budget: int, unit: str) -> Finding:
    """Reported bytes at rest over the budget without rising: held there since the first point
    over it (the first point at rest, for a server restarted onto a cache it reloaded)."""
    over = points[points["logical"] > budget]
    first = over.iloc[0]
    since = ("from the first point at rest" if first.name == points.index[0]
             else f"since {unit} {first['turn' if unit == 'turn' else 'request']}")
    reported = points["logical"].iloc[-1]
    return Finding(
        kind="unbounded", step=int(points["step"].iloc[-1]), bytes=int(reported - budget),
        count=len(over),
        message=f"components report {mib(reported)} MiB at rest, over the budget of "
                f"{mib(budget)} MiB {since}, not rising: over it at {len(over)} of "
                f"{len(points)} points at rest",
        steps=listed(over["step"]))


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
        steps=listed(points["step"].iloc[first:]))


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
        steps=listed(points["step"]))


class HostThresholds(TrendThresholds):
    """`min_bytes`: a rise from the baseline flagged at once; `min_rate`: what at least half of
    the requests of a sustained rise add each, `min_trend_bytes` what they add in all. RSS is
    noisy (allocator arenas, Python's own objects, pages), hence a high floor for one rise; a
    rise that comes back request after request is a trend that noise does not make."""

    min_bytes: Size = 32 * 2**20
    min_rate: Size = 256 * 2**10
    min_trend_bytes: Size = 8 * 2**20


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
    # Elsewhere RSS may hold MLX's own buffers (unified memory): only what it gained beyond them.
    return _host_trend(points, rise if backend == "cpu" else rise - active_rise, t)


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


class OverCapThresholds(Thresholds):
    """Over by more than `min_bytes` and `ratio` of the cap."""

    min_bytes: Size = 64 * 2**10
    ratio: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.05


def over_cap(frame: pd.DataFrame, t: OverCapThresholds, backend: str) -> Finding | None:
    """Over its own cap: at rest, the components hold more than the bytes they allow
    themselves, a limit the agent reads from a server (`server.cap`: mlx_lm.server's
    `--prompt-cache-bytes`), so the cap is a budget no scenario restates. mlx-lm #1807 (a
    hybrid model's cache grows past it) and PR #1409 (the cap ignored with `--kv-bits`) are
    this. Over where the run ends and at most points at rest since it first went over: a cap
    enforced when the next request is admitted (mlx-lm's) leaves the entry a request stores
    over it until then, at one point in a few, which is the cap working. Nothing where no cap
    is known."""
    if "cap" not in frame:  # samples written before caps were read
        return None
    points = quiescent(frame)
    capped = points[points["cap"] > 0]
    excess = capped["logical"] - capped["cap"]
    over = (excess > t.min_bytes) & (excess > t.ratio * capped["cap"])
    if not over.any() or not over.iloc[-1] or over[over.idxmax():].mean() <= 0.5:
        return None
    hits = capped[over]
    return from_hits("over_cap", hits, excess, lambda at: (
        f"the cache holds {mib(frame['logical'][at])} MiB at rest against its own "
        f"{mib(frame['cap'][at])} MiB cap, at {where(frame, at)}; over it at {len(hits)} of "
        f"{len(capped)} points at rest, the last among them"))


class OverclaimThresholds(Thresholds):
    """Claimed beyond held by more than `min_bytes` and `ratio` of the claim: a real cache's
    count runs a little over what it holds where entries share buffers (mlx-lm's prompt cache
    claims up to a third more, measured), a wrong one claims what is not held at all."""

    min_bytes: Size = 2**20
    ratio: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.5


def overclaimed(frame: pd.DataFrame, t: OverclaimThresholds, backend: str) -> Finding | None:
    """Overclaimed: at the last point at rest, the components' accounting has grown more since
    the baseline than MLX holds above it, so their count is not their memory: a counter that
    adds what it does not keep (vllm-mlx's streaming prefix cache counts an entry mlx-lm's
    `insert_cache` then fails to store). Judged where the run ends, as a wrong count persists
    while a server's first points at rest read low against a baseline that held its warm-up's
    buffers; from the baseline's own count, so a server that reloaded a cache before its first
    sample is not read as claiming it. `unbounded` and `over_cap`, which read that count, give
    way to it (its registry entry supersedes them)."""
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
