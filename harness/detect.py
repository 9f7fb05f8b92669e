"""Detectors: functions from samples to findings, plus the metrics and expectation checks.

All byte figures are taken above the run's baseline, the first sample, taken after the synthetic
K/V pools are drawn and before anything is cached. Active bytes are exact on a given backend, so
detectors on active memory use small floors; the step peak is noisy (an allocator thread frees
inputs asynchronously), so the spike detector needs a floor of a few MiB.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from .scenario import (
    DetectSpec,
    ExpectSpec,
    GrowthThresholds,
    HostThresholds,
    LeakThresholds,
    RetainedThresholds,
    SpikeBound,
    SpikeThresholds,
)

MAX_STEPS_LISTED = 20


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


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


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


def spike(frame: pd.DataFrame, t: SpikeThresholds) -> list[Finding]:
    """Transient spike: a step whose peak rises above both the memory before and after it.

    A concatenation that builds a new buffer while the old one is alive is the typical cause.
    Flagged when the excess passes `min_bytes` (above peak noise) and the ratio `min_ratio`.
    """
    excess = transients(frame)
    hits = frame[(excess > t.min_bytes) & (spike_ratios(frame) >= t.min_ratio)]
    if hits.empty:
        return []
    worst = excess[hits.index].idxmax()
    ratio = spike_ratios(frame)[worst]
    return [Finding(
        "spike", int(frame["step"][worst]), int(excess[worst]), len(hits),
        f"{len(hits)} transient spike(s); largest +{_mib(excess[worst])} above the settled "
        f"memory ({ratio:.2f}x) at step {frame['step'][worst]} ({frame['phase'][worst]})",
        hits["step"].head(MAX_STEPS_LISTED).tolist())]


def growth(frame: pd.DataFrame, t: GrowthThresholds) -> list[Finding]:
    """Growth step: active memory rising by more than the tokens of that step explain.

    Compared between consecutive token steps on one live sequence; the first step of a sequence
    is its allocation and is not counted. A cache growing in blocks, or logits kept per step,
    shows here.
    """
    previous = frame.shift(1)
    eligible = frame["phase"].isin(["prefill", "decode"]) & (previous["tokens"] > 0)
    explained = (frame["minimum"] - previous["minimum"]).clip(lower=0)
    excess = frame["active"] - previous["active"] - explained
    hits = frame[eligible & (excess > t.min_bytes)]
    if hits.empty:
        return []
    worst = excess[hits.index].idxmax()
    return [Finding(
        "growth", int(frame["step"][worst]), int(excess[worst]), len(hits),
        f"{len(hits)} step(s) grew active memory beyond their tokens; largest "
        f"+{_mib(excess[worst])} at step {frame['step'][worst]} ({frame['phase'][worst]})",
        hits["step"].head(MAX_STEPS_LISTED).tolist())]


def quiescent(frame: pd.DataFrame) -> pd.DataFrame:
    """Samples taken with nothing in flight: after each request, or each chat turn."""
    idle = frame[frame["phase"] == "idle"]
    return idle.iloc[1:]  # the first is the baseline


def leak(frame: pd.DataFrame, t: LeakThresholds) -> list[Finding]:
    """Leak: active memory at quiescent points keeps rising past the warm-up.

    Either every delta is positive, or a line fits with r² of at least `r2`, and the rise per
    request (or turn) is at least `min_bytes`. Reports the bytes per request.
    """
    points = quiescent(frame).iloc[t.warmup:]
    if len(points) < 3:
        return []
    active = points["active"].to_numpy(dtype=float)
    deltas = np.diff(active)
    x = np.arange(len(active), dtype=float)
    slope, intercept = np.polyfit(x, active, 1)
    fitted = slope * x + intercept
    total = ((active - active.mean()) ** 2).sum()
    r2 = 1.0 - ((active - fitted) ** 2).sum() / total if total else 0.0
    rate = float(np.median(deltas)) if (deltas > 0).all() else slope
    if rate < t.min_bytes or not ((deltas > 0).all() or r2 >= t.r2):
        return []
    unit = "turn" if (points["turn"] >= 0).any() else "request"
    return [Finding(
        "leak", int(points["step"].iloc[-1]), int(round(rate)), len(deltas),
        f"memory at rest grows {rate:,.0f} B per {unit} over {len(deltas)} {unit}s "
        f"after a warm-up of {t.warmup} (fit r²={r2:.3f})",
        points["step"].head(MAX_STEPS_LISTED).tolist())]


def retained(frame: pd.DataFrame, t: RetainedThresholds) -> list[Finding]:
    """Retained buffer: the allocator holds more than the components say they hold.

    A slice that keeps a whole pre-allocated buffer alive reports the slice's bytes while the
    buffer stays allocated. Flagged when active − baseline − logical passes both `min_bytes`
    and `ratio` × logical.
    """
    excess = frame["active"] - frame["active"].iloc[0] - frame["logical"]
    bound = np.maximum(t.min_bytes, t.ratio * frame["logical"])
    hits = frame[excess > bound]
    if hits.empty:
        return []
    worst = excess[hits.index].idxmax()
    return [Finding(
        "retained", int(frame["step"][worst]), int(excess[worst]), len(hits),
        f"allocator holds {_mib(excess[worst])} beyond the {_mib(frame['logical'][worst])} the "
        f"components report, at step {frame['step'][worst]} ({frame['phase'][worst]})",
        hits["step"].head(MAX_STEPS_LISTED).tolist())]


def host_memory(frame: pd.DataFrame, t: HostThresholds, backend: str) -> list[Finding]:
    """Host memory: process RSS grows while MLX active memory does not.

    Raw bytes held outside MLX never reach MLX's counters. On the CPU backend MLX buffers live
    in RSS too, so active and cached bytes are taken out first. Measured from the baseline to
    each quiescent point.
    """
    def other(rows: pd.DataFrame) -> pd.Series:
        if backend == "cpu":
            return rows["rss"] - rows["active"] - rows["cache"]
        return rows["rss"]

    points = quiescent(frame)
    if points.empty:
        return []
    base = frame.iloc[:1]
    rise = other(points) - other(base).iloc[0]
    active_rise = points["active"] - base["active"].iloc[0]
    hits = points[(rise > t.min_bytes) & (rise > active_rise)]
    if hits.empty:
        return []
    worst = rise[hits.index].idxmax()
    return [Finding(
        "host_memory", int(frame["step"][worst]), int(rise[worst]), len(hits),
        f"process memory outside MLX grew {_mib(rise[worst])} while MLX active grew "
        f"{_mib(active_rise[worst])} (at step {frame['step'][worst]})",
        hits["step"].head(MAX_STEPS_LISTED).tolist())]


def detect(frame: pd.DataFrame, thresholds: DetectSpec, backend: str) -> list[Finding]:
    """Every detector over one run's samples."""
    return [
        *spike(frame, thresholds.spike),
        *growth(frame, thresholds.growth),
        *leak(frame, thresholds.leak),
        *retained(frame, thresholds.retained),
        *host_memory(frame, thresholds.host_memory, backend),
    ]


