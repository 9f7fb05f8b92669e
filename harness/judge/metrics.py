"""The metrics a summary reports, one registry entry each: how a run computes it from its
samples, its unit, how it reads, whether and how `kvmem compare` gates on it, and where else it
appears.

A new metric is one entry in METRICS. Its `compute` is given the run's `Samples`; the summary
records it under its name, in the registry's order (unless `recorded` is false: a figure only
bounded); with a `gate`, compare, the renderings, the benchmark export and the history plots
take it up; with a `budget`, a scenario bounds it under `expect:`; with a `column`, the results
table of `run` and `show` shows it; with `pytest`, the plugin's `kv_limit` bounds it.

Nothing here imports MLX, pandas or matplotlib: the gate reads summaries fast.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..agent.kvmem_sample import IN_FLIGHT
from ..common.units import KiB, MiB, format_bytes
from .frames import spike_ratios, transients
from .records import Finding

if TYPE_CHECKING:
    import pandas as pd

    from .detectors import DetectSpec

BYTES, RATIO, COUNT, SECONDS = "bytes", "ratio", "count", "seconds"
# Step-peak metrics move run to run on CPU, so their spread is measured; active-byte metrics are
# exact and must be identical run to run.
NOISY_KIND, EXACT_KIND = "noisy", "exact"
LOWER, HIGHER = "lower", "higher"


@dataclass(frozen=True)
class RunFacts:
    """What a run knows beside its samples: its wall time, the size check's estimate, and the
    weights of the real model it served (None without one)."""

    wall_s: float
    estimate: int
    weights: int | None = None


class Samples:
    """A run's samples with what several metrics share, each worked out when first asked for.
    A run that left none (it failed, or was refused) has its facts alone: `frame` is None."""

    def __init__(self, frame: pd.DataFrame | None, findings: list[Finding],
                 thresholds: DetectSpec, facts: RunFacts):
        self.frame = frame
        self.findings = findings
        self.facts = facts
        self._spike_floor: int = thresholds.spike.min_bytes
        self._host = thresholds.host_memory

    @property
    def rows(self) -> pd.DataFrame:
        assert self.frame is not None, "a metric of samples asked of a run without any"
        return self.frame

    @functools.cached_property
    def base(self) -> int:
        return int(self.rows["active"].iloc[0])

    @functools.cached_property
    def judged(self) -> pd.DataFrame:
        """The rows detectors judge: all but a server's samples in flight."""
        return self.rows[~self.rows["phase"].isin(IN_FLIGHT)]

    @functools.cached_property
    def steady_row(self) -> pd.Series:
        """The last decode step's row (the last row where nothing decodes)."""
        decode = self.rows[self.rows["phase"] == "decode"]
        return decode.iloc[-1] if not decode.empty else self.rows.iloc[-1]

    @property
    def steady(self) -> int:
        return int(self.steady_row["active"]) - self.base

    @property
    def minimum(self) -> int:
        return int(self.steady_row["minimum"])

    @functools.cached_property
    def excess(self) -> pd.Series:
        """Each step's transient above its input."""
        return transients(self.rows)

    @property
    def spike_ratio(self) -> float | None:
        """The largest spike's peak over what the step settled at, among spikes above the floor
        (1.0 without one); None where every such spike settled at the baseline (no ratio)."""
        big = self.excess > self._spike_floor
        if not big.any():
            return 1.0
        largest = spike_ratios(self.rows)[big].max()
        return None if math.isnan(largest) else round(float(largest), 4)

    @property
    def host_rate(self) -> int | None:
        """Host memory gained per point at rest, by the host_memory detector's measure; None on
        a frame no variant's run labelled with its backend (a recording's has no rest)."""
        from .at_rest import host_rate

        backend = self.rows.attrs.get("backend")
        return None if backend is None else host_rate(self.rows, self._host, backend)

    @property
    def leak_rate(self) -> int:
        leaks = [f.bytes or 0 for f in self.findings if f.kind == "leak"]
        return leaks[0] if leaks else 0


