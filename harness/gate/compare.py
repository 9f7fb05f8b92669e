"""Compare two sets of run summaries (base vs head) metric by metric: the regression gate.

Active-byte metrics are exact on one backend, so their tolerance is a tiny floor; the step peak
varies run to run on CPU (an MLX worker thread frees inputs asynchronously), so peak and spike get
a floor that absorbs that noise and no more; RSS includes the interpreter and the allocator cache,
so it gets a generous one. A change counts only when it exceeds both the absolute floor and the
relative threshold. Results from different backends are never compared.

A summary recorded over several runs (`kvmem noise`, `baseline update --runs N`) carries the
measured spread of peak and spike; their floor is then at least NOISE_MARGIN times that spread,
so a value measured once inside the recorded range never fails a pull request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..metrics import METRICS  # all lower-is-better
from ..summary_io import Noise, Summary
from ..units import parse_size

MiB = 1 << 20

# The spread of N runs is a lower bound of the noise's true range R, and base and head may each
# lie anywhere in R. For noise spread evenly over R, N runs span (N-1)/(N+1) of it on average:
# 2/3 for the default 5, so 1.5x the spread estimates R itself. (A rare value that no run hit
# is not covered by any margin: record with more runs.)
NOISE_MARGIN = 1.5


@dataclass(frozen=True)
class Tolerance:
    """A change counts when |delta| > abs and |delta| > rel * |base|."""

    rel: float
    abs: float
    noise: Noise | None = None  # the measured spread that set `abs`, when it did

    def exceeded(self, base: float, delta: float) -> bool:
        return abs(delta) > self.abs and abs(delta) > self.rel * abs(base)

    def widened(self, noise: Noise | None) -> Tolerance:
        """This tolerance with its floor raised to NOISE_MARGIN x the spread, where that is more."""
        if noise is None or NOISE_MARGIN * noise.spread <= self.abs:
            return self
        return replace(self, abs=NOISE_MARGIN * noise.spread, noise=noise)


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    # Under load the CPU step peak usually moves by up to ~2 MiB between identical runs; a
    # variant that moves more records its spread (harness.gate.noise), which widens this floor.
    "peak": Tolerance(rel=0.0, abs=4 * MiB),
    "largest_spike": Tolerance(rel=0.0, abs=4 * MiB),
    # Exact on one backend: the floor only absorbs float rounding in the fitted leak rate.
    "steady": Tolerance(rel=0.0, abs=256),
    "final": Tolerance(rel=0.0, abs=256),
    "retained": Tolerance(rel=0.0, abs=256),
    "leak_rate": Tolerance(rel=0.0, abs=256),
    "overhead_ratio": Tolerance(rel=0.0, abs=0.001),
    # RSS counts the interpreter, imported libraries and the MLX buffer cache.
    "rss_peak": Tolerance(rel=0.10, abs=64 * MiB),
}


class CompareError(ValueError):
    """Bad input: an unreadable or malformed summary, or a bad option. Exit status 2."""


def size(value: int | str) -> int:
    """Bytes from an int or a string such as `4 MiB`, as in scenario files.

    Whatever parse_size raises is bad input here, overflow included (`1e400 GiB`, a 400-digit
    integer): never a traceback.
    """
    try:
        return parse_size(value)
    except (ValueError, OverflowError, TypeError) as exc:
        raise CompareError(f"{value!r}: {exc}") from None


@dataclass(frozen=True)
class MetricDelta:
    metric: str
    base: float
    head: float
    tolerance: Tolerance  # as applied: widened by the measured noise where that is larger
    base_noise: Noise | None = None
    head_noise: Noise | None = None

    @property
    def delta(self) -> float:
        return self.head - self.base

    @property
    def relative(self) -> float | None:
        """delta / base, or None when base is 0."""
        return self.delta / self.base if self.base else None

    @property
    def verdict(self) -> str:
        if not self.tolerance.exceeded(self.base, self.delta):
            return "unchanged"
        return "regression" if self.delta > 0 else "improvement"


# Entry states: both sides ran and were compared, or why they were not.
COMPARED, NEW, REMOVED, FAILED, INCOMPARABLE = "compared", "new", "removed", "failed", "incomparable"


@dataclass
class Entry:
    """One scenario variant: its deltas, or the reason it could not be compared."""

    scenario: str
    variant: str
    state: str
    base: Summary | None = None
    head: Summary | None = None
    deltas: list[MetricDelta] = field(default_factory=list)
    note: str = ""

    @property
    def label(self) -> str:
        return f"{self.scenario}/{self.variant}"

    @property
    def changed(self) -> list[MetricDelta]:
        return [d for d in self.deltas if d.verdict != "unchanged"]

    @property
    def verdict(self) -> str:
        # A head run that fails where the base ran is a regression: the change broke the run.
        if self.state == FAILED and self.base is not None and self.base.ok:
            return "regression"
        verdicts = {d.verdict for d in self.deltas}
        for verdict in ("regression", "improvement"):
            if verdict in verdicts:
                return verdict
        return "unchanged"


@dataclass
class Comparison:
    entries: list[Entry]
    notes: list[str]

    def having(self, state: str) -> list[Entry]:
        return [e for e in self.entries if e.state == state]

    @property
    def regressions(self) -> list[Entry]:
        return [e for e in self.entries if e.verdict == "regression"]

    @property
    def improvements(self) -> list[Entry]:
        return [e for e in self.entries if e.verdict == "improvement"]

    @property
    def verdict(self) -> str:
        if self.regressions:
            return "regression"
        if self.improvements:
            return "improvement"
        if any(e.state != COMPARED for e in self.entries) or self.notes:
            return "changed"
        return "no change"

    @property
    def exit_code(self) -> int:
        return 1 if self.regressions else 0


def tolerances(head: Summary, rel: dict[str, float] | None = None,
               abs_: dict[str, float] | None = None) -> dict[str, Tolerance]:
    """Defaults, then the head scenario's `expect.compare`, then command-line flags."""
    result = dict(DEFAULT_TOLERANCES)
    spec = head.data.get("compare") or {}
    if not isinstance(spec, dict):
        raise CompareError(f"{head.path}: compare: expected an object of metric tolerances")
    for name, metric_spec in spec.items():
        if name not in result or not isinstance(metric_spec, dict):
            raise CompareError(f"{head.path}: compare.{name}: expected a metric among "
                               f"{', '.join(METRICS)} with {{rel, abs}}")
        try:
            result[name] = _scenario_tolerance(result[name], metric_spec)
        except CompareError as exc:
            raise CompareError(f"{head.path}: compare.{name}: {exc}") from None
    for name, value in (rel or {}).items():
        result[name] = replace(result[name], rel=value)
    for name, value in (abs_ or {}).items():
        result[name] = replace(result[name], abs=value)
    return result


