"""Who holds a finding's bytes: the groups of live MLX arrays walked at each point at rest
(harness.agent.kvmem_holders; a variant's holders.csv) attributed to the findings that judge
memory at rest, and the largest groups a summary keeps (docs/holders.md).

A group is named by its path, so the same name at two points is the same holder: what a group
gained between two points is what it took of the memory that grew there. Each finding names the
groups that account for its bytes, largest first, until they cover COVERED of them (at most
NAMED_AT_MOST):

- a trend (`per` a request or turn: leak, unbounded's growth) the groups' growth over the
  points it fitted, at its rate;
- gc_deferred the groups only unreachable cycles hold;
- retained the groups whose buffers exceed their arrays' own bytes (a slice pinning its whole
  buffer), by that excess;
- buffers the groups whose buffer count grew from the first point at rest (with the bytes
  they gained, next to nothing for a pile of scalars);
- the others (a budget or a cap breached, aliased, a plateau, a recording's drift) the groups'
  growth from the first point at rest to the last (a recording's first walk to its last).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from .records import Finding, HeldAtRest, Holder

if TYPE_CHECKING:
    import pandas as pd

NAMING = ("leak", "unbounded", "plateau", "retained", "aliased", "gc_deferred", "over_cap",
          "buffers", "drift")
COVERED = 0.95
NAMED_AT_MOST = 5
KEPT = 10  # the groups a summary keeps


def _point(holders: pd.DataFrame, step: int | None) -> pd.DataFrame:
    """The groups walked at the last point at rest at or before `step` (the first point where
    none is; the last where `step` is None)."""
    steps = holders["step"].unique()
    if step is None:
        at = steps[-1]
    else:
        before = steps[steps <= step]
        at = before[-1] if len(before) else steps[0]
    return holders[holders["step"] == at].set_index("holder")


def _change(first: pd.DataFrame, last: pd.DataFrame, column: str) -> pd.Series:
    """Per group at `last`: its `column` there less at `first` (0 where it was not there)."""
    return last[column] - first[column].reindex(last.index, fill_value=0)


def _holders(amounts: pd.Series, groups: pd.DataFrame, scale: float = 1.0,
             held: pd.Series | None = None) -> list[Holder]:
    """The groups with the largest positive `amounts` until they cover COVERED of the total,
    at most NAMED_AT_MOST; each with its amount (times `scale`), or its `held` bytes where the
    amounts are not bytes, and what it holds in `groups`."""
    positive = amounts[amounts > 0].sort_values(ascending=False, kind="stable")
    total, covered = positive.sum(), 0
    named: list[Holder] = []
    for name, amount in positive.items():
        if len(named) == NAMED_AT_MOST or (named and covered >= COVERED * total):
            break
        group = groups.loc[name]
        figure = float(amount) * scale if held is None else float(held[name])
        named.append(_holder(name, group, round(figure)))
        covered += amount
    return named


def _holder(name: object, group: pd.Series, held: int) -> Holder:
    return Holder(holder=str(name), root=str(group["root"]), bytes=held,
                  logical=int(group["logical"]), arrays=int(group["arrays"]),
                  buffers=int(group["buffers"]), pending=int(group["pending"]) or None,
                  path=str(group["path"]))


def _points_between(frame: pd.DataFrame, first: int, last: int) -> int:
    """How many points at rest follow the one at step `first`, up to the one at `last`."""
    steps = frame.loc[frame["phase"] == "idle", "step"]
    return int(((steps > first) & (steps <= last)).sum())


def _fullest(holders: pd.DataFrame, amounts: Callable[[pd.DataFrame], pd.Series]
             ) -> tuple[pd.Series, pd.DataFrame]:
    """Of the walked points, the one whose groups' positive `amounts` sum highest (where a
    finding reported at its worst step is seen best, the walk being spaced): those amounts
    and the groups there."""
    best: tuple[float, pd.Series, pd.DataFrame] | None = None
    for step in holders["step"].unique():
        at = _point(holders, int(step))
        found = amounts(at)
        total = float(found[found > 0].sum())
        if best is None or total > best[0]:
            best = (total, found, at)
    assert best is not None, "a walked run has a point"
    return best[1], best[2]


def held_by(finding: Finding, holders: pd.DataFrame, frame: pd.DataFrame) -> list[Holder]:
    """The groups that account for `finding`'s bytes (module docstring); none for a kind
    this does not name, or where nothing was walked. The walk is spaced (a run walks its
    first point at rest, each power of two and its last): a finding reported at its worst
    point (gc_deferred, retained) is named where the walked points see it most; a bound
    breached (judged where the run ends) and a plateau at the last point walked; a rate by
    a group's growth between the walked points around the finding's span over the points at
    rest between them. Where the groups named cover less than COVERED of the finding's bytes,
    the groups with the most pending arrays come first (`_unsized`)."""
    if finding.kind not in NAMING or holders.empty:
        return []
    if finding.kind == "gc_deferred":
        cycles, at = _fullest(holders, lambda at: at["bytes"].where(at["root"] == "cycle", 0))
        return _holders(cycles, at)
    first, at = _point(holders, int(holders["step"].iloc[0])), _point(holders, None)
    if finding.kind == "buffers":  # by the buffers each gained; its bytes, what it gained
        return _holders(_change(first, at, "buffers"), at, held=_change(first, at, "bytes"))
    if finding.kind == "retained":
        waste, at = _fullest(holders, lambda at: at["bytes"] - at["logical"])
        found = _holders(waste, at)
    elif finding.per is not None and finding.steps:
        first, at = _point(holders, finding.steps[0]), _point(holders, finding.steps[-1])
        span = _points_between(frame, int(first["step"].iloc[0]), int(at["step"].iloc[0]))
        found = _holders(_change(first, at, "bytes"), at, 1 / span) if span else []
    else:
        found = _holders(_change(first, at, "bytes"), at)
    return _unsized(finding, found, at)


def _unsized(finding: Finding, found: list[Holder], at: pd.DataFrame) -> list[Holder]:
    """`found`, after the groups at `at` with the most pending arrays where `found` covers
    less than COVERED of the finding's bytes: a pending array's graph keeps its inputs'
    buffers alive, and MLX does not size them without evaluating them, so bytes no walked
    array accounts for are likeliest theirs (their own figures are what they hold evaluated)."""
    if not finding.bytes or sum(h.bytes for h in found) >= COVERED * finding.bytes:
        return found
    waiting = at[at["pending"] > 0].sort_values("pending", ascending=False, kind="stable")
    first = [_holder(name, g, int(g["bytes"])) for name, g in waiting.head(2).iterrows()]
    return [*first, *(h for h in found if h.holder not in {f.holder for f in first})]


def named(findings: list[Finding], holders: pd.DataFrame,
          frame: pd.DataFrame) -> list[Finding]:
    """Each finding with the holders of its bytes (`held_by`)."""
    return [replace(f, holders=held_by(f, holders, frame)) if f.kind in NAMING else f
            for f in findings]


def largest(holders: pd.DataFrame, frame: pd.DataFrame) -> HeldAtRest | None:
    """At the last point at rest walked: its KEPT largest groups, the active bytes there that
    no walked array accounts for, and the groups with the most pending arrays, whose graphs
    keep buffers alive that MLX does not size without evaluating them (the likeliest holders
    of those bytes); None where nothing was walked."""
    if holders.empty:
        return None
    at = _point(holders, None)
    step = int(at["step"].iloc[0])
    active = frame.loc[frame["step"] == step, "active"]
    unreached = int(active.iloc[0]) - int(at["bytes"].sum()) if len(active) else 0
    ordered = at.sort_values("bytes", ascending=False, kind="stable").head(KEPT)
    groups = [_holder(name, g, int(g["bytes"])) for name, g in ordered.iterrows()]
    waiting = at[at["pending"] > 0].sort_values("pending", ascending=False, kind="stable")
    pending = [_holder(name, g, int(g["bytes"])) for name, g in waiting.head(5).iterrows()]
    walks = holders.drop_duplicates("step")
    return HeldAtRest(step=step, groups=groups, unreached=unreached, pending=pending,
                      approximate=bool(at["approximate"].any()), walks=len(walks),
                      seconds=round(float(walks["seconds"].sum()), 3),
                      objects=int(at["objects"].iloc[0]))
