"""The pull-request check (`kvmem gate pr --base REF`): the head's runs against the target
branch's committed baselines, and every change the pull request makes to that yardstick.

A pull request is judged against the baselines committed at REF, read from git: editing its own
`baselines/` cannot change its verdict. What it does change there, and in the tolerances,
expectations, detector thresholds and the set of variants its runs carry, is listed as a
`YardstickChange`. A change that tightens passes; one that loosens passes only with the
maintainers' acceptance (the pull request's ACCEPT_LABEL, given to the check as `--accept`);
one that can never be accepted is refused:

- a committed baseline of a run that did not complete or broke its own expectations;
- a baseline changed without the reason `kvmem baseline update --reason` records.

A metric regression against REF passes with the acceptance only where the pull request
re-records that variant's baseline and its run matches the new baseline. A run that fails on
its own (did not complete, broke its expectations: a new variant that fails, a canary that
stopped detecting) is a regression nothing accepts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import PurePosixPath

from ..common.units import format_bytes
from ..judge.metrics import METRICS, noisy
from ..judge.summary import Summary
from ..store.summaries import Baselines
from . import identity, yardstick
from .compare import COMPARED, REMOVED, Comparison, VariantComparison, compare
from .definition import Definitions, differences
from .policy import ACCEPT_LABEL, YardstickChange, policy_changes
from .render import format_value
from .tolerance import tolerances


def selected(summaries: Iterable[Summary], paths: list[PurePosixPath],
             backends: set[str]) -> list[Summary]:
    """Those of `backends` whose scenario file lies at or under one of `paths` (the scenario
    files or folders the check covers); one that records no file is kept."""
    def covered(summary: Summary) -> bool:
        if summary.scenario_file is None:
            return True
        file = PurePosixPath(summary.scenario_file)
        return any(file == p or p in file.parents or p == PurePosixPath(".") for p in paths)

    return [s for s in summaries if s.backend in backends and covered(s)]


def rewritten(old: Baselines, new: Baselines) -> list[PurePosixPath]:
    """The baseline files the pull request adds, removes or rewrites, by path: the one place
    two baselines are told apart, by the JSON they record."""
    return [path for path in sorted(set(old) | set(new))
            if path not in old or path not in new or old[path].to_json() != new[path].to_json()]


def _refusal(summary: Summary) -> str | None:
    if not summary.ok or not summary.passed:
        return ("a baseline must be a run that completed and met its expectations: "
                f"{summary.first_error if not summary.ok else 'its expectations fail'}")
    if summary.recorded is None or not summary.recorded.reason.strip():
        return "recorded without a reason (`kvmem baseline update --reason TEXT` records one)"
    return None


def _changed(old: Summary, new: Summary, commit: str | None) -> list[YardstickChange]:
    """What a re-recorded baseline changes, as the gate would judge it (the old one's
    tolerances): each figure recorded worse (by any amount) or better beyond tolerance, each
    tolerance a wider spread widens, each tolerance, expectation or threshold it records
    differently. `commit`: the head's commit that last changed the file."""
    made = lambda what, before, after, loosens: YardstickChange(
        new.label, what, before, after, loosens, new.recorded, commit=commit)
    entry = compare([old], [new]).entries[0]
    # Any figure recorded worse loosens, inside the tolerance too: else a baseline could ratchet
    # up a tolerance's worth per pull request, each step unseen.
    rows = [made(f"baseline {d.metric}", format_value(d.metric, d.base),
                 format_value(d.metric, d.head), worse)
            for d in entry.deltas
            if (worse := d.delta != 0 and METRICS[d.metric].worse(d.delta))
            or d.verdict == "improvement"]
    limits = tolerances(old)
    for name in noisy():
        limit = limits[name].scaled(old.metric("peak"))
        before, after = limit.widened(old.noise(name)).abs, limit.widened(new.noise(name)).abs
        if after > before:
            rows.append(made(f"baseline {name} tolerance", format_bytes(before),
                             format_bytes(after), True))
    rows += [made(p.name, *p.stated, p.loosens) for p in policy_changes(old, new)]
    return rows or [made("baseline", "recorded", "re-recorded, within tolerance", False)]


def baseline_changes(old: Baselines, new: Baselines,
                     commits: dict[PurePosixPath, str] | None = None) -> list[YardstickChange]:
    """Every committed baseline the pull request adds, removes or rewrites; `commits`: the
    head's commit (its SHA) that last changed each file, which the comment names beside the
    pull request (never the name the file carries, nor git's author: both are the pull
    request's word)."""
    changes = []
    for path in rewritten(old, new):
        before, after = old.get(path), new.get(path)
        commit = (commits or {}).get(path)
        if after is None:
            assert before is not None
            changes.append(YardstickChange(before.label, "baseline", "recorded", "removed", True))
            continue
        refused = _refusal(after)
        if refused is not None:
            changes.append(YardstickChange(
                after.label, "baseline", "recorded" if before else "(none)",
                "rewritten" if before else "added", True, after.recorded, refused, commit))
        elif before is None or before.key != after.key or before.backend != after.backend:
            changes.append(YardstickChange(after.label, "baseline", "(none)", "added", False,
                                           after.recorded, commit=commit))
        else:
            changes += _changed(before, after, commit)
    return changes