def _scenario_tolerance(current: Tolerance, spec: dict) -> Tolerance:
    spec_rel, spec_abs = spec.get("rel"), spec.get("abs")
    return Tolerance(rel=current.rel if spec_rel is None else fraction(spec_rel),
                     abs=current.abs if spec_abs is None else size(spec_abs))


def _failure(summary: Summary) -> str:
    """`failed: <first line of the error>`; the error may carry a traceback."""
    error = summary.data.get("error") or f"exit status {summary.data.get('exit_status')}"
    return f"{summary.data['status']}: {error.splitlines()[0]}"


def _versions(summary: Summary) -> tuple[str, str]:
    env = summary.environment
    return env.get("mlx", "?"), env.get("mlx_lm", "?")


def _pair(base: Summary, head: Summary, rel: dict, abs_: dict) -> Entry:
    entry = Entry(*head.key, COMPARED, base, head)
    if base.backend != head.backend:
        entry.state = INCOMPARABLE
        entry.note = f"backend {base.backend} vs {head.backend}: not compared"
        return entry
    if not head.ok or not base.ok:
        entry.state = FAILED
        entry.note = "; ".join(f"{side} {_failure(s)}" for side, s in (("base", base), ("head", head))
                               if not s.ok)
        return entry
    limits = tolerances(head, rel=rel, abs_=abs_)
    for name in METRICS:
        b, h = base.metric(name), head.metric(name)
        if b is not None and h is not None:
            noise = base.noise(name), head.noise(name)
            widest = max((n for n in noise if n), key=lambda n: n.spread, default=None)
            entry.deltas.append(MetricDelta(name, b, h, limits[name].widened(widest), *noise))
    if _versions(base) != _versions(head):
        entry.note = "mlx/mlx-lm {} vs {}".format(*("/".join(_versions(s)) for s in (base, head)))
    return entry


