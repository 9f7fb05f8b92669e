"""What a pull request changes in the yardstick it is judged by: a variant's tolerances,
expectations and detector thresholds as its head records them against the base's, and the
changes `gate pr` lists, with whether each loosens the check.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..common.units import format_bytes
from ..judge.metrics import BYTES, METRICS
from ..judge.summary import Recorded, Summary
from .tolerance import Tolerance, tolerances

# The acceptance convention: a maintainer labels the pull request, and the workflow passes
# `--accept` to `gate pr` (see docs/gate.md).
ACCEPT_LABEL = "memory-accepted"


@dataclass(frozen=True)
class YardstickChange:
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
    commit: str | None = None  # `gate pr`: the head's commit that made it (SHA, author)

    def status(self, accepted: bool) -> str:
        """`refused`, `needs acceptance`, `accepted` (a loosening the PR accepts) or `tightens`."""
        if self.refused:
            return "refused"
        if not self.loosens:
            return "tightens"
        return "accepted" if accepted else "needs acceptance"


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


# An expectation one side does not state: dropped by the head, or new in it.
DROPPED, NOT_STATED = "(dropped)", "(not stated)"


def _applied(base: Summary, side: Summary) -> dict[str, Tolerance]:
    """The tolerances `side` states, as the gate would apply them to this variant: scaled to the
    base's peak and widened by the base's measured noise, so a row shows what judged the run."""
    return {name: limit.scaled(base.metric("peak")).widened(base.noise(name))
            for name, limit in tolerances(side).items()}


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
    given = summary.detect.given() if summary.detect is not None else {}
    return {f"detect.{name}.{key}": value for name, block in given.items()
            for key, value in block.items()}


def policy_changes(base: Summary, head: Summary) -> list[PolicyChange]:
    """What the head changes in the gate's inputs for this variant, each marked by whether it
    loosens: a tolerance that grows (abs or rel); an expectation dropped or stated
    differently (one added only tightens); any detector threshold moved (whether a higher
    value hides more depends on the detector, so every move counts), while the thresholds of a
    detector the base did not have add a check. Thresholds are compared only where both sides
    recorded them (summaries before they did have none). Both `compare`
    blocks are checked: a malformed one is bad input naming its file."""
    limits = _applied(base, base), _applied(base, head)
    changes = [PolicyChange(f"compare.{name}", _limit(name, old), _limit(name, new),
                            new.abs > old.abs or new.rel > old.rel)
               for name, old in limits[0].items() if old != (new := limits[1][name])]
    expected = _expected(base), _expected(head)
    names = list(expected[0]) + [name for name in expected[1] if name not in expected[0]]
    changes += [PolicyChange(f"expect.{name}", expected[0].get(name, NOT_STATED),
                             expected[1].get(name, DROPPED), name in expected[0])
                for name in names if expected[0].get(name) != expected[1].get(name)]
    if base.detect is not None and head.detect is not None:
        thresholds = _thresholds(base), _thresholds(head)
        names = list(thresholds[0]) + [n for n in thresholds[1] if n not in thresholds[0]]
        changes += [PolicyChange(name, thresholds[0].get(name), thresholds[1].get(name),
                                 name in thresholds[0])  # a detector new in the head adds a check
                    for name in names if thresholds[0].get(name) != thresholds[1].get(name)]
    return changes
