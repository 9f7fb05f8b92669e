"""Compare two sets of run summaries (base vs head) metric by metric: the regression gate.

Each variant present on both sides is compared on every gated metric, with the tolerance its
base applies (harness.gate.tolerance); results from different backends are never compared.

Whose tolerances. A pull request must not loosen the gate that judges it: the tolerances are
the BASE's (the `compare` block its summaries carry, i.e. the scenario's `expect.compare` as
recorded on the base commit or in the baseline), then the command line's flags. When the head's
`compare` block or its expectations differ from the base's, the entry lists what differs
(`VariantComparison.policy`, harness.gate.policy) and every rendering says so in its first lines.

A metric that was near zero in the base (below the floor it was judged with) and grew has no
meaningful percentage (16 KiB -> 39.9 MiB is +255,000%): the renderings say "new" and show
the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..judge.metrics import METRICS, gated
from ..judge.summary import Noise, Summary
from .event import Acceptance
from .policy import PolicyChange, YardstickChange, policy_changes
from .tolerance import CompareError, Tolerance, tolerances

Key = tuple[str, str, str]  # scenario, variant, backend


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


# A variant's states: both sides ran and were compared, or why they were not.
COMPARED, NEW, REMOVED, FAILED, INCOMPARABLE = "compared", "new", "removed", "failed", "incomparable"


@dataclass(frozen=True)
class VariantComparison:
    """One scenario variant: its deltas, or the reason it could not be compared. Immutable: a
    step of the gate that judges it otherwise makes a new one (`dataclasses.replace`)."""

    scenario: str
    variant: str
    state: str
    base: Summary | None = None
    head: Summary | None = None
    deltas: tuple[MetricDelta, ...] = ()
    note: str = ""
    # What the head changes in the gate's own inputs (its tolerances, expectations and
    # detector thresholds), which the base's figures were not judged with.
    policy: tuple[PolicyChange, ...] = ()
    # `gate pr`: a metric regression the pull request re-recorded the baseline for and carries
    # the acceptance of (never a run that failed on its own).
    accepted: bool = False
    # `gate pr`: why the judge does not take the head's summary for this variant (it ran on
    # another backend than the check judges), or why a variant the head still defines has none.
    refusal: str | None = None
    # `gate pr`: what the head records beside its scenario that its baseline did not (an older
    # baseline): `model_folder`, `runner`, `preloaded`, compared with nothing (gate.yardstick).
    not_recorded: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return self.scenario, self.variant

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
        if self.refusal is not None:
            return self.refusal
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


@dataclass(frozen=True)
class Comparison:
    """Every variant of a base and a head compared, and what the renderings say beside them.
    Immutable: each step of the gate returns a new one."""

    entries: tuple[VariantComparison, ...]
    notes: tuple[str, ...]
    # Set when the head produced no summaries at all (it crashed, or its input was refused):
    # the first error line known, or "" when none was given. Always a regression.
    head_failure: str | None = None
    artifact_url: str | None = None  # where the run's plots are, for the renderings to link
    # `gate pr` only: what the pull request changes in its yardstick, and whether it carries
    # the maintainers' acceptance.
    changes: tuple[YardstickChange, ...] = ()
    accepted: bool = False
    # `gate pr`: who's who and whose acceptance, from the pull request's event (or none: a
    # local run), for the renderings to name.
    acceptance: Acceptance | None = None
    # `gate pr`: the head's runs' own exit status, as `kvmem run` gives it (2 a run did not
    # complete or the head could not start, 1 one broke its expectations).
    runs_status: int = 0

    @property
    def policy_changes(self) -> list[VariantComparison]:
        return [e for e in self.entries if e.policy]

    def having(self, state: str) -> list[VariantComparison]:
        return [e for e in self.entries if e.state == state]

    @property
    def regressions(self) -> list[VariantComparison]:
        """Regressed variants, less those whose change the pull request accepts."""
        return [e for e in self.entries if e.verdict == "regression" and not e.accepted]

    @property
    def rejected(self) -> list[YardstickChange]:
        """Changes to the yardstick that fail the check: refused, or loosening unaccepted."""
        return [c for c in self.changes if c.status(self.accepted) in ("refused", "needs acceptance")]

    @property
    def improvements(self) -> list[VariantComparison]:
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

    @property
    def pr_status(self) -> int:
        """`gate pr`'s exit status, as CI's judge gives it: 2 where a run did not complete,
        else the gate's verdict, else whether the runs met their expectations."""
        return 2 if self.runs_status == 2 else self.exit_code or self.runs_status


def _failure(summary: Summary) -> str:
    """`failed: <first line of the error>`; the error may carry a traceback."""
    error = summary.error or f"exit status {summary.exit_status}"
    return f"{summary.status}: {error.splitlines()[0]}"


def _versions(summary: Summary) -> tuple[str, str]:
    return summary.environment.mlx, summary.environment.mlx_lm


def _pair(base: Summary, head: Summary, rel: dict, abs_: dict) -> VariantComparison:
    if base.backend != head.backend:
        return VariantComparison(*head.key, INCOMPARABLE, base, head,
                                 note=f"backend {base.backend} vs {head.backend}: not compared")
    if not head.ok or not base.ok:
        note = "; ".join(f"{side} {_failure(s)}" for side, s in (("base", base), ("head", head))
                         if not s.ok)
        return VariantComparison(*head.key, FAILED, base, head, note=note)
    limits = tolerances(base, rel=rel, abs_=abs_)
    policy = tuple(policy_changes(base, head))
    scenario_size = base.metric("peak")
    deltas = []
    for name in gated():
        b, h = base.metric(name), head.metric(name)
        if b is not None and h is not None:
            # Only the base's measured noise widens a tolerance: a spread the head reports is
            # the head's word, and a wider one would loosen its own judge.
            limit = limits[name].scaled(scenario_size).widened(base.noise(name))
            deltas.append(MetricDelta(name, b, h, limit, base.noise(name), head.noise(name)))
    note = ("mlx/mlx-lm {} vs {}".format(*("/".join(_versions(s)) for s in (base, head)))
            if _versions(base) != _versions(head) else "")
    return VariantComparison(*head.key, COMPARED, base, head, tuple(deltas), note, policy)


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
    entries: dict[tuple[str, str], VariantComparison] = {}
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
            entries[key[:2]] = VariantComparison(*h.key, state, None, h, note=note)
    for key, b in base_index.items():
        if key[:2] in entries:
            skipped += 1
        else:
            entries[key[:2]] = VariantComparison(*b.key, REMOVED, b, None)
    notes = _environment_notes(base, head)
    if skipped:
        notes.append(f"{skipped} base summaries on other backends left out")
    return Comparison(tuple(sorted(entries.values(), key=lambda e: (e.scenario, e.variant))),
                      tuple(notes))


def head_failed(base: list[Summary], error: str | None = None) -> Comparison:
    """The comparison when the head produced no summaries (it crashed, or its input was
    refused): a regression, with each variant the base ran listed as failed in the head."""
    entries = [VariantComparison(*b.key, FAILED, b, None, note="the head produced no summary")
               for b in index_summaries(base).values()]
    first = next((line.strip() for line in (error or "").splitlines() if line.strip()), "")
    return Comparison(tuple(sorted(entries, key=lambda e: (e.scenario, e.variant))), (),
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
