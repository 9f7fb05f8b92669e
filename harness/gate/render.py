"""Renderings of a comparison for people: terminal text and a pull-request comment, and the
wording they share with the renderings for machines (harness.gate.formats, where every
rendering is registered under its `--format` name).

The markdown comment is read by a maintainer in a few seconds: the verdict first (and, right
under it, whether the head changed the tolerances or expectations it is judged by), then only
what changed, then why each regressed variant regressed in its own run's words (its findings'
messages, the expectations that fail, a link to the plots); the rest is folded. It starts with
a hidden marker so a workflow can find and update its own comment, and is capped at
COMMENT_LIMIT characters, well under GitHub's 65,536.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..common.units import KiB, exact_bytes, format_bytes
from ..judge.metrics import BYTES, METRICS, gated
from ..judge.records import Holder
from .compare import (
    COMPARED,
    FAILED,
    INCOMPARABLE,
    NEW,
    REMOVED,
    Comparison,
    MetricDelta,
    VariantComparison,
)
from .escape import as_name, esc, md, named, plain, verbatim
from .listing import acceptance_lines, change_lines, change_sections
from .tolerance import SMALL_FRACTION, Tolerance

MARKER = "<!-- kvmem-memory-delta -->"
COMMENT_LIMIT = 50_000
ICONS = {"regression": "🔴", "improvement": "🟢", "unchanged": "⚪"}
STATE_TITLES = {NEW: "🆕 New", REMOVED: "🗑️ Removed", FAILED: "💥 Failed",
                INCOMPARABLE: "⛔ Not compared"}
BLOCKS = "▁▂▃▄▅▆▇█"


def format_value(metric: str, value: float, signed: bool = False) -> str:
    return METRICS[metric].format(value, signed)


def _bytes(metric: str) -> bool:
    return METRICS[metric].unit == BYTES


def _exact(delta: MetricDelta) -> str:
    """The exact byte delta where the human form rounds it."""
    if not _bytes(delta.metric) or abs(delta.delta) < KiB:
        return ""
    return f" ({exact_bytes(delta.delta, signed=True)})"


def format_tolerance(metric: str, tolerance: Tolerance) -> str:
    """`256 B`, `64 MiB and 10%`, `12 MiB (measured spread 8 MiB over 5 runs)`: what a change
    had to exceed, and where that came from when it was measured rather than configured."""
    text = format_bytes(tolerance.abs) if _bytes(metric) else f"{tolerance.abs:g}"
    if tolerance.rel:
        text += f" and {tolerance.rel * 100:g}%"
    if tolerance.noise is not None:
        text += (f" (measured spread {format_bytes(tolerance.noise.spread)} over "
                 f"{tolerance.noise.runs} runs)")
    elif tolerance.size is not None:
        text += f" ({SMALL_FRACTION * 100:g}% of the {format_bytes(tolerance.size)} base peak)"
    return text


def tolerance_source(tolerance: Tolerance) -> str:
    if tolerance.noise is not None:
        return "measured noise"
    return "configured" if tolerance.size is None else "scenario size"


def format_percent(delta: MetricDelta) -> str:
    """`+46.4%`; `new` for a metric that grew from under its floor, where a percentage would
    read in the hundreds of thousands."""
    if delta.new:
        return "new"
    if delta.relative is None:
        return "from 0" if delta.delta else "0%"
    percent = delta.relative * 100
    return f"{percent:+.3f}%" if 0 < abs(percent) < 0.1 else f"{percent:+.1f}%"


def format_pair(delta: MetricDelta) -> tuple[str, str]:
    """Base and head in human units, or in exact bytes where the units would hide the change."""
    pair = format_value(delta.metric, delta.base), format_value(delta.metric, delta.head)
    if pair[0] == pair[1] and _bytes(delta.metric):
        return exact_bytes(delta.base), exact_bytes(delta.head)
    return pair


def sparkline(values: list[float], lo: float, hi: float) -> str:
    """One block character per value on the shared scale [lo, hi]."""
    span = hi - lo
    if span <= 0:
        return BLOCKS[0] * len(values)
    return "".join(BLOCKS[min(7, int((v - lo) / span * 8))] for v in values)


def headline(comparison: Comparison) -> str:
    if comparison.head_failure is not None:
        first = comparison.head_failure
        return "🔴 kvmem: the head failed to run (no summaries)" + (f": {first}" if first else "")
    compared = comparison.having(COMPARED)
    regressed, improved = comparison.regressions, comparison.improvements
    rejected = comparison.rejected
    if regressed:
        text = f"🔴 kvmem: memory regression in {len(regressed)} of {_count(comparison.entries)}"
    elif rejected:
        several = len(rejected) != 1
        text = (f"🔴 kvmem: {len(rejected)} change{'s' if several else ''} to what this pull "
                f"request is judged against cannot pass as {'they are' if several else 'it is'}")
    elif accepted_entries := [e for e in comparison.entries if e.accepted]:
        text = (f"✅ kvmem: memory change accepted in {len(accepted_entries)} of "
                f"{_count(comparison.entries)}")
    elif improved:
        text = f"🟢 kvmem: memory improved in {_count(improved)}, no regression"
    elif compared:
        text = f"✅ kvmem: no change ({_count(compared)} compared)"
    else:
        text = "⚠️ kvmem: nothing compared"
    others = [f"{len(e)} {s}" for s in (NEW, REMOVED, FAILED, INCOMPARABLE)
              if (e := comparison.having(s))]
    if regressed and rejected:
        others.append(f"{len(rejected)} change{'s' if len(rejected) != 1 else ''} rejected")
    if accepted := [c for c in comparison.changes if c.status(comparison.accepted) == "accepted"]:
        others.append(f"{len(accepted)} accepted change{'s' if len(accepted) != 1 else ''}")
    return text + (f"; {', '.join(others)}" if others else "")


def _accepted(entry: VariantComparison, delta: MetricDelta) -> bool:
    """A regression the pull request accepts (it re-records the baseline)."""
    return entry.accepted and delta.verdict == "regression"


def _count(entries: Sequence[VariantComparison]) -> str:
    return f"{len(entries)} variant{'s' if len(entries) != 1 else ''}"


def _changed_rows(comparison: Comparison) -> list[tuple[VariantComparison, MetricDelta]]:
    order = {"regression": 0, "improvement": 1}
    rows = [(e, d) for e in comparison.entries for d in e.changed]
    names = gated()
    return sorted(rows, key=lambda r: (order[r[1].verdict], r[0].label, names.index(r[1].metric)))


def _stated_entry(entry: VariantComparison, code: str) -> str:
    """A variant's label, and why it is in its state where that is known."""
    why = entry.refusal or entry.note
    return named(entry.label, code) + (f" ({esc(why, code)})" if why else "")


