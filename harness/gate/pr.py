"""The pull-request check (`kvmem gate pr --base REF`): the head's runs against the target
branch's committed baselines, and every change the pull request makes to that yardstick.

A pull request is judged against the baselines committed at REF, read from git: editing its own
`baselines/` cannot change its verdict. What it does change there, and in the tolerances,
expectations, detector thresholds and the set of variants its runs carry, is listed as a
`Change`. A change that tightens passes; one that loosens passes only with the maintainers'
acceptance (the pull request's ACCEPT_LABEL, given to the check as `--accept`); one that can
never be accepted is refused:

- a committed baseline of a run that did not complete or broke its own expectations;
- a baseline changed without the reason `kvmem baseline update --reason` records.

A metric regression against REF passes with the acceptance only where the pull request
re-records that variant's baseline and its run matches the new baseline. A run that fails on
its own (did not complete, broke its expectations: a new variant that fails, a canary that
stopped detecting) is a regression nothing accepts.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from ..common.units import format_bytes
from ..judge.metrics import METRICS, noisy
from ..judge.summary import Summary, SummaryError, summary_from_bytes
from . import identity, yardstick
from .compare import COMPARED, REMOVED, Comparison, Entry, compare
from .definition import Definitions, differences
from .policy import ACCEPT_LABEL, Change, policy_changes
from .render import format_value
from .tolerance import tolerances

Baselines = dict[PurePosixPath, Summary]  # by path under the baselines folder


def parse_baselines(files: dict[PurePosixPath, bytes], where: str) -> Baselines:
    """The `*.json` files of a baselines folder as summaries; `where` prefixes each path in
    errors (`origin/main:baselines`)."""
    return {path: summary_from_bytes(Path(f"{where}/{path}"), content)
            for path, content in sorted(files.items()) if path.suffix == ".json"}


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


def _refusal(summary: Summary) -> str | None:
    if not summary.ok or not summary.passed:
        return ("a baseline must be a run that completed and met its expectations: "
                f"{summary.first_error if not summary.ok else 'its expectations fail'}")
    if summary.recorded is None or not summary.recorded.reason.strip():
        return "recorded without a reason (`kvmem baseline update --reason TEXT` records one)"
    return None


def _changed(old: Summary, new: Summary, commit: str | None) -> list[Change]:
    """What a re-recorded baseline changes, as the gate would judge it (the old one's
    tolerances): each figure recorded worse (by any amount) or better beyond tolerance, each
    tolerance a wider spread widens, each tolerance, expectation or threshold it records
    differently. `commit`: the head's commit that last changed the file."""
    made = lambda what, before, after, loosens: Change(new.label, what, before, after, loosens,
                                                       new.recorded, commit=commit)
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
                     commits: dict[PurePosixPath, str] | None = None) -> list[Change]:
    """Every committed baseline the pull request adds, removes or rewrites; `commits`: the
    head's commit (its SHA) that last changed each file, which the comment names beside the
    pull request (never the name the file carries, nor git's author: both are the pull
    request's word)."""
    changes = []
    for path in sorted(set(old) | set(new)):
        before, after = old.get(path), new.get(path)
        commit = (commits or {}).get(path)
        if before is not None and after is not None and before.to_json() == after.to_json():
            continue
        if after is None:
            assert before is not None
            changes.append(Change(before.label, "baseline", "recorded", "removed", True))
            continue
        refused = _refusal(after)
        if refused is not None:
            changes.append(Change(after.label, "baseline", "recorded" if before else "(none)",
                                  "rewritten" if before else "added", True, after.recorded,
                                  refused, commit))
        elif before is None or before.key != after.key or before.backend != after.backend:
            changes.append(Change(after.label, "baseline", "(none)", "added", False,
                                  after.recorded, commit=commit))
        else:
            changes += _changed(before, after, commit)
    return changes


