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

from ..common.units import format_bytes

if TYPE_CHECKING:
    import pandas as pd

# "error": an expectation of none fails on it; "warning": shown, and a default expectation lets
# it pass (growth with no budget stated); "info": nothing the scenario states fails on it.
Severity = Literal["error", "warning", "info"]
MAX_STEPS_LISTED = 20


@dataclass(frozen=True, kw_only=True, config=ConfigDict(defer_build=True))
class Holder:
    """A group of live MLX arrays reached by one path at rest (docs/holders.md): its name (the
    path, anchored at the object that holds it, indices collapsed), the kind of root it hangs
    from, the allocator bytes of its unique buffers, its arrays' own bytes, its arrays and
    buffers. In a finding, `bytes` is what the group accounts for of the finding's bytes (for
    a trend, its growth at the finding's rate), `arrays` and `buffers` what it holds at the
    end; `path` is one full path to one of its arrays."""

    holder: StrictStr
    root: StrictStr = ""
    bytes: StrictInt
    logical: StrictInt | None = None
    arrays: StrictInt | None = None
    buffers: StrictInt | None = None
    # Its arrays not evaluated yet, whose graphs keep their inputs' buffers alive.
    pending: StrictInt | None = Field(default=None, exclude_if=lambda count: count is None)
    path: StrictStr = Field(default="", exclude_if=lambda path: not path)

    def figures(self, per: str | None = None) -> str:
        """`1.00 MiB, 12 arrays`; with `per` (a rate's unit) `+1.00 MiB a request, 12 arrays`."""
        held = [f"{format_bytes(self.bytes, signed=True)} a {per}" if per
                else format_bytes(self.bytes)]
        if self.arrays is not None:
            held.append(f"{self.arrays:,} array{'s' if self.arrays != 1 else ''}")
        if self.buffers is not None and self.buffers != self.arrays:
            held.append(f"{self.buffers:,} buffer{'s' if self.buffers != 1 else ''}")
        if self.pending:
            held.append(f"{self.pending:,} pending")
        return ", ".join(held)

    def describe(self, per: str | None = None) -> str:
        """`examples.leaky_store:LeakyStore._entries[*] (+1.00 MiB a request, 12 arrays)`."""
        return f"{self.holder} ({self.figures(per)})"


@dataclass(frozen=True, kw_only=True, config=ConfigDict(defer_build=True))
class HeldAtRest:
    """Who held the live MLX arrays at the run's last point at rest walked (`step`): the
    largest groups, and `unreached`, the active bytes there no walked array accounts for
    (MLX's own: the inputs pending graphs keep, a compiled function's constants; the buffer
    cache is apart). `approximate`: the MLX walked lacks `get_array_buffer_size`, so a group's
    bytes are its arrays' own and its buffers its arrays; `walks`, `seconds`, `objects`: what
    the walks cost."""

    step: StrictInt
    groups: list[Holder] = Field(default_factory=list)
    unreached: StrictInt = 0
    # The groups with the most pending arrays: whose graphs may hold what is unreached.
    pending: list[Holder] = Field(default_factory=list, exclude_if=lambda found: not found)
    approximate: StrictBool = Field(default=False, exclude_if=lambda flag: not flag)
    # What the walks cost: how many points were walked, their seconds in all, and the Python
    # objects the last one visited.
    walks: StrictInt = 0
    seconds: float = 0.0
    objects: StrictInt = 0

    def grown_since(self, base: HeldAtRest) -> Holder | None:
        """The group that gained the most bytes since `base` (a run of the code before a
        change), with that gain as its bytes; None where none gained."""
        before = {g.holder: g.bytes for g in base.groups}
        gains = [(g.bytes - before.get(g.holder, 0), g) for g in self.groups]
        gain, group = max(gains, key=lambda pair: pair[0], default=(0, None))
        if group is None or gain <= 0:
            return None
        return Holder(holder=group.holder, root=group.root, bytes=gain, logical=group.logical,
                      arrays=group.arrays, buffers=group.buffers, path=group.path)


@dataclass(frozen=True, kw_only=True, config=ConfigDict(defer_build=True))
class Finding:
    """What a detector found: the step it reports at, the bytes there (or a rate, per request),
    how many steps or requests it covers, its message and the steps it marks on the plot (at
    most MAX_STEPS_LISTED, spread over the run: `listed`).
    `severity` says whether it can fail the run (`Severity`; a detector says "warning" where
    a default expectation must let it pass, and the run grades the rest against the scenario's
    expectations). `supersedes`: the kinds this finding answers for in this run (the
    registry's supersession), written only where there are some; `holders`, the groups of
    arrays that account for its bytes. A summary written by hand may leave out all but `kind`
    and `message`."""

    kind: StrictStr
    step: StrictInt | None = None
    bytes: StrictInt | None = None
    count: StrictInt | None = None
    message: StrictStr
    steps: list[StrictInt] = Field(default_factory=list)
    severity: Severity = "error"
    supersedes: list[StrictStr] = Field(default_factory=list, exclude_if=lambda kinds: not kinds)
    # What `bytes` is a rate per ("request", "turn"), where it is one: a trend's.
    per: StrictStr | None = Field(default=None, exclude_if=lambda unit: unit is None)
    # Who holds the finding's bytes, largest share first (harness.judge.holders), written only
    # where the run walked its holders.
    holders: list[Holder] = Field(default_factory=list, exclude_if=lambda found: not found)

    def held_by(self, code: str = "") -> str:
        """`held by examples.leaky_store:LeakyStore._entries[*] (+1.00 MiB a request, 12
        arrays)`, its top holder (and how many more there are), the name between `code`
        marks; "" where none is named."""
        if not self.holders:
            return ""
        top, more = self.holders[0], len(self.holders) - 1
        return (f"held by {code}{top.holder}{code} ({top.figures(self.per)})"
                + (f" and {more} more" if more else ""))


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