def _state_lines(comparison: Comparison, code: str = "`", most: int = 20) -> list[str]:
    """One line per state (new, removed, ...) naming at most `most` variants."""
    lines = []
    for state, title in STATE_TITLES.items():
        entries = comparison.having(state)
        if entries:
            names = ", ".join(_stated_entry(e, code) for e in entries[:most])
            more = f" and {len(entries) - most} more" if len(entries) > most else ""
            lines.append(f"{title} ({len(entries)}): {names}{more}")
    return lines


def _noise_lines(comparison: Comparison, code: str = "`", most: int = 20) -> list[str]:
    """One line naming the tolerances that measured run-to-run noise widened past the floor."""
    widened = [f"{named(e.label, code)} {d.metric} {format_tolerance(d.metric, d.tolerance)}"
               for e in comparison.entries for d in e.deltas if d.tolerance.noise is not None]
    if not widened:
        return []
    more = f" and {len(widened) - most} more" if len(widened) > most else ""
    names = ", ".join(widened[:most])
    return [f"📏 Tolerance from measured noise ({len(widened)}): {names}{more}"]


def _policy_lines(comparison: Comparison, code: str = "`", most: int = 20) -> list[str]:
    """One line naming the variants whose head changes its tolerances or expectations."""
    changed = comparison.policy_changes
    if not changed or comparison.changes:  # `gate pr` lists them with the other changes
        return []
    names = ", ".join(f"{named(e.label, code)} ({', '.join(esc(p.name, code) for p in e.policy)})"
                      for e in changed[:most])
    more = f" and {len(changed) - most} more" if len(changed) > most else ""
    return [f"⚠️ The head changes tolerances or expectations of {_count(changed)}: {names}{more}; "
            "the base's apply"]