def metrics(frame: pd.DataFrame, findings: list[Finding], thresholds: DetectSpec) -> dict:
    """Summary figures, in bytes above the baseline unless named otherwise."""
    base = int(frame["active"].iloc[0])
    decode = frame[frame["phase"] == "decode"]
    steady_row = decode.iloc[-1] if not decode.empty else frame.iloc[-1]
    steady = int(steady_row["active"]) - base
    minimum = int(steady_row["minimum"])
    excess = transients(frame)
    big = excess > thresholds.spike.min_bytes
    leaks = [f.bytes for f in findings if f.kind == "leak"]
    return {
        "baseline": base,
        "peak": int(frame["peak"].max()) - base,
        "steady": steady,
        "final": int(frame["active"].iloc[-1]) - base,
        "largest_spike": max(int(excess.max()), 0),
        "spike_ratio": round(float(spike_ratios(frame)[big].max()), 4) if big.any() else 1.0,
        "leak_rate": leaks[0] if leaks else 0,
        "retained": max(int((frame["active"] - base - frame["logical"]).max()), 0),
        "rss_peak": int(frame["rss"].max()),
        "minimum": minimum,
        "overhead_ratio": round(steady / minimum, 4) if minimum else None,
        "tokens": int(steady_row["tokens"]),
        "steps": int(len(frame)),
    }


def _presence(name: str, expected: str, findings: list[Finding]) -> dict:
    found = [f for f in findings if f.kind == name]
    actual = "detected" if found else "none"
    message = found[0].message if found else f"no {name} finding"
    return {"name": name, "expected": expected, "actual": actual,
            "ok": actual == expected, "message": message}


def _bound(name: str, actual: float | None, limit: float, unit: str = "B") -> dict:
    ok = actual is not None and actual <= limit
    shown = "n/a" if actual is None else (f"{actual:,.0f} B" if unit == "B" else f"{actual:.3f}")
    limit_shown = f"{limit:,.0f} B" if unit == "B" else f"{limit:.3f}"
    return {"name": name, "expected": f"<= {limit_shown}", "actual": shown, "ok": ok,
            "message": f"{name} {shown} {'within' if ok else 'exceeds'} {limit_shown}"}


def check(expect: ExpectSpec, findings: list[Finding], figures: dict) -> list[dict]:
    """Each expectation of the scenario against the findings and metrics."""
    results = []
    for name in ("leak", "retained", "host_memory", "growth"):
        expected = getattr(expect, name)
        if expected is not None:
            results.append(_presence(name, expected, findings))
    if isinstance(expect.spike, SpikeBound):
        results.append(_bound("spike_ratio", figures["spike_ratio"], expect.spike.max_ratio, "x"))
    elif expect.spike is not None:
        results.append(_presence("spike", expect.spike, findings))
    for name in ("peak", "steady", "final"):
        limit = getattr(expect, name)
        if limit is not None:
            results.append(_bound(name, figures[name], limit))
    if expect.per_token is not None:
        per_token = figures["steady"] / figures["tokens"] if figures["tokens"] else None
        results.append(_bound("per_token", per_token, expect.per_token))
    if expect.overhead is not None:
        results.append(_bound("overhead", figures["overhead_ratio"], expect.overhead, "x"))
    return results