def _index(summaries: list[Summary]) -> dict[tuple[str, str, str], Summary]:
    index: dict[tuple[str, str, str], Summary] = {}
    for s in summaries:
        key = (*s.key, s.backend)
        if key in index:
            raise CompareError(f"two summaries for {s.label} on backend {s.backend}: "
                               f"{index[key].path} and {s.path}")
        index[key] = s
    return index


def compare(base: list[Summary], head: list[Summary], rel: dict[str, float] | None = None,
            abs_: dict[str, float] | None = None) -> Comparison:
    """Match summaries by (scenario, variant, backend) and compare each pair metric by metric.

    A head summary whose variant exists in the base only on another backend becomes an
    `incomparable` entry; base summaries on other backends for a variant that was compared are
    left out with a note.
    """
    rel, abs_ = rel or {}, abs_ or {}
    base_index, head_index = _index(base), _index(head)
    entries: dict[tuple[str, str], Entry] = {}
    for key, h in head_index.items():
        if key in base_index:
            entries[key[:2]] = _pair(base_index.pop(key), h, rel, abs_)
    skipped = 0
    for key, h in head_index.items():
        if key[:2] in entries:
            continue
        other = next((k for k in base_index if k[:2] == key[:2]), None)
        if other is not None:
            entries[key[:2]] = _pair(base_index.pop(other), h, rel, abs_)
        else:
            state = NEW if h.ok else FAILED
            note = "" if h.ok else f"head {_failure(h)}"
            entries[key[:2]] = Entry(*h.key, state, None, h, note=note)
    for key, b in base_index.items():
        if key[:2] in entries:
            skipped += 1
        else:
            entries[key[:2]] = Entry(*b.key, REMOVED, b, None)
    notes = _environment_notes(base, head)
    if skipped:
        notes.append(f"{skipped} base summaries on other backends left out")
    return Comparison(sorted(entries.values(), key=lambda e: (e.scenario, e.variant)), notes)


def _environment_notes(base: list[Summary], head: list[Summary]) -> list[str]:
    notes = []
    if not base:
        notes.append("the base has no summaries: every variant is new")
    backends = [sorted({s.backend for s in side}) for side in (base, head)]
    if base and head and backends[0] != backends[1]:
        notes.append("backends differ (base {}, head {}): results across backends are not "
                     "compared".format(*(", ".join(b) for b in backends)))
    versions = [sorted({"/".join(_versions(s)) for s in side}) for side in (base, head)]
    if base and head and versions[0] != versions[1]:
        notes.append("mlx/mlx-lm versions differ (base {}, head {}): deltas include MLX's own "
                     "changes".format(*(", ".join(v) for v in versions)))
    return notes


def fraction(value: str | float) -> float:
    """A relative threshold: a finite number of zero or more (`inf` would disable the gate)."""
    try:
        fraction = -1.0 if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        fraction = -1.0
    if not (math.isfinite(fraction) and fraction >= 0):
        raise CompareError(f"not a fraction: {value!r} (expected e.g. 0.05)")
    return fraction
