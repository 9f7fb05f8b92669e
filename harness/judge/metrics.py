"""The metrics a summary reports, one registry entry each: how a run computes it, its unit, how
it reads, and whether and how `kvmem compare` gates on it.

A new metric is one entry in METRICS: the run computes it from its samples (`compute`, given
`harness.expect.Samples`), the summary records it under its name in that order, and, when it
has a `gate`, compare, the renderings, the benchmark export and the history plots take it up.

Nothing here imports MLX, pandas or matplotlib: the gate reads summaries fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..common.units import format_bytes

if TYPE_CHECKING:
    from .expect import Samples

BYTES, RATIO, COUNT = "bytes", "ratio", "count"
# Step-peak metrics move run to run on CPU, so their spread is measured; active-byte metrics are
# exact and must be identical run to run.
NOISY_KIND, EXACT_KIND = "noisy", "exact"
LOWER, HIGHER = "lower", "higher"


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
    direction: str = LOWER         # which way is better

    def format(self, value: float, signed: bool = False) -> str:
        """`7.81 MiB`, `+1 MiB/req`, `1.250×` (a signed ratio: `+0.250`)."""
        if self.unit == RATIO:
            return f"{value:+.3f}" if signed else f"{value:.3f}×"
        if self.unit == COUNT:
            return f"{value:+,.0f}" if signed else f"{value:,.0f}"
        text = format_bytes(value, signed)
        return f"{text}/{self.per}" if self.per else text

    def worse(self, delta: float) -> bool:
        """Whether a change of `delta` goes the wrong way."""
        return delta > 0 if self.direction == LOWER else delta < 0


MiB = 1 << 20
_STEP_PEAK = Gate(rel=0.0, abs=4 * MiB, scales=True)  # CPU noise up to ~2 MiB under load
_EXACT_BYTES = Gate(rel=0.0, abs=256)  # absorbs float rounding in a fitted rate only


def _overhead(s: Samples) -> float | None:
    minimum = s.minimum
    return round(s.steady / minimum, 4) if minimum else None


# In the order summaries record them.
METRICS: dict[str, Metric] = {
    "baseline": Metric(lambda s: s.base),
    "peak": Metric(lambda s: int(s.frame["peak"].max()) - s.base, gate=_STEP_PEAK,
                   kind=NOISY_KIND, required=True),
    "steady": Metric(lambda s: s.steady, gate=_EXACT_BYTES, kind=EXACT_KIND, required=True),
    "final": Metric(lambda s: int(s.frame["active"].iloc[-1]) - s.base, gate=_EXACT_BYTES,
                    kind=EXACT_KIND, required=True),
    "largest_spike": Metric(lambda s: max(int(s.excess.max()), 0), gate=_STEP_PEAK,
                            kind=NOISY_KIND, required=True),
    "spike_ratio": Metric(lambda s: s.spike_ratio, unit=RATIO),
    # Unreported memory at rest, per request or turn.
    "leak_rate": Metric(lambda s: s.leak_rate, per="req", gate=_EXACT_BYTES, kind=EXACT_KIND,
                        required=True),
    # The most active memory beyond what the components report, over the steps the detectors
    # judge (a server's samples in flight are left out: there nothing reports the requests').
    "retained": Metric(lambda s: max(int((s.judged["active"] - s.base
                                          - s.judged["logical"]).max()), 0),
                       gate=_EXACT_BYTES, kind=EXACT_KIND, required=True),
    # RSS counts the interpreter, imported libraries and the MLX buffer cache.
    "rss_peak": Metric(lambda s: int(s.frame["rss"].max()), gate=Gate(rel=0.10, abs=64 * MiB),
                       required=True),
    "minimum": Metric(lambda s: s.minimum),
    "overhead_ratio": Metric(_overhead, unit=RATIO, gate=Gate(rel=0.0, abs=0.001), required=True),
    "tokens": Metric(lambda s: int(s.steady_row["tokens"]), unit=COUNT),
    "steps": Metric(lambda s: len(s.frame), unit=COUNT),
}


def gated() -> list[str]:
    """The metrics compare gates on, in summary order."""
    return [name for name, metric in METRICS.items() if metric.gate is not None]


def of_kind(kind: str) -> tuple[str, ...]:
    return tuple(name for name, metric in METRICS.items() if metric.kind == kind)


NOISY = of_kind(NOISY_KIND)
EXACT = of_kind(EXACT_KIND)