def findings(entry: VariantComparison) -> list[dict]:
    """The head's findings, new ones (a kind the base did not report) first:
    `{kind, message, new, held_by}` (`held_by`: who holds its bytes, or "")."""
    if entry.head is None:
        return []
    before = {f.kind for f in entry.base.findings} if entry.base else set()
    found = [{"kind": f.kind, "message": f.message, "new": f.kind not in before,
              "held_by": f.held_by(), "holder": f.holders[0].holder if f.holders else ""}
             for f in entry.head.findings]
    return sorted(found, key=lambda f: not f["new"])


def _as_code(name: str, text: str, markdown: str) -> str:
    """`text` with the holder `name` in it as code where it can be (a name from the server's
    code that a code span cannot hold is escaped as text instead)."""
    if not markdown or not verbatim(name).startswith("`") or name not in text:
        return esc(text, markdown)
    head, _, tail = text.partition(name)
    return f"{md(head)}{verbatim(name)}{md(tail)}"


def _grown(entry: VariantComparison) -> Holder | None:
    """The holder that gained the most since the base run, where both runs walked them."""
    if entry.head is None or entry.base is None:
        return None
    if entry.head.holders is None or entry.base.holders is None:
        return None
    return entry.head.holders.grown_since(entry.base.holders)


def failed_expectations(entry: VariantComparison) -> list[dict]:
    """The head's expectations that fail: `{name, expected, actual, held_in_base}`."""
    if entry.head is None:
        return []
    held = {e.name for e in entry.base.expectations if e.ok} if entry.base else set()
    return [{"name": e.name, "expected": e.expected, "actual": e.actual,
             "held_in_base": e.name in held}
            for e in entry.head.failed_expectations]


def reasons(entry: VariantComparison, code: str = "`") -> list[str]:
    """Why a variant regressed, in its head run's own words."""
    lines = [esc(entry.note, code)] if entry.note and entry.failure is None else []
    lines += [f"finding {as_name(f['kind'], code)}{' (new)' if f['new'] else ''}: "
              f"{esc(f['message'], code)}"
              + (f"; {_as_code(f['holder'], f['held_by'], code)}" if f["held_by"] else "")
              for f in findings(entry)]
    grown = _grown(entry)
    if grown is not None:
        lines.append(f"grew most at rest: {_as_code(grown.holder, grown.holder, code)} "
                     f"(+{format_bytes(grown.bytes)} since the base)")
    lines += [f"expectation {as_name(e['name'], code)} fails: expected "
              f"{esc(e['expected'], code)}, got {esc(e['actual'], code)}"
              + (" (it held in the base)" if e["held_in_base"] else "")
              for e in failed_expectations(entry)]
    return lines


def _accepted_lines(comparison: Comparison, code: str = "`") -> list[str]:
    """One line per variant whose change the pull request accepts, saying how (its note)."""
    return [f"✅ {named(e.label, code)}: {esc(e.note, code)}" for e in comparison.entries
            if e.accepted]


def _explained(comparison: Comparison) -> list[VariantComparison]:
    """The regressed variants whose head ran, and has something to say (findings, failed
    expectations, or plots to link)."""
    return [e for e in comparison.regressions if e.head is not None and e.head.ok
            and (comparison.artifact_url or reasons(e))]