@dataclass(frozen=True)
class Gate:
    """A gated metric's default tolerance: a change counts when it exceeds both `abs` and
    `rel` x base. `scales`: the floor scales down with a small scenario's peak
    (harness.gate.compare)."""

    rel: float
    abs: float
    scales: bool = False


@dataclass(frozen=True)
class Metric:
    compute: Callable[[Samples], Any]
    unit: str = BYTES
    per: str = ""                  # `/req` after a rate's bytes
    gate: Gate | None = None       # None: reported, never compared
    kind: str | None = None        # NOISY_KIND or EXACT_KIND for gated metrics
    required: bool = False         # every completed run's summary carries it (schema 1 on)
    nullable: bool = False         # ... and may carry it as null (no analytic minimum)
    direction: str = LOWER         # which way is better
    budget: str | None = None      # the key under `expect:` that bounds it
    column: bool = False           # a column of the results table (`kvmem run`, `kvmem show`)
    pytest: bool = False           # a bound of the pytest plugin's `kv_limit`
    recorded: bool = True          # written to the summary (false: computed to be bounded)
    of_run: bool = False           # a fact of the run, known without samples; left out if None

    def format(self, value: float, signed: bool = False) -> str:
        """`7.81 MiB`, `+1 MiB/req`, `1.250×` (a signed ratio: `+0.250`), `12.5 s`."""
        if self.unit == RATIO:
            return f"{value:+.3f}" if signed else f"{value:.3f}×"
        if self.unit == COUNT:
            return f"{value:+,.0f}" if signed else f"{value:,.0f}"
        if self.unit == SECONDS:
            return f"{value:+.3g} s" if signed else f"{value:.3g} s"
        return self.suffixed(format_bytes(value, signed))

    def suffixed(self, unit: str) -> str:
        """`unit` as this metric's figures are counted in it: `MiB/req` for a rate."""
        return f"{unit}/{self.per}" if self.per else unit

    def worse(self, delta: float) -> bool:
        """Whether a change of `delta` goes the wrong way."""
        return delta > 0 if self.direction == LOWER else delta < 0


_STEP_PEAK = Gate(rel=0.0, abs=4 * MiB, scales=True)  # CPU noise up to ~2 MiB under load
_EXACT_BYTES = Gate(rel=0.0, abs=256)  # absorbs float rounding in a fitted rate only


def _overhead(s: Samples) -> float | None:
    minimum = s.minimum
    return round(s.steady / minimum, 4) if minimum else None


def _per_token(s: Samples) -> float | None:
    tokens = int(s.steady_row["tokens"])
    return s.steady / tokens if tokens else None


def _buffers_at_rest(s: Samples) -> pd.Series:
    """Live MLX buffers at each point at rest where they were counted (-1: not measured)."""
    points = s.rows[s.rows["phase"] == "idle"]
    return points["buffers"][points["buffers"] >= 0] if "buffers" in points else points["step"][:0]


def _buffers(s: Samples) -> int | None:
    """Live buffers at the last point at rest above the baseline's; None where either was not
    counted."""
    counted = _buffers_at_rest(s)
    if counted.empty or counted.index[0] != s.rows.index[0]:
        return None
    return int(counted.iloc[-1] - counted.iloc[0])


def _most_buffers(s: Samples) -> int | None:
    """The most live buffers at a point at rest, the figure `expect.buffers` bounds."""
    counted = _buffers_at_rest(s)
    return None if counted.empty else int(counted.max())


def _retained(s: Samples) -> int:
    beyond = s.judged["active"] - s.base - s.judged["logical"]
    return max(int(beyond.max()), 0) if len(beyond) else 0


