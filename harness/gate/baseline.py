"""Committed baselines: where `baseline update` records summaries and `baseline check` finds them.

Baselines live under `<dir>/<backend>/<scenario>/<variant>.json`, one summary each, because
figures from different backends never compare. Each file is written atomically, so an
interrupted update leaves every baseline either old or new, never half written. The three path
components come from the summary, which may be hand-written: each must be one plain name, so
an update never writes outside its folder.

An update rewrites only what changed, so its diff in a pull request shows the intended change
and nothing else: each new summary is compared with the baseline it would replace by the gate
itself (`compare`, the old baseline's tolerances), and the file is rewritten only when a figure
moved beyond tolerance, when the scenario's tolerances, expectations or detector thresholds
changed, or when a repeated measurement's wider spread widens a tolerance the gate applies (a
spread that moved by a few bytes under the floor changes nothing). Every other file keeps its
bytes. Each file written records who recorded it, when, and the reason given (`recorded`),
which `gate pr` shows beside the change. A run that failed is never recorded: neither one that
did not complete (crashed, refused, timed out) nor one whose expectations failed.
"""

from __future__ import annotations

import getpass
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..common.echo import echo
from ..common.errors import cannot_write
from ..common.files import atomic_text
from ..common.names import flaw
from ..common.units import format_bytes
from ..judge.metrics import noisy
from ..judge.summary import Recorded, Summary, SummaryError, checked
from ..store.summaries import read_summary
from .compare import COMPARED, compare, index_summaries
from .policy import policy_changes
from .render import format_value
from .tolerance import CompareError, tolerances


def unsafe_name(component: object) -> str | None:
    """Why a backend, scenario or variant name cannot be one path component, or None."""
    found = flaw(component)
    return None if found is None else found.value


def baseline_path(root: Path, summary: Summary) -> Path:
    """`root/<backend>/<scenario>/<variant>.json`; refuses names that would leave `root`."""
    parts = {"environment.backend": summary.backend, "scenario": summary.scenario,
             "variant": summary.variant}
    for part, value in parts.items():
        reason = unsafe_name(value)
        if reason:
            raise CompareError(f"{summary.path}: {part} {echo(value)} {reason}: it must be one "
                               "plain name to place a baseline")
    backend, scenario, variant = parts.values()
    return root / backend / scenario / f"{variant}.json"


@dataclass
class BaselineWrite:
    """One baseline `update` writes: `added` (none was there) or `updated`, and why."""

    summary: Summary
    path: Path
    action: str
    reasons: list[str] = field(default_factory=list)


@dataclass
class Update:
    """What `update` did: the baselines written, those kept byte for byte, the runs refused."""

    written: list[BaselineWrite] = field(default_factory=list)
    kept: list[Summary] = field(default_factory=list)
    refused: list[tuple[Summary, str]] = field(default_factory=list)


def refusal(summary: Summary) -> str | None:
    """Why a run cannot be a baseline, or None: it did not complete, or its expectations
    failed (a baseline that fails would let the gate call the failure "no change")."""
    if not summary.ok:
        error = (summary.error or "").strip().splitlines()
        return f"{summary.status} ({error[0] if error else 'no error recorded'})"
    if not summary.passed:
        failed = "; ".join(e.describe() for e in summary.failed_expectations) or "passed: false"
        return (f"expectations failed ({failed}); a baseline records only a run that meets "
                "them: fix the run, or state what it should expect in its scenario")
    return None


def _spread_reasons(old: Summary, new: Summary) -> list[str]:
    """The measured spreads the new run records that widen a tolerance beyond what the old
    baseline's spread does (as `compare` applies them: the floor, scaled, widened by 1.5x
    the spread)."""
    reasons = []
    limits = tolerances(old)
    for name in noisy():
        now, limit = new.noise(name), limits[name].scaled(old.metric("peak"))
        if now is not None and limit.widened(now).abs > limit.widened(old.noise(name)).abs:
            reasons.append(f"{name} spread {format_bytes(now.spread)} over {now.runs} runs")
    return reasons


def recorder() -> str:
    """Who records: git's `user.name <user.email>` where set, else the login name."""
    try:
        found = [subprocess.run(["git", "config", key], capture_output=True, text=True,
                                check=False).stdout.strip() for key in ("user.name", "user.email")]
    except OSError:
        found = ["", ""]
    name, email = found
    if name:
        return f"{name} <{email}>" if email else name
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name in this environment
        return "unknown"


def _reasons(old_path: Path, new: Summary) -> list[str]:
    """Why the baseline at `old_path` must be rewritten with `new`; empty when it must not.

    The old baseline is the base of a comparison with the gate's own logic (its tolerances):
    a figure beyond tolerance, a change of tolerances or expectations, a wider measured spread.
    A baseline that cannot be read, or is not a completed run of this variant, is replaced.
    """
    try:
        old = read_summary(old_path)
        tolerances(old)
    except (SummaryError, CompareError) as exc:
        return [f"replaces an unreadable baseline: {exc}"]
    if not old.ok or old.key != new.key or old.backend != new.backend:
        return [f"replaces a baseline of {old.label} with status {old.status}"]
    entry = compare([old], [new]).entries[0]
    if entry.state != COMPARED:
        return [entry.note or entry.state]
    return ([f"{d.metric} {format_value(d.metric, d.delta, True)}" for d in entry.changed]
            + [str(p) for p in policy_changes(old, new)] + _spread_reasons(old, new))


def store(summaries: list[Summary], root: Path, reason: str, by: str) -> Update:
    """Record the summaries of completed runs as baselines, rewriting only what changed; each
    file written carries `recorded: {by, at, reason}`.

    Every summary is checked, and every old baseline compared, before the first is written, so
    bad input records nothing: two summaries of one variant are refused as `compare` refuses
    them (which one to record cannot be guessed).
    """
    index_summaries(summaries)
    result, planned = Update(), []
    for summary in summaries:
        why = refusal(summary)
        if why is not None:
            result.refused.append((summary, why))
            continue
        path = baseline_path(root, checked(summary))
        tolerances(summary)  # a malformed `compare` block is bad input, never recorded
        if not path.exists():
            planned.append(BaselineWrite(summary, path, "added"))
        elif reasons := _reasons(path, summary):
            planned.append(BaselineWrite(summary, path, "updated", reasons))
        else:
            result.kept.append(summary)
    at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for change in planned:
        change.summary = change.summary.replace(recorded=Recorded(by=by, at=at, reason=reason))
        try:
            atomic_text(change.path, change.summary.to_json())
        except OSError as exc:
            raise cannot_write(change.path, exc) from None
        result.written.append(change)
    return result
