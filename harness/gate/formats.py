"""The renderings of a comparison: every `--format` by name (`RENDERERS`), and those for
machines: JSON and JUnit XML.

Each is a function from a `Comparison` to text; `compare` and `baseline check` take their
`--format` choices from the registry, `gate pr` writes markdown, JSON and JUnit. The JSON
carries `schema` (JSON_SCHEMA) and the verdict; the JUnit XML follows the junit-10 schema
(Jenkins xUnit): every required attribute, a `failure` per regression and an `error` per run
that failed in the head.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from datetime import datetime, timezone

from ..judge.summary import Noise
from .compare import COMPARED, FAILED, Comparison, MetricDelta, VariantComparison
from .escape import plain
from .event import Acceptance
from .identity import RENAMED
from .listing import why_not
from .policy import YardstickChange
from .render import (
    failed_expectations,
    findings,
    format_pair,
    format_percent,
    format_tolerance,
    format_value,
    headline,
    reasons,
    render_markdown,
    render_text,
    tolerance_source,
)

JSON_SCHEMA = 1  # the version of render_json's layout; bumped when a field changes meaning


def _noise_json(noise: Noise | None) -> dict | None:
    return None if noise is None else {"spread": noise.spread, "runs": noise.runs}


def _metric_json(d: MetricDelta) -> dict:
    """A metric's delta, the tolerance applied (with the spread or the scenario size that set
    it, if one did) and the spread each side recorded."""
    tolerance = {"rel": d.tolerance.rel, "abs": d.tolerance.abs, "source": tolerance_source(d.tolerance),
                 "noise": _noise_json(d.tolerance.noise), "size": d.tolerance.size,
                 "text": format_tolerance(d.metric, d.tolerance)}
    return {"base": d.base, "head": d.head, "delta": d.delta, "relative": d.relative,
            "new": d.new, "verdict": d.verdict, "tolerance": tolerance,
            "noise": {"base": _noise_json(d.base_noise), "head": _noise_json(d.head_noise)}}


def _entry_json(entry: VariantComparison) -> dict:
    return {
        "scenario": entry.scenario, "variant": entry.variant, "state": entry.state,
        "verdict": entry.verdict, "accepted": entry.accepted, "failure": entry.failure,
        "note": entry.note, "policy": [p.name for p in entry.policy],
        "base": str(entry.base.path) if entry.base else None,
        "head": str(entry.head.path) if entry.head else None,
        "metrics": {d.metric: _metric_json(d) for d in entry.deltas},
        "findings": findings(entry), "failed_expectations": failed_expectations(entry),
        "not_recorded": entry.not_recorded,
    }


def _change_json(change: YardstickChange, accepted: bool) -> dict:
    recorded = change.recorded
    status = "renamed" if change.what == RENAMED else change.status(accepted)
    return {"variant": change.label, "what": change.what, "old": change.old, "new": change.new,
            "loosens": change.loosens, "status": status,
            "why": why_not(change, accepted) or None,
            "recorded": None if recorded is None else
            {"by": recorded.by, "at": recorded.at, "reason": recorded.reason},
            "commit": change.commit}


def _pull_json(acceptance: Acceptance | None) -> dict | None:
    """Who's who, as the pull request's event gave it (None: no event, a local run)."""
    event = acceptance.event if acceptance else None
    if acceptance is None or event is None:
        return None
    return {"number": event.number, "author": event.author, "head_sha": event.head,
            "labelled": event.labelled, "label_actor": acceptance.actor or None,
            "label_given_for": acceptance.given_for or None}


def render_json(comparison: Comparison) -> str:
    return json.dumps({"schema": JSON_SCHEMA, "verdict": comparison.verdict,
                       "exit_status": comparison.exit_code, "headline": headline(comparison),
                       "head_failure": comparison.head_failure,
                       "artifact_url": comparison.artifact_url, "notes": comparison.notes,
                       "policy_changes": {e.label: [p.name for p in e.policy]
                                          for e in comparison.policy_changes},
                       "accepted": comparison.accepted,
                       "pull_request": _pull_json(comparison.acceptance),
                       "changes": [_change_json(c, comparison.accepted) for c in comparison.changes],
                       "entries": [_entry_json(e) for e in comparison.entries]}, indent=1) + "\n"


def _seconds(entry: VariantComparison) -> float:
    """How long the head's run of a variant took (0 when it has none)."""
    wall = entry.head.metrics.get("wall_s") if entry.head else None
    return wall if isinstance(wall, (int, float)) and wall >= 0 else 0.0


def render_junit(comparison: Comparison) -> str:
    """One test case per variant: a regression is a `failure`, a head run that failed where the
    base ran an `error`, one-sided or incomparable variants are `skipped`. A head that produced
    no summaries adds a `head` case with an `error`. Valid against junit-10.xsd: testsuite
    carries name, tests, failures and errors (required), skipped, time and timestamp; testcase
    name, classname and time."""
    cases = []
    for entry in comparison.entries:
        case = ET.Element("testcase", name=plain(entry.variant),
                          classname=f"kvmem.{plain(entry.scenario)}", time=f"{_seconds(entry):.3f}")
        note = plain(entry.note)
        if entry.verdict == "regression" and entry.state == FAILED:
            ET.SubElement(case, "error", message=note, type="run-failed").text = note
        elif entry.verdict == "regression":
            details = [f"{d.metric}: {' -> '.join(format_pair(d))} "
                       f"({format_value(d.metric, d.delta, True)}, {format_percent(d)})"
                       for d in entry.changed if d.verdict == "regression"]
            text = details + reasons(entry, code="")
            if comparison.artifact_url:
                text.append(f"plots: {comparison.artifact_url}")
            message = "; ".join(details) or plain(entry.failure or note)
            ET.SubElement(case, "failure", message=message, type="memory-regression").text = "\n".join(text)
        elif entry.state != COMPARED:
            ET.SubElement(case, "skipped", message=f"{entry.state}: {note}".rstrip(": "))
        cases.append(case)
    rejected = [plain(f"{c.label} {c.what} {c.old} -> {c.new}: {why_not(c, comparison.accepted)}")
                for c in comparison.rejected]
    if rejected:
        case = ET.Element("testcase", name="yardstick", classname="kvmem", time="0.000")
        ET.SubElement(case, "failure", message=rejected[0],
                      type="rejected-change").text = "\n".join(rejected)
        cases.append(case)
    if comparison.head_failure is not None:
        case = ET.Element("testcase", name="head", classname="kvmem", time="0.000")
        message = plain(headline(comparison).removeprefix("🔴 kvmem: "))
        ET.SubElement(case, "error", message=message, type="head-failed").text = message
        cases.append(case)
    count = {kind: str(sum(c.find(kind) is not None for c in cases))
             for kind in ("failure", "error", "skipped")}
    seconds = f"{sum(_seconds(e) for e in comparison.entries):.3f}"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    suite = ET.Element("testsuite", name="kvmem-memory", tests=str(len(cases)),
                       failures=count["failure"], errors=count["error"],
                       skipped=count["skipped"], time=seconds, timestamp=stamp)
    suite.extend(cases)
    root = ET.Element("testsuites", name="kvmem", tests=str(len(cases)),
                      failures=count["failure"], errors=count["error"], time=seconds)
    root.append(suite)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


RENDERERS = {"text": render_text, "markdown": render_markdown, "json": render_json,
             "junit": render_junit}