# In the order summaries record them.
METRICS: dict[str, Metric] = {
    "baseline": Metric(lambda s: s.base),
    "peak": Metric(lambda s: int(s.rows["peak"].max()) - s.base, gate=_STEP_PEAK,
                   kind=NOISY_KIND, required=True, budget="peak", column=True, pytest=True),
    "steady": Metric(lambda s: s.steady, gate=_EXACT_BYTES, kind=EXACT_KIND, required=True,
                     budget="steady", column=True),
    "final": Metric(lambda s: int(s.rows["active"].iloc[-1]) - s.base, gate=_EXACT_BYTES,
                    kind=EXACT_KIND, required=True, budget="final", pytest=True),
    # The steady bytes per token held, bounded by `expect.per_token`; not recorded.
    "per_token": Metric(_per_token, per="token", budget="per_token", recorded=False),
    "largest_spike": Metric(lambda s: max(int(s.excess.max()), 0), gate=_STEP_PEAK,
                            kind=NOISY_KIND, required=True),
    "spike_ratio": Metric(lambda s: s.spike_ratio, unit=RATIO),
    # Unreported memory at rest, per request or turn.
    "leak_rate": Metric(lambda s: s.leak_rate, per="req", gate=_EXACT_BYTES, kind=EXACT_KIND,
                        required=True, pytest=True),
    # The most active memory beyond what the components report, over the steps the detectors
    # judge (a server's samples in flight are left out: there nothing reports the requests'; a
    # recorded process, all in flight, has none).
    "retained": Metric(_retained,
                       gate=_EXACT_BYTES, kind=EXACT_KIND, required=True),
    # Live MLX buffers: a backend caps them (Metal: 499,000), whatever their bytes.
    "buffers": Metric(_buffers, unit=COUNT, gate=Gate(rel=0.0, abs=0), kind=EXACT_KIND,
                      nullable=True),
    # The most live buffers at rest, bounded by `expect.buffers`; not recorded.
    "most_buffers": Metric(_most_buffers, unit=COUNT, recorded=False),
    # RSS counts the interpreter, imported libraries and the MLX buffer cache: judged against
    # the base's own RSS above a floor of measured noise (harness.gate.tolerance).
    "rss_peak": Metric(lambda s: int(s.rows["rss"].max()), gate=Gate(rel=0.15, abs=8 * MiB),
                       required=True),
    # Process memory outside MLX that at least half of the points at rest add (host_memory's
    # measure): a host copy kept per request counts from 256 KiB a request.
    "host_rate": Metric(lambda s: s.host_rate, per="req", gate=Gate(rel=0.0, abs=256 * KiB),
                        nullable=True),
    "minimum": Metric(lambda s: s.minimum),
    "overhead_ratio": Metric(_overhead, unit=RATIO, gate=Gate(rel=0.0, abs=0.001), required=True,
                             nullable=True, budget="overhead"),
    "tokens": Metric(lambda s: int(s.steady_row["tokens"]), unit=COUNT),
    "steps": Metric(lambda s: len(s.rows), unit=COUNT),
    "wall_s": Metric(lambda s: round(s.facts.wall_s, 3), unit=SECONDS, of_run=True),
    "estimate": Metric(lambda s: s.facts.estimate, of_run=True),
    "weights": Metric(lambda s: s.facts.weights, of_run=True),  # a real model's
}


def figures(samples: Samples) -> dict[str, Any]:
    """Every metric the run gives, in the registry's order: with samples all of them, without
    (a run that failed) the facts of the run alone; a fact it lacks is left out."""
    values: dict[str, Any] = {}
    for name, metric in METRICS.items():
        if metric.of_run:
            value = metric.compute(samples)
            if value is not None:
                values[name] = value
        elif samples.frame is not None:
            values[name] = metric.compute(samples)
    return values


def recorded(values: dict[str, Any]) -> dict[str, Any]:
    """The figures a summary records: those of recorded metrics (unknown names kept)."""
    return {name: value for name, value in values.items()
            if name not in METRICS or METRICS[name].recorded}


def gated() -> list[str]:
    """The metrics compare gates on, in summary order."""
    return [name for name, metric in METRICS.items() if metric.gate is not None]


def noisy() -> list[str]:
    """The step-peak metrics: their run-to-run spread is measured and widens their tolerance."""
    return [name for name, metric in METRICS.items() if metric.kind == NOISY_KIND]


def exact() -> list[str]:
    """The active-byte metrics, identical run to run on one backend."""
    return [name for name, metric in METRICS.items() if metric.kind == EXACT_KIND]
