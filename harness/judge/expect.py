"""Expectations: a run's summary metrics, and the scenario's `expect:` checked against them.

Findings are facts; expectations decide pass or fail. Each registered detector's presence is
checked when the scenario states it or its registry entry expects one (see detect.DETECTORS);
spike's expectation may instead bound the spike_ratio metric. Budgets bound metrics in bytes
(peak, steady, final, per_token) or as a ratio (overhead).
"""

from __future__ import annotations

import pandas as pd

from ..scenario import DetectSpec, ExpectSpec, SpikeBound
from .detectors import DETECTORS, IN_FLIGHT, Finding, Presence, spike_ratios, transients
from .metrics import METRICS


class Samples:
    """A completed run's samples, with what several metrics share (harness.metrics.METRICS)."""

    def __init__(self, frame: pd.DataFrame, findings: list[Finding], thresholds: DetectSpec):
        self.frame: pd.DataFrame = frame
        self.findings: list[Finding] = findings
        self.base: int = int(frame["active"].iloc[0])
        # The rows detectors judge: all but a server's samples in flight.
        self.judged: pd.DataFrame = frame[~frame["phase"].isin(IN_FLIGHT)]
        decode = frame[frame["phase"] == "decode"]
        self.steady_row: pd.Series = decode.iloc[-1] if not decode.empty else frame.iloc[-1]
        self.steady: int = int(self.steady_row["active"]) - self.base
        self.minimum: int = int(self.steady_row["minimum"])
        self.excess: pd.Series = transients(frame)  # each step's transient above its input
        self._spike_floor: int = thresholds.spike.min_bytes

    @property
    def spike_ratio(self) -> float:
        """The largest spike's peak over what the step settled at, among spikes above the floor."""
        big = self.excess > self._spike_floor
        return round(float(spike_ratios(self.frame)[big].max()), 4) if big.any() else 1.0

    @property
    def leak_rate(self) -> int:
        leaks = [f.bytes for f in self.findings if f.kind == "leak"]
        return leaks[0] if leaks else 0


def metrics(frame: pd.DataFrame, findings: list[Finding], thresholds: DetectSpec) -> dict:
    """Summary figures, in bytes above the baseline unless named otherwise: every registered
    metric, in the registry's order."""
    samples = Samples(frame, findings, thresholds)
    return {name: metric.compute(samples) for name, metric in METRICS.items()}


def _presence(name: str, expected: Presence, findings: list[Finding], stated: bool = True) -> dict:
    """A presence expectation; one the scenario did not state (the registry's default) is not
    failed by a warning."""
    found = [f for f in findings if f.kind == name and (stated or f.severity == "error")]
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


def _presences(expect: ExpectSpec, findings: list[Finding]) -> list[dict]:
    """The stated presences: first those the registry expects absent unless a scenario says
    otherwise, then those checked only when stated; spike's comes after them (`_spike`)."""
    detectors = sorted(DETECTORS.items(), key=lambda item: item[1].expected is None)
    stated = ((name, getattr(expect, name)) for name, _ in detectors if name != "spike")
    return [_presence(name, expected, findings, name in expect.model_fields_set)
            for name, expected in stated if expected is not None]


def _spike(expected: Presence | SpikeBound | None, findings: list[Finding],
           figures: dict) -> list[dict]:
    """Spike's expectation: a presence, or `{max_ratio: X}`, a bound on the spike_ratio metric
    (a growing cache spikes by design; the scenario says how large a spike it accepts)."""
    if isinstance(expected, SpikeBound):
        return [_bound("spike_ratio", figures["spike_ratio"], expected.max_ratio, "x")]
    return [] if expected is None else [_presence("spike", expected, findings)]


def _budgets(expect: ExpectSpec, figures: dict) -> list[dict]:
    results = [_bound(name, figures[name], getattr(expect, name))
               for name in ("peak", "steady", "final") if getattr(expect, name) is not None]
    if expect.per_token is not None:
        per_token = figures["steady"] / figures["tokens"] if figures["tokens"] else None
        results.append(_bound("per_token", per_token, expect.per_token))
    if expect.overhead is not None:
        results.append(_bound("overhead", figures["overhead_ratio"], expect.overhead, "x"))
    return results


def check(expect: ExpectSpec, findings: list[Finding], figures: dict) -> list[dict]:
    """Each expectation of the scenario against the findings and metrics: presences, spike,
    budgets, the order summaries (and the baselines kept from them) have always had."""
    return [*_presences(expect, findings), *_spike(expect.spike, findings, figures),
            *_budgets(expect, figures)]
