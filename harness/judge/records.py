"""What judging a run produces and its summary keeps: the findings of the detectors and the
expectations checked against them, one typed record each from detector to summary to gate.

Each is a pydantic dataclass: detectors and checks build them by keyword, a summary read from a
file validates them (a field of the wrong type is bad input), and both write the same JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr
from pydantic.dataclasses import dataclass

if TYPE_CHECKING:
    import pandas as pd

# "error": an expectation of none fails on it; "warning": shown, and a default expectation lets
# it pass (growth with no budget stated); "info": nothing the scenario states fails on it.
Severity = Literal["error", "warning", "info"]
MAX_STEPS_LISTED = 20


@dataclass(frozen=True, kw_only=True, config=ConfigDict(defer_build=True))
class Finding:
    """What a detector found: the step it reports at, the bytes there (or a rate, per request),
    how many steps or requests it covers, its message and the steps it marks on the plot (at
    most MAX_STEPS_LISTED, spread over the run: `listed`).
    `severity` says whether it can fail the run (`Severity`; a detector says "warning" where
    a default expectation must let it pass, and the run grades the rest against the scenario's
    expectations). `supersedes`: the kinds this finding answers for in this run (the
    registry's supersession), written only where there are some. A summary written by hand
    may leave out all but `kind` and `message`."""

    kind: StrictStr
    step: StrictInt | None = None
    bytes: StrictInt | None = None
    count: StrictInt | None = None
    message: StrictStr
    steps: list[StrictInt] = Field(default_factory=list)
    severity: Severity = "error"
    supersedes: list[StrictStr] = Field(default_factory=list, exclude_if=lambda kinds: not kinds)


@dataclass(frozen=True, kw_only=True, config=ConfigDict(defer_build=True))
class Expectation:
    """One expectation of the scenario as checked: a presence (`none`, `detected`) or a bound
    (`<= 1,024 B`), what the run gave, and whether it holds; `superseded_by`, the finding that
    answered for this presence (written only where one did)."""

    name: StrictStr
    expected: Any = None
    actual: Any = None
    ok: StrictBool
    message: StrictStr = ""
    superseded_by: StrictStr | None = Field(default=None, exclude_if=lambda kind: kind is None)

    def describe(self) -> str:
        """`unbounded: expected detected, got none`, with the finding that superseded it."""
        by = (f" (superseded by {self.superseded_by}, which judges the same bound)"
              if self.superseded_by else "")
        return f"{self.name}: expected {self.expected}, got {self.actual}{by}"


def from_hits(kind: str, hits: pd.DataFrame, excess: pd.Series,
              message: Callable[[Hashable], str]) -> Finding | None:
    """The finding of a detector of steps or points, reported at the hit with the largest
    excess, with how many it hit and MAX_STEPS_LISTED of them spread over the run (`listed`).

    `message` is given that step's row label, to describe it. No hits, no finding.
    """
    if hits.empty:
        return None
    worst = excess[hits.index].idxmax()
    return Finding(kind=kind, step=int(hits["step"][worst]), bytes=int(excess[worst]),
                   count=len(hits), message=message(worst),
                   steps=listed(hits["step"]))


def listed(steps: pd.Series) -> list[int]:
    """The steps a finding lists: all of them up to MAX_STEPS_LISTED, else MAX_STEPS_LISTED taken
    evenly across them, the first and the last included, in order.

    Spread, not the first ones: a server's run hits for an hour, and the plot marks what is
    listed, so the first 20 hits would mark only its first seconds. Position i of the n hits is
    kept for i = round(k (n - 1) / (MAX_STEPS_LISTED - 1)), k = 0 .. MAX_STEPS_LISTED - 1, in
    integers (halves round up): with n > MAX_STEPS_LISTED the positions are distinct.
    """
    values = [int(s) for s in steps]
    n, last = len(values), MAX_STEPS_LISTED - 1
    if n <= MAX_STEPS_LISTED:
        return values
    return [values[(k * (n - 1) * 2 + last) // (2 * last)] for k in range(MAX_STEPS_LISTED)]
