"""What judging a run produces and its summary keeps: the findings of the detectors and the
expectations checked against them, one typed record each from detector to summary to gate.

Each is a pydantic dataclass: detectors and checks build them by keyword, a summary read from a
file validates them (a field of the wrong type is bad input), and both write the same JSON.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr
from pydantic.dataclasses import dataclass

Severity = Literal["error", "warning"]


@dataclass(frozen=True, kw_only=True, config=ConfigDict(defer_build=True))
class Finding:
    """What a detector found: the step it reports at, the bytes there (or a rate, per request),
    how many steps or requests it covers, its message and the first steps it marks on the plot.
    `severity` "warning": shown and recorded, but a scenario's default expectation of none is
    not failed by it (growth with no budget stated); only an expectation the scenario states
    is. A summary written by hand may leave out all but `kind` and `message`."""

    kind: StrictStr
    step: StrictInt | None = None
    bytes: StrictInt | None = None
    count: StrictInt | None = None
    message: StrictStr
    steps: list[StrictInt] = Field(default_factory=list)
    severity: Severity = "error"


@dataclass(frozen=True, kw_only=True, config=ConfigDict(defer_build=True))
class Expectation:
    """One expectation of the scenario as checked: a presence (`none`, `detected`) or a bound
    (`<= 1,024 B`), what the run gave, and whether it holds."""

    name: StrictStr
    expected: Any = None
    actual: Any = None
    ok: StrictBool
    message: StrictStr = ""

    def describe(self) -> str:
        return f"{self.name}: expected {self.expected}, got {self.actual}"