def _yardstick(comparison: Comparison) -> list[YardstickChange]:
    """What the head's runs change against the base: tolerances, expectations and thresholds
    they carry differently, and variants the base has that the head no longer runs."""
    changes = [YardstickChange(e.label, p.name, *p.stated, p.loosens)
               for e in comparison.entries for p in e.policy]
    return changes + [YardstickChange(e.label, "variant", "in the suite", "removed", True)
                      for e in comparison.having(REMOVED)]


def _accept(entry: VariantComparison, new: Summary, commit: str | None,
            accepted: bool) -> VariantComparison:
    """Accept a metric regression whose baseline the pull request re-records to what its run
    measures, where the acceptance is given; else say what is missing. `commit`: the head's
    commit that re-recorded it (its SHA)."""
    reason = new.recorded.reason if new.recorded else ""
    said = f" ({': '.join(filter(None, (commit, reason)))})" if commit or reason else ""
    if accepted:
        return replace(entry, accepted=True,
                       note=f"accepted: the pull request re-records its baseline{said}")
    return replace(entry, note=f"its baseline is re-recorded here{said}: a maintainer accepts "
                               f"it with the {ACCEPT_LABEL} label")


def _listed_once(changes: list[YardstickChange], entries: Iterable[VariantComparison],
                 rerecorded: dict[tuple, tuple[Summary, str | None]], accepted: bool
                 ) -> tuple[tuple[VariantComparison, ...], list[YardstickChange]]:
    """The entries, each re-recorded one saying who re-recorded it and why, and whether it is
    accepted; and the changes, less each re-recorded figure that its variant's row already
    shows: where a baseline is re-recorded to what the run measures, `baseline peak 1 → 3 MiB`
    is the delta row `peak 1 → 3 MiB` again. A run that does not match its new baseline keeps
    both and fails."""
    shown: dict[str, set[str]] = {}
    judged = []
    for entry in entries:
        new, commit = (rerecorded.get((*entry.head.key, entry.head.backend), (None, None))
                       if entry.head else (None, None))
        if new is None or entry.head is None or entry.failure is not None:
            pass
        elif compare([new], [entry.head]).regressions:
            entry = replace(entry, note="its run does not match the baseline this pull request "
                                        "records either")
        else:
            shown[entry.label] = {f"baseline {d.metric}" for d in entry.changed}
            if entry.verdict == "regression":
                entry = _accept(entry, new, commit, accepted)
        judged.append(entry)
    return tuple(judged), [c for c in changes if c.what not in shown.get(c.label, set())]


def _measured(comparison: Comparison,
              defined: tuple[Definitions, Definitions]) -> list[YardstickChange]:
    """Each change the head's scenario files make to what a compared variant measures (its
    model, workload, components, sampling, server): all loosen, as the old figures no longer
    judge the same thing."""
    return [YardstickChange(e.label, f"scenario {path}", before, after, True)
            for e in comparison.having(COMPARED)
            if e.key in defined[0] and e.key in defined[1]
            for path, before, after in differences(defined[0][e.key], defined[1][e.key])]


def judge(comparison: Comparison, old: Baselines, new: Baselines, accepted: bool,
          defined: tuple[Definitions, Definitions] = ({}, {}),
          commits: dict[PurePosixPath, str] | None = None,
          flags: tuple[dict[str, float], dict[str, float]] = ({}, {})) -> Comparison:
    """`comparison` (the head's runs against the baselines at the base) with the changes the
    pull request makes to them, each listed once, and the acceptance applied. `defined`: what
    the scenario files ask at the base and at the head (harness.gate.definition); `commits`:
    the head's commit behind each baseline file; `flags`: the command line's tolerances."""
    comparison = identity.still_defined(comparison, defined[1])
    comparison, changes = identity.renames(comparison, defined, *flags)
    changes += baseline_changes(old, new, commits) + _measured(comparison, defined)
    comparison, changes = yardstick.judged(comparison, changes)  # model folder, runner, start-up
    seen = {(c.label, c.what, c.old, c.new) for c in changes}
    changes += [c for c in _yardstick(comparison) if (c.label, c.what, c.old, c.new) not in seen]
    refused = {c.label for c in changes if c.refused}
    rerecorded = {(*new[path].key, new[path].backend): (new[path], (commits or {}).get(path))
                  for path in rewritten(old, new)
                  if path in new and new[path].label not in refused}
    entries, listed = _listed_once(changes, comparison.entries, rerecorded, accepted)
    return replace(comparison, entries=entries, changes=tuple(listed), accepted=accepted)