def render_text(comparison: Comparison) -> str:
    lines = [plain(headline(comparison)), *_policy_lines(comparison, code="")]
    lines += [f"note: {plain(n)}" for n in [*acceptance_lines(comparison, ""), *comparison.notes]]
    for entry, d in _changed_rows(comparison):
        base, head = format_pair(d)
        verdict = "accepted" if _accepted(entry, d) else d.verdict
        lines.append(f"  {verdict:<11} {named(entry.label, ''):<40} {d.metric:<14} {base:>12} -> "
                     f"{head:>12}  {format_value(d.metric, d.delta, True)} ({format_percent(d)})"
                     f"  tolerance {format_tolerance(d.metric, d.tolerance)}")
    url = comparison.artifact_url
    for entry in _explained(comparison):
        lines.append(f"  why {named(entry.label, '')}:")
        lines += [f"    {line}" for line in reasons(entry, code="")
                  + ([f"plots: {url}"] if url else [])]
    if url and not _explained(comparison):
        lines.append(f"  plots: {url}")
    lines += [f"  {line}" for line in _state_lines(comparison, code="")
              + _noise_lines(comparison, code="") + change_lines(comparison)
              + _accepted_lines(comparison, code="")]
    return "\n".join(lines) + "\n"


def _spark_rows(entry: VariantComparison, width: int) -> list[str]:
    series = [list(s.series.active) if s and s.series else [] for s in (entry.base, entry.head)]
    if not all(series):
        return []
    lo, hi = min(min(s) for s in series), max(max(s) for s in series)
    return [f"{label:<{width}} {side} {sparkline(s, lo, hi)} max {format_bytes(max(s))}"
            for label, side, s in ((plain(entry.label), "base", series[0]),
                                   ("", "head", series[1]))]


def _fence(lines: list[str]) -> str:
    """A code fence longer than any run of backticks in `lines`, which cannot close it."""
    longest = max((len(run) for line in lines for run in re.findall("`+", line)), default=0)
    return "`" * max(3, longest + 1)


def render_markdown(comparison: Comparison, limit: int = COMMENT_LIMIT) -> str:
    changed = _changed_rows(comparison)
    sections: list[tuple[list[str], list[str], list[str]]] = [
        ([MARKER, f"### {md(headline(comparison))}", ""]
         + [f"> {line}" for line in acceptance_lines(comparison) + _policy_lines(comparison)]
         + [f"> ⚠️ {md(n)}" for n in comparison.notes]
         + ([""] if comparison.notes or comparison.policy_changes or comparison.acceptance
            else []), [], [])]
    if changed:
        sections.append((["| | variant | metric | base | head | Δ | Δ % | tolerance |",
                          "|:-:|---|---|--:|--:|--:|--:|--:|"],
                         [f"| {'✅' if _accepted(e, d) else ICONS[d.verdict]} | {named(e.label)} | "
                          f"{d.metric} | "
                          f"{' | '.join(format_pair(d))} | "
                          f"**{format_value(d.metric, d.delta, True)}**{_exact(d)} | {format_percent(d)} | "
                          f"{format_tolerance(d.metric, d.tolerance)} |"
                          for e, d in changed], [""]))
    sections += change_sections(comparison)
    if accepted := _accepted_lines(comparison):
        sections.append(([], [f"- {line}" for line in accepted], [""]))
    url, explained = comparison.artifact_url, _explained(comparison)
    if explained:
        sections.append((["Why, in the head run's own words:", ""],
                         [line for e in explained for line in
                          [f"- {named(e.label)}"] + [f"  - {reason}" for reason in reasons(e)]
                          + ([f"  - plots: {url}"] if url else [])], [""]))
    elif url:
        sections.append(([f"plots: {url}", ""], [], []))
    states = _state_lines(comparison) + _noise_lines(comparison)
    if states:
        sections.append(([], [f"- {line}" for line in states], [""]))
    sparked = {e.label: e for e, _ in changed}
    width = max((len(plain(label)) for label in sparked), default=0)
    sparks = [line for e in sparked.values() for line in _spark_rows(e, width)]
    if sparks:
        fence = _fence(sparks)
        sections.append((["Active memory per step, base vs head on one scale:", f"{fence}text"],
                         sparks, [fence, ""]))
    rest = [e for e in comparison.having(COMPARED) if not e.changed and e.failure is None]
    if rest:
        names = gated()
        sections.append(([f"<details><summary>{_count(rest)} unchanged</summary>", "",
                          "| variant | " + " | ".join(names) + " |",
                          "|---|" + "--:|" * len(names)],
                         [f"| {named(e.label)} | " + " | ".join(
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
