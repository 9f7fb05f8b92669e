"""Compare two sets of run summaries (base vs head) metric by metric: the regression gate.

Active-byte metrics are exact on one backend, so their tolerance is a tiny floor; the step peak
varies run to run on CPU (an MLX worker thread frees inputs asynchronously), so peak and spike get
a floor that absorbs that noise and no more; RSS includes the interpreter and the allocator cache,
so it gets a generous one. A change counts only when it exceeds both the absolute floor and the
relative threshold. Results from different backends are never compared.

Whose tolerances. A pull request must not loosen the gate that judges it: the tolerances are
the BASE's (the `compare` block its summaries carry, i.e. the scenario's `expect.compare` as
recorded on the base commit or in the baseline), then the command line's flags. When the head's
`compare` block or its expectations differ from the base's, the entry lists what differs
(`Entry.policy`) and every rendering says so in its first lines.

Small scenarios. The 4 MiB floor of peak and spike is sized for the CPU noise of large
scenarios (up to ~2 MiB on hundreds of MiB), but on a 1.5 MiB scenario it hides a +3 MiB,
+199% change. That noise is a step's buffers freed late (a step input still alive when the next
step allocates), so it scales with what the scenario's steps allocate, never with a fixed
size. So the default floor of peak and spike scales with the scenario, its base peak P:

    floor = min(4 MiB, max(SMALL_LEAST, SMALL_FRACTION x P))        (256 KiB, 1/2)

- P >= 8 MiB: the 4 MiB it always was; large scenarios are judged exactly as before.
- 512 KiB < P < 8 MiB: P / 2. Doubling the scenario (+P) always counts. Noise stays under it:
  8 runs of each, two suites at once on 2 shared cores (load average 5), moved the peak by
  129 KiB on gate_trim (P 1.19-1.31 MiB: 11%), 253 KiB on a 2-layer cache (P 2.25-2.5 MiB:
  11%), 1.88 MiB on a 4-layer one (P 8.13-10 MiB: 23%), 0 B on import_path_leak (P 1.5 MiB):
  at most a quarter of P, half the floor. A late-freed step input is at most what the
  cache receiving it holds, so noise reaches P / 2 only where one step is half the scenario's
  memory (one prefill chunk into an empty cache): such a scenario records its spread
  (`baseline update --runs 5`), and a measured spread is never scaled down (below).
- P <= 512 KiB: SMALL_LEAST, so a few KiB of allocator rounding never fails; only a scenario
  under 256 KiB can double unseen.

The spike's floor scales with the scenario's peak too, not with the spike itself (its noise is
the peak's): a 16 KiB spike on a 432 MiB scenario keeps the 4 MiB floor. A floor that the
scenario (`expect.compare`) or the command line (`--abs`) sets is used as written.

Measured noise. A summary recorded over several runs (`kvmem noise`, `baseline update --runs
N`) carries the measured spread of peak and spike; their floor is then at least NOISE_MARGIN
times the larger spread of base and head, after the scaling above (a measured spread is never
scaled down), so a value measured once inside the recorded range never fails a pull request.

A metric that was near zero in the base (below the floor it was judged with) and grew has no
meaningful percentage (16 KiB -> 39.9 MiB is +255,000%): the renderings say "new" and show
the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..common.echo import clip, echo
from ..common.units import format_bytes, parse_size
from ..judge.metrics import BYTES, METRICS, gated
from ..judge.summary import Noise, Recorded, Summary

Key = tuple[str, str, str]  # scenario, variant, backend

KiB, MiB = 1 << 10, 1 << 20

# The spread of N runs is a lower bound of the noise's true range R, and base and head may each
# lie anywhere in R. For noise spread evenly over R, N runs span (N-1)/(N+1) of it on average:
# 2/3 for the default 5, so 1.5x the spread estimates R itself. (A rare value that no run hit
# is not covered by any margin: record with more runs.)
NOISE_MARGIN = 1.5
# The default floors of peak and spike scale down to this fraction of a small scenario's base
# peak, and no lower than SMALL_LEAST (see the module's docstring).
SMALL_FRACTION = 0.5
SMALL_LEAST = 256 * KiB


@dataclass(frozen=True)
class Tolerance:
    """A change counts when |delta| > abs and |delta| > rel * |base|.

    `least` is set on the default floors that scale with a small scenario (the lowest they go);
    `size` and `noise` say what set `abs` when it is not the configured floor: the base peak
    that scaled it down, or the measured spread that widened it.
    """

    rel: float
    abs: float
    noise: Noise | None = None
    least: float | None = None
    size: float | None = None

    def exceeded(self, base: float, delta: float) -> bool:
        return abs(delta) > self.abs and abs(delta) > self.rel * abs(base)

    def scaled(self, size: float | None) -> Tolerance:
        """This tolerance for a scenario whose base peak is `size`: a default floor lowered to
        SMALL_FRACTION x size (not below `least`) where that is less."""
        if self.least is None or size is None:
            return self
        floor = max(self.least, SMALL_FRACTION * abs(size))
        if floor >= self.abs:
            return self
        return replace(self, abs=floor, size=size)

    def widened(self, noise: Noise | None) -> Tolerance:
        """This tolerance with its floor raised to NOISE_MARGIN x the spread, where that is more."""
        if noise is None or NOISE_MARGIN * noise.spread <= self.abs:
            return self
        return replace(self, abs=NOISE_MARGIN * noise.spread, noise=noise, size=None)

    def configured(self, abs_: float) -> Tolerance:
        """This tolerance with a floor set by a scenario or a flag: used as written, never scaled."""
        return replace(self, abs=abs_, least=None)


def default_tolerances() -> dict[str, Tolerance]:
    """Each gated metric's tolerance from its registry entry (harness.metrics.METRICS); a floor
    that scales with the scenario goes no lower than SMALL_LEAST."""
    return {name: Tolerance(rel=metric.gate.rel, abs=metric.gate.abs,
                            least=SMALL_LEAST if metric.gate.scales else None)
            for name, metric in METRICS.items() if metric.gate is not None}


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
        raise CompareError(f"{echo(value)}: {clip(str(exc))}") from None


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
        return "regression" if METRICS[self.metric].worse(self.delta) else "improvement"

    @property
    def new(self) -> bool:
        """A regression from near zero: the base was under the floor it is judged with, so a
        percentage (16 KiB -> 39.9 MiB: +255,000%) says nothing; the bytes do."""
        return self.verdict == "regression" and abs(self.base) < self.tolerance.abs


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
    # What the head changes in the gate's own inputs (its tolerances, expectations and
    # detector thresholds), which the base's figures were not judged with.
    policy: list[PolicyChange] = field(default_factory=list)
    # `gate pr`: a metric regression the pull request re-recorded the baseline for and carries
    # the acceptance of (never a run that failed on its own).
    accepted: bool = False

    @property
    def label(self) -> str:
        return f"{self.scenario}/{self.variant}"

    @property
    def changed(self) -> list[MetricDelta]:
        return [d for d in self.deltas if d.verdict != "unchanged"]

    @property
    def failure(self) -> str | None:
        """Why the head's run fails on its own, whatever the base: it did not complete, or it
        broke its own expectations (a canary that stopped detecting, a new variant that fails).
        No baseline and no tolerance can make such a run pass."""
        if self.head is None:  # removed, or the head produced no summaries at all
            return (self.note or "the head produced no summary") if self.state == FAILED else None
        if not self.head.ok:
            return _failure(self.head)
        if not self.head.passed:
            failed = "; ".join(e.describe() for e in self.head.failed_expectations)
            return f"fails its own expectations ({failed or 'passed: false'})"
        return None

    @property
    def verdict(self) -> str:
        if self.failure is not None:
            return "regression"
        verdicts = {d.verdict for d in self.deltas}
        for verdict in ("regression", "improvement"):
            if verdict in verdicts:
                return verdict
        return "unchanged"


# The acceptance convention: a maintainer labels the pull request, and the workflow passes
# `--accept` to `gate pr` (see docs/gate.md).
ACCEPT_LABEL = "memory-accepted"


@dataclass(frozen=True)
class Change:
    """One change a pull request makes to what it is judged against (`gate pr`): a committed
    baseline (`baseline peak`), a tolerance, an expectation, a detector threshold, or the set
    of variants. `refused`: why it cannot be accepted at all (a baseline of a failing run)."""

    label: str
    what: str
    old: str
    new: str
    loosens: bool
    recorded: Recorded | None = None
    refused: str | None = None

    def status(self, accepted: bool) -> str:
        """`refused`, `needs acceptance`, `accepted` (a loosening the PR accepts) or `tightens`."""
        if self.refused:
            return "refused"
        if not self.loosens:
            return "tightens"
        return "accepted" if accepted else "needs acceptance"


@dataclass
class Comparison:
    entries: list[Entry]
    notes: list[str]
    # Set when the head produced no summaries at all (it crashed, or its input was refused):
    # the first error line known, or "" when none was given. Always a regression.
    head_failure: str | None = None
    artifact_url: str | None = None  # where the run's plots are, for the renderings to link
    # `gate pr` only: what the pull request changes in its yardstick, and whether it carries
    # the maintainers' acceptance.
    changes: list[Change] = field(default_factory=list)
    accepted: bool = False

    @property
    def policy_changes(self) -> list[Entry]:
        return [e for e in self.entries if e.policy]

    def having(self, state: str) -> list[Entry]:
        return [e for e in self.entries if e.state == state]

    @property
    def regressions(self) -> list[Entry]:
        """Regressed variants, less those whose change the pull request accepts."""
        return [e for e in self.entries if e.verdict == "regression" and not e.accepted]

    @property
    def rejected(self) -> list[Change]:
        """Changes to the yardstick that fail the check: refused, or loosening unaccepted."""
        return [c for c in self.changes if c.status(self.accepted) in ("refused", "needs acceptance")]

    @property
    def improvements(self) -> list[Entry]:
        return [e for e in self.entries if e.verdict == "improvement"]

    @property
    def verdict(self) -> str:
        if self.regressions or self.head_failure is not None:
            return "regression"
        if self.rejected:
            return "rejected"
        if self.improvements:
            return "improvement"
        if any(e.state != COMPARED for e in self.entries) or self.notes:
            return "changed"
        return "no change"

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict in ("regression", "rejected") else 0


def tolerances(summary: Summary, rel: dict[str, float] | None = None,
               abs_: dict[str, float] | None = None) -> dict[str, Tolerance]:
    """Defaults, then the `compare` block `summary` carries (its scenario's `expect.compare`),
    then command-line flags. The gate passes the BASE's summary: a head cannot loosen the
    tolerances that judge it."""
    result = default_tolerances()
    for name, metric_spec in summary.compare.items():
        if name not in result or not isinstance(metric_spec, dict):
            raise CompareError(f"{summary.path}: compare.{name}: expected a metric among "
                               f"{', '.join(result)} with {{rel, abs}}")
        try:
            result[name] = _scenario_tolerance(result[name], metric_spec)
        except CompareError as exc:
            raise CompareError(f"{summary.path}: compare.{name}: {exc}") from None
    for name, value in (rel or {}).items():
        result[name] = replace(result[name], rel=value)
    for name, value in (abs_ or {}).items():
        result[name] = result[name].configured(value)
    return result


def _scenario_tolerance(current: Tolerance, spec: dict) -> Tolerance:
    spec_rel, spec_abs = spec.get("rel"), spec.get("abs")
    result = current if spec_abs is None else current.configured(size(spec_abs))
    return result if spec_rel is None else replace(result, rel=fraction(spec_rel))


@dataclass(frozen=True)
class PolicyChange:
    """One change to the yardstick a variant is judged by: a tolerance (`compare.peak`), an
    expectation (`expect.leak`) or a detector threshold (`detect.leak.min_bytes`). `loosens`:
    it could let through what the old one caught, so the gate asks for an acceptance."""

    name: str
    old: object  # None where that side does not state it
    new: object
    loosens: bool

    @property
    def stated(self) -> tuple[str, str]:
        return _stated(self.old), _stated(self.new)

    def __str__(self) -> str:
        return f"{self.name} {' → '.join(self.stated)}"


def _stated(value: object) -> str:
    if value is None:
        return "(none)"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _limit(metric: str, tolerance: Tolerance) -> str:
    """`4 MiB`, `4 MiB and 5%`: a tolerance as a scenario states it."""
    floor = (format_bytes(tolerance.abs) if METRICS[metric].unit == BYTES
             else f"{tolerance.abs:g}")
    return floor + (f" and {tolerance.rel * 100:g}%" if tolerance.rel else "")


def _expected(summary: Summary) -> dict[str, object]:
    """Each expectation's name and what it expects (`none`, `detected`, `<= 1,024 B`)."""
    return {e.name: e.expected for e in summary.expectations}


def _thresholds(summary: Summary) -> dict[str, object]:
    """`detect.<detector>.<threshold>`: each value the run's detectors applied."""
    return {f"detect.{name}.{key}": value for name, block in (summary.detect or {}).items()
            for key, value in block.items()}


def policy_changes(base: Summary, head: Summary) -> list[PolicyChange]:
    """What the head changes in the gate's inputs for this variant, each marked by whether it
    loosens: a tolerance that grows (abs or rel); an expectation dropped or stated
    differently (one added only tightens); any detector threshold moved (whether a higher
    value hides more depends on the detector, so every move counts). Thresholds are compared
    only where both sides recorded them (summaries before they did have none). Both `compare`
    blocks are checked: a malformed one is bad input naming its file."""
    limits = tolerances(base), tolerances(head)
    changes = [PolicyChange(f"compare.{name}", _limit(name, old), _limit(name, new),
                            new.abs > old.abs or new.rel > old.rel)
               for name, old in limits[0].items() if old != (new := limits[1][name])]
    expected = _expected(base), _expected(head)
    names = list(expected[0]) + [name for name in expected[1] if name not in expected[0]]
    changes += [PolicyChange(f"expect.{name}", expected[0].get(name), expected[1].get(name),
                             name in expected[0])
                for name in names if expected[0].get(name) != expected[1].get(name)]
    if base.detect is not None and head.detect is not None:
        thresholds = _thresholds(base), _thresholds(head)
        names = list(thresholds[0]) + [n for n in thresholds[1] if n not in thresholds[0]]
        changes += [PolicyChange(name, thresholds[0].get(name), thresholds[1].get(name), True)
                    for name in names if thresholds[0].get(name) != thresholds[1].get(name)]
    return changes


def _failure(summary: Summary) -> str:
    """`failed: <first line of the error>`; the error may carry a traceback."""
    error = summary.error or f"exit status {summary.exit_status}"
    return f"{summary.status}: {error.splitlines()[0]}"


def _versions(summary: Summary) -> tuple[str, str]:
    return summary.environment.mlx, summary.environment.mlx_lm


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
    limits = tolerances(base, rel=rel, abs_=abs_)
    entry.policy = policy_changes(base, head)
    scenario_size = base.metric("peak")
    for name in gated():
        b, h = base.metric(name), head.metric(name)
        if b is not None and h is not None:
            noise = base.noise(name), head.noise(name)
            widest = max((n for n in noise if n), key=lambda n: n.spread, default=None)
            limit = limits[name].scaled(scenario_size).widened(widest)
            entry.deltas.append(MetricDelta(name, b, h, limit, *noise))
    if _versions(base) != _versions(head):
        entry.note = "mlx/mlx-lm {} vs {}".format(*("/".join(_versions(s)) for s in (base, head)))
    return entry


def index_summaries(summaries: Sequence[Summary], where: str = "") -> dict[Key, Summary]:
    """Summaries by (scenario, variant, backend); two for one key are bad input naming both."""
    index: dict[Key, Summary] = {}
    for s in summaries:
        key = (*s.key, s.backend)
        if key in index:
            raise CompareError(f"{where}{': ' if where else ''}two summaries for {s.label} on "
                               f"backend {s.backend}: {index[key].path} and {s.path}")
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
    base_index, head_index = index_summaries(base), index_summaries(head)
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


def head_failed(base: list[Summary], error: str | None = None) -> Comparison:
    """The comparison when the head produced no summaries (it crashed, or its input was
    refused): a regression, with each variant the base ran listed as failed in the head."""
    entries = [Entry(*b.key, FAILED, b, None, note="the head produced no summary")
               for b in index_summaries(base).values()]
    first = next((line.strip() for line in (error or "").splitlines() if line.strip()), "")
    return Comparison(sorted(entries, key=lambda e: (e.scenario, e.variant)), [],
                      head_failure=first)


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
        raise CompareError(f"not a fraction: {echo(value)} (expected e.g. 0.05)")
    return fraction