def _yardstick(comparison: Comparison) -> list[Change]:
    """What the head's runs change against the base: tolerances, expectations and thresholds
    they carry differently, and variants the base has that the head no longer runs."""
    changes = [Change(e.label, p.name, *p.stated, p.loosens)
               for e in comparison.entries for p in e.policy]
    return changes + [Change(e.label, "variant", "in the suite", "removed", True)
                      for e in comparison.having(REMOVED)]


def _accept(entry: Entry, new: Summary, commit: str | None, accepted: bool) -> None:
    """Accept a metric regression whose baseline the pull request re-records to what its run
    measures, where the acceptance is given; else say what is missing. `commit`: the head's
    commit that re-recorded it (its SHA)."""
    reason = new.recorded.reason if new.recorded else ""
    said = f" ({': '.join(filter(None, (commit, reason)))})" if commit or reason else ""
    if accepted:
        entry.accepted = True
        entry.note = f"accepted: the pull request re-records its baseline{said}"
    else:
        entry.note = (f"its baseline is re-recorded here{said}: a maintainer accepts it with the "
                      f"{ACCEPT_LABEL} label")


def _listed_once(changes: list[Change], entries: list[Entry],
                 rerecorded: dict[tuple, tuple[Summary, str | None]],
                 accepted: bool) -> list[Change]:
    """The changes, less each re-recorded figure that its variant's row already shows: where a
    baseline is re-recorded to what the run measures, `baseline peak 1 → 3 MiB` is the delta
    row `peak 1 → 3 MiB` again. The entry says who re-recorded it and why, and whether it is
    accepted; a run that does not match its new baseline keeps both and fails."""
    shown: dict[str, set[str]] = {}
    for entry in entries:
        new, commit = (rerecorded.get((*entry.head.key, entry.head.backend), (None, None))
                       if entry.head else (None, None))
        if new is None or entry.head is None or entry.failure is not None:
            continue
        if compare([new], [entry.head]).regressions:
            entry.note = "its run does not match the baseline this pull request records either"
            continue
        shown[entry.label] = {f"baseline {d.metric}" for d in entry.changed}
        if entry.verdict == "regression":
            _accept(entry, new, commit, accepted)
    return [c for c in changes if c.what not in shown.get(c.label, set())]


def _measured(comparison: Comparison, defined: tuple[Definitions, Definitions]) -> list[Change]:
    """Each change the head's scenario files make to what a compared variant measures (its
    model, workload, components, sampling, server): all loosen, as the old figures no longer
    judge the same thing."""
    return [Change(e.label, f"scenario {path}", before, after, True)
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
    identity.still_defined(comparison, defined[1])
    changes = identity.renames(comparison, defined, *flags)
    changes += baseline_changes(old, new, commits) + _measured(comparison, defined)
    changes = yardstick.judged(comparison, changes)  # model folder, runner, start-up code
    seen = {(c.label, c.what, c.old, c.new) for c in changes}
    changes += [c for c in _yardstick(comparison) if (c.label, c.what, c.old, c.new) not in seen]
    refused = {c.label for c in changes if c.refused}
    rerecorded = {(*s.key, s.backend): (s, (commits or {}).get(path)) for path, s in new.items()
                  if (old.get(path) is None or old[path].to_json() != s.to_json())
                  and s.label not in refused}
    comparison.changes = _listed_once(changes, comparison.entries, rerecorded, accepted)
    comparison.accepted = accepted
    return comparison


def read_tree(folder: Path) -> dict[PurePosixPath, bytes]:
    """The files under a baselines folder in the working tree (hidden names left out)."""
    if not folder.is_dir():
        return {}
    try:
        return {PurePosixPath(f.relative_to(folder).as_posix()): f.read_bytes()
                for f in sorted(folder.rglob("*.json"))
                if not any(part.startswith(".") for part in f.relative_to(folder).parts)}
    except OSError as exc:
        raise SummaryError(f"{folder}: cannot read: {exc.strerror or exc}") from None
