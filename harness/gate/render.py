"""Renderings of a comparison: terminal text, a pull-request comment, JSON and JUnit XML.

Each is a function from a `Comparison` to text, registered in `RENDERERS` under its `--format`
name; `compare` and `baseline check` take their `--format` choices from that registry.

The markdown comment is read by a maintainer in a few seconds: the verdict first, then only what
changed; the rest is folded. It starts with a hidden marker so a workflow can find and update
its own comment, and is capped at COMMENT_LIMIT characters, well under GitHub's 65,536.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from ..metrics import METRICS
from ..summary_io import Noise
from ..units import format_bytes
from .compare import COMPARED, FAILED, INCOMPARABLE, NEW, REMOVED, Comparison, Entry, MetricDelta, Tolerance

MARKER = "<!-- kvmem-memory-delta -->"
COMMENT_LIMIT = 50_000
ICONS = {"regression": "🔴", "improvement": "🟢", "unchanged": "⚪"}
STATE_TITLES = {NEW: "🆕 New", REMOVED: "🗑️ Removed", FAILED: "💥 Failed",
                INCOMPARABLE: "⛔ Not compared"}
BLOCKS = "▁▂▃▄▅▆▇█"


def format_value(metric: str, value: float, signed: bool = False) -> str:
    if metric == "overhead_ratio":
        return f"{value:+.3f}" if signed else f"{value:.3f}×"
    text = format_bytes(value, signed)
    return f"{text}/req" if metric == "leak_rate" else text


def _exact(delta: MetricDelta) -> str:
    """The exact byte delta where the human form rounds it."""
    if delta.metric == "overhead_ratio" or abs(delta.delta) < 1024:
        return ""
    return f" ({delta.delta:+,.0f} B)"


def format_tolerance(metric: str, tolerance: Tolerance) -> str:
    """`256 B`, `64 MiB and 10%`, `12 MiB (measured spread 8 MiB over 5 runs)`: what a change
    had to exceed, and where that came from when it was measured rather than configured."""
    text = f"{tolerance.abs:g}" if metric == "overhead_ratio" else format_bytes(tolerance.abs)
    if tolerance.rel:
        text += f" and {tolerance.rel * 100:g}%"
    if tolerance.noise is not None:
        text += (f" (measured spread {format_bytes(tolerance.noise.spread)} over "
                 f"{tolerance.noise.runs} runs)")
    return text


def format_percent(delta: MetricDelta) -> str:
    if delta.relative is None:
        return "from 0" if delta.delta else "0%"
    percent = delta.relative * 100
    return f"{percent:+.3f}%" if 0 < abs(percent) < 0.1 else f"{percent:+.1f}%"


def format_pair(delta: MetricDelta) -> tuple[str, str]:
    """Base and head in human units, or in exact bytes where the units would hide the change."""
    pair = format_value(delta.metric, delta.base), format_value(delta.metric, delta.head)
    if pair[0] == pair[1] and delta.metric != "overhead_ratio":
        return f"{delta.base:,.0f} B", f"{delta.head:,.0f} B"
    return pair


def sparkline(values: list[float], lo: float, hi: float) -> str:
    """One block character per value on the shared scale [lo, hi]."""
    span = hi - lo
    if span <= 0:
        return BLOCKS[0] * len(values)
    return "".join(BLOCKS[min(7, int((v - lo) / span * 8))] for v in values)


def headline(comparison: Comparison) -> str:
    compared = comparison.having(COMPARED)
    regressed, improved = comparison.regressions, comparison.improvements
    if regressed:
        text = f"🔴 kvmem: memory regression in {len(regressed)} of {_count(comparison.entries)}"
    elif improved:
        text = f"🟢 kvmem: memory improved in {_count(improved)}, no regression"
    elif compared:
        text = f"✅ kvmem: no change ({_count(compared)} compared)"
    else:
        text = "⚠️ kvmem: nothing compared"
    others = [f"{len(e)} {s}" for s in (NEW, REMOVED, FAILED, INCOMPARABLE)
              if (e := comparison.having(s))]
    return text + (f"; {', '.join(others)}" if others else "")


def _count(entries: list[Entry]) -> str:
    return f"{len(entries)} variant{'s' if len(entries) != 1 else ''}"


def _changed_rows(comparison: Comparison) -> list[tuple[Entry, MetricDelta]]:
    order = {"regression": 0, "improvement": 1}
    rows = [(e, d) for e in comparison.entries for d in e.changed]
    return sorted(rows, key=lambda r: (order[r[1].verdict], r[0].label, METRICS.index(r[1].metric)))


def _state_lines(comparison: Comparison, code: str = "`", most: int = 20) -> list[str]:
    """One line per state (new, removed, ...) naming at most `most` variants."""
    lines = []
    for state, title in STATE_TITLES.items():
        entries = comparison.having(state)
        if entries:
            names = ", ".join(f"{code}{e.label}{code}" + (f" ({e.note})" if e.note else "")
                              for e in entries[:most])
            more = f" and {len(entries) - most} more" if len(entries) > most else ""
            lines.append(f"{title} ({len(entries)}): {names}{more}")
    return lines


def _noise_lines(comparison: Comparison, code: str = "`", most: int = 20) -> list[str]:
    """One line naming the tolerances that measured run-to-run noise widened past the floor."""
    widened = [f"{code}{e.label}{code} {d.metric} {format_tolerance(d.metric, d.tolerance)}"
               for e in comparison.entries for d in e.deltas if d.tolerance.noise is not None]
    if not widened:
        return []
    more = f" and {len(widened) - most} more" if len(widened) > most else ""
    names = ", ".join(widened[:most])
    return [f"📏 Tolerance from measured noise ({len(widened)}): {names}{more}"]


def render_text(comparison: Comparison) -> str:
    lines = [headline(comparison)]
    lines += [f"note: {n}" for n in comparison.notes]
    for entry, d in _changed_rows(comparison):
        base, head = format_pair(d)
        lines.append(f"  {d.verdict:<11} {entry.label:<40} {d.metric:<14} {base:>12} -> "
                     f"{head:>12}  {format_value(d.metric, d.delta, True)} ({format_percent(d)})"
                     f"  tolerance {format_tolerance(d.metric, d.tolerance)}")
    lines += [f"  {line}" for line in _state_lines(comparison, code="")
              + _noise_lines(comparison, code="")]
    return "\n".join(lines) + "\n"


def _spark_rows(entry: Entry, width: int) -> list[str]:
    series = [((s.data.get("series") or {}).get("active") or []) if s else []
              for s in (entry.base, entry.head)]
    if not all(series):
        return []
    lo, hi = min(min(s) for s in series), max(max(s) for s in series)
    return [f"{label:<{width}} {side} {sparkline(s, lo, hi)} max {format_bytes(max(s))}"
            for label, side, s in ((entry.label, "base", series[0]), ("", "head", series[1]))]


def render_markdown(comparison: Comparison, limit: int = COMMENT_LIMIT) -> str:
    changed = _changed_rows(comparison)
    sections: list[tuple[list[str], list[str], list[str]]] = [
        ([MARKER, f"### {headline(comparison)}", ""] + [f"> ⚠️ {n}" for n in comparison.notes]
         + ([""] if comparison.notes else []), [], [])]
    if changed:
        sections.append((["| | variant | metric | base | head | Δ | Δ % | tolerance |",
                          "|:-:|---|---|--:|--:|--:|--:|--:|"],
                         [f"| {ICONS[d.verdict]} | `{e.label}` | {d.metric} | "
                          f"{' | '.join(format_pair(d))} | "
                          f"**{format_value(d.metric, d.delta, True)}**{_exact(d)} | {format_percent(d)} | "
                          f"{format_tolerance(d.metric, d.tolerance)} |"
                          for e, d in changed], [""]))
    states = _state_lines(comparison) + _noise_lines(comparison)
    if states:
        sections.append(([], [f"- {line}" for line in states], [""]))
    sparked = {e.label: e for e, _ in changed}
    width = max((len(label) for label in sparked), default=0)
    sparks = [line for e in sparked.values() for line in _spark_rows(e, width)]
    if sparks:
        sections.append((["Active memory per step, base vs head on one scale:", "```text"],
                         sparks, ["```", ""]))
    rest = [e for e in comparison.having(COMPARED) if not e.changed]
    if rest:
        sections.append(([f"<details><summary>{_count(rest)} unchanged</summary>", "",
                          "| variant | " + " | ".join(METRICS) + " |",
                          "|---|" + "--:|" * len(METRICS)],
                         [f"| `{e.label}` | " + " | ".join(
                             format_value(d.metric, d.head) for d in e.deltas) + " |"
                          for e in rest], ["", "</details>", ""]))
    return _fit(sections, limit)


def _fit(sections: list[tuple[list[str], list[str], list[str]]], limit: int) -> str:
    """Join sections, dropping rows once the limit is near; the closing lines always fit."""
    note = "_Truncated: {} more rows; the full comparison is in the uploaded reports._"
    reserve = sum(len(line) + 1 for _, _, tail in sections for line in tail) + len(note) + 16
    lines: list[str] = []
    left, dropped = limit - reserve, 0
    for head, rows, tail in sections:
        cost = sum(len(line) + 1 for line in head)
        if dropped or cost > left:
            dropped += len(rows) or 1
            continue
        lines += head
        left -= cost
        for row in rows:
            if dropped or len(row) + 1 > left:
                dropped += 1
                continue
            lines.append(row)
            left -= len(row) + 1
        lines += tail
    if dropped:
        lines.append(note.format(dropped))
    return "\n".join(lines) + "\n"


def _noise_json(noise: Noise | None) -> dict | None:
    return None if noise is None else {"spread": noise.spread, "runs": noise.runs}


def _metric_json(d: MetricDelta) -> dict:
    """A metric's delta, the tolerance applied (with the spread that set it, if one did) and
    the spread each side recorded."""
    tolerance = {"rel": d.tolerance.rel, "abs": d.tolerance.abs,
                 "source": "configured" if d.tolerance.noise is None else "measured noise",
                 "noise": _noise_json(d.tolerance.noise),
                 "text": format_tolerance(d.metric, d.tolerance)}
    return {"base": d.base, "head": d.head, "delta": d.delta, "relative": d.relative,
            "verdict": d.verdict, "tolerance": tolerance,
            "noise": {"base": _noise_json(d.base_noise), "head": _noise_json(d.head_noise)}}


def _entry_json(entry: Entry) -> dict:
    return {
        "scenario": entry.scenario, "variant": entry.variant, "state": entry.state,
        "verdict": entry.verdict, "note": entry.note,
        "base": str(entry.base.path) if entry.base else None,
        "head": str(entry.head.path) if entry.head else None,
        "metrics": {d.metric: _metric_json(d) for d in entry.deltas},
    }


def render_json(comparison: Comparison) -> str:
    return json.dumps({"verdict": comparison.verdict, "headline": headline(comparison),
                       "notes": comparison.notes,
                       "entries": [_entry_json(e) for e in comparison.entries]}, indent=1) + "\n"


def render_junit(comparison: Comparison) -> str:
    """One test case per variant: regressions fail, one-sided or incomparable ones are skipped."""
    suite = ET.Element("testsuite", name="kvmem-memory", tests=str(len(comparison.entries)),
                       failures=str(len(comparison.regressions)),
                       skipped=str(sum(e.state != COMPARED and e.verdict != "regression"
                                       for e in comparison.entries)))
    for entry in comparison.entries:
        case = ET.SubElement(suite, "testcase", classname=f"kvmem.{entry.scenario}",
                             name=entry.variant)
        if entry.verdict == "regression":
            details = [f"{d.metric}: {' -> '.join(format_pair(d))} "
                       f"({format_value(d.metric, d.delta, True)}, {format_percent(d)})"
                       for d in entry.changed if d.verdict == "regression"]
            message = "; ".join(details) or entry.note
            ET.SubElement(case, "failure", message=message, type="memory-regression").text = \
                "\n".join(details + ([entry.note] if entry.note else []))
        elif entry.state != COMPARED:
            ET.SubElement(case, "skipped", message=f"{entry.state}: {entry.note}".rstrip(": "))
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


RENDERERS = {"text": render_text, "markdown": render_markdown, "json": render_json,
             "junit": render_junit}


def render(comparison: Comparison, fmt: str) -> str:
    return RENDERERS[fmt](comparison)
