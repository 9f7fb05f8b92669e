"""The judge's own verdict on the head's reports: each summary's figures, findings and
expectations worked out again from the rows its report folder holds, with the judge's code and
the scenario as the judge reads it, never taken from summary.json.

In CI the head is measured by the pull request's own code, so a summary.json is its word: a
measured process (or the head's kvmem) could lower a peak, drop a finding or pass an
expectation there. Its rows (samples.csv, holders.csv) are what the probe sampled; the judge
applies the recipe the run applies (harness.judge.verdict) to them and to the head's scenario
file parsed as data. What only the run knows (its status, wall time, the size check's
estimate, the model it served, its environment) is taken from summary.json as data.

A summary that disagrees with its rows on a gated figure, a finding, an expectation or whether
it passed was rewritten, or written by another kvmem than the judge's (a pull request that
changes kvmem's own detectors): the variant fails, its entry saying where (`refuse`), unless the
maintainers accept it; accepted or not, it is judged from its rows. A report whose
rows are missing or unreadable, or whose variant the head's files do not define, cannot be
judged: the variant fails as a run that did not complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..common.echo import clip
from ..common.errors import BadInput
from ..judge.detectors import AppliedDetect
from ..judge.metrics import METRICS, RunFacts, gated
from ..judge.records import Expectation, Finding
from ..judge.summary import Series, Summary
from ..judge.verdict import SERVED, judge
from ..scenario import ScenarioSpec
from ..store.rows import judged_rows
from .compare import FAILED, Comparison
from .policy import ACCEPT_LABEL

Key = tuple[str, str]  # scenario, variant
SHOWN = 3  # disagreements a refusal spells out


@dataclass
class Rejudged:
    """The head's summaries as the judge recomputed them, and why each rewritten one fails."""

    summaries: list[Summary] = field(default_factory=list)
    refused: dict[Key, str] = field(default_factory=dict)


def rejudged(summary: Summary, folder: Path, spec: ScenarioSpec) -> Summary:
    """`summary` with its figures, findings, expectations, holders, pass and judged thresholds
    worked out from the rows in `folder` under `spec`; the run's own facts kept as written.
    Rows missing or unreadable are bad input naming the file."""
    from ..report.plots import series

    samples, holders = judged_rows(folder)
    served = summary.status in SERVED and not samples.empty
    facts = RunFacts(summary.metric("wall_s") or 0.0, int(summary.metric("estimate") or 0),
                     summary.model.weights if summary.model is not None else None)
    verdict = judge(samples if served else None, holders, spec.detect, spec.expect, facts,
                    summary.environment)
    of_run = {name: value for name, value in summary.metrics.items()
              if name in METRICS and METRICS[name].of_run}
    metrics = {name: of_run[name] if METRICS[name].of_run else value
               for name, value in verdict.metrics.items()
               if not METRICS[name].of_run or name in of_run}
    return summary.replace(metrics=metrics, findings=verdict.findings,
                           expectations=verdict.expectations,
                           passed=verdict.held and summary.ok,
                           compare=spec.expect.compare,
                           detect=AppliedDetect.of(spec.detect),
                           series=Series(active=series(samples)),
                           **({"holders": verdict.holders} if verdict.holders is not None
                              or summary.holders is not None else {}))


def disagreements(written: Summary, rows: Summary) -> list[str]:
    """Where summary.json says otherwise than its rows: each gated figure, then the findings,
    the expectations and the pass, as `summary.json says X; its rows give Y`."""
    said = []
    for name in gated():
        old, new = written.metrics.get(name), rows.metrics.get(name)
        if old != new:
            said.append((f"{name} {_figure(name, old)}", _figure(name, new)))
    if written.findings != rows.findings:
        said.append((_findings(written.findings), _findings(rows.findings)))
    if written.expectations != rows.expectations:
        said.append((_expectations(written.expectations), _expectations(rows.expectations)))
    if written.passed != rows.passed:
        said.append(("it passed" if written.passed else "it failed",
                     "a pass" if rows.passed else "a failure"))
    return [f"summary.json says {old}; its rows give {new}" for old, new in said]


def _figure(name: str, value: object) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return METRICS[name].format(value)
    return "none" if value is None else repr(value)


def _findings(findings: list[Finding]) -> str:
    """`findings retained (4 MiB at step 12), leak (+1 MiB a request)`, or `no finding`."""
    if not findings:
        return "no finding"
    return "findings " + ", ".join(
        f"{f.kind} ({f.severity}: {clip(f.message, 80)})" for f in findings)


def _expectations(expectations: list[Expectation]) -> str:
    failed = [e.describe() for e in expectations if not e.ok]
    held = len(expectations) - len(failed)
    return f"{held} expectation{'s' if held != 1 else ''} held" + (
        f", failed: {'; '.join(failed)}" if failed else "")


def refusal(found: list[str]) -> str:
    """What a rewritten summary's entry says: the first disagreements, and how it is judged."""
    more = len(found) - SHOWN
    return ("; ".join(found[:SHOWN]) + (f" (and {more} more)" if more > 0 else "")
            + ": judged from the rows. The summary was rewritten, or written by other judging "
            f"code than the judge's (a pull request that changes kvmem's detectors or metrics): "
            f"it needs the `{ACCEPT_LABEL}` label")


def recomputed(summaries: Iterable[Summary],
               spec_of: Callable[[Summary], ScenarioSpec]) -> Rejudged:
    """Every summary recomputed from its report folder's rows under the spec `spec_of` gives
    (bad input where it has none); one that cannot be recomputed fails as a run that did not
    complete, with the reason (a run that failed already keeps its own)."""
    result = Rejudged()
    for summary in summaries:
        try:
            again = rejudged(summary, summary.path.parent, spec_of(summary))
        except BadInput as exc:
            result.summaries.append(summary if not summary.ok else summary.replace(
                status="failed", passed=False,
                error=f"the judge cannot recompute it: {exc}"))
            continue
        found = disagreements(summary, again)
        if found:
            result.refused[summary.key] = refusal(found)
        result.summaries.append(again)
    return result


def refuse(comparison: Comparison, refused: Mapping[Key, str]) -> Comparison:
    """Fail each variant whose summary.json its rows contradict, saying where, unless the
    maintainers accept it (the head's own kvmem judges otherwise): either way its figures were
    judged from the rows, so the acceptance hides no regression."""
    entries, notes = [], list(comparison.notes)
    for entry in comparison.entries:
        why = None if entry.head is None else refused.get(entry.head.key)
        if why is not None and entry.head is not None and comparison.accepted:
            notes.append(f"{entry.head.label}: {why}: accepted")
        elif why is not None:
            entry = replace(entry, state=FAILED, refusal=why, accepted=False)
        entries.append(entry)
    return replace(comparison, entries=tuple(entries), notes=tuple(notes))
