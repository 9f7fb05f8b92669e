"""The yardstick's changes and the acceptance, as the comment and the terminal list them: the
renamed variants, the changes that fail the check, those that pass, and who changed and accepted
them, from the pull request's event (harness.gate.event) and never from git's author.
"""

from __future__ import annotations

from .compare import Comparison
from .escape import as_name, esc, md, named, plain, verbatim
from .identity import RENAMED
from .policy import ACCEPT_LABEL, YardstickChange


def why_not(change: YardstickChange, accepted: bool) -> str:
    """Why a change fails the check, or "" when it passes."""
    status = change.status(accepted)
    if status == "refused":
        return f"refused: {change.refused}"
    if status == "needs acceptance":
        return f"loosens the check: needs the `{ACCEPT_LABEL}` label"
    return ""


def _status(change: YardstickChange, comparison: Comparison) -> str:
    """`accepted by @bob` where the event names who accepted, else the change's status."""
    status = change.status(comparison.accepted)
    actor = comparison.acceptance.actor if comparison.acceptance else ""
    return f"accepted by @{actor}" if status == "accepted" and actor else status


def _changed_in(change: YardstickChange, comparison: Comparison, markdown: str = "") -> str:
    """Where the change was made: the pull request and its author as the event gives them, and
    the head's commit that last changed the baseline file (a fact git gives; never its author,
    which the pull request writes)."""
    sha = as_name(change.commit, markdown) if change.commit else ""
    event = comparison.acceptance.event if comparison.acceptance else None
    if event is None:
        return sha
    return f"#{event.number} by @{event.author}" + (f", {sha}" if sha else "")


def _reason(change: YardstickChange, markdown: str = "") -> str:
    return esc(change.recorded.reason, markdown) if change.recorded else ""


def _renamed(comparison: Comparison) -> list[YardstickChange]:
    return [c for c in comparison.changes if c.what == RENAMED]


def _judged(comparison: Comparison) -> list[tuple[YardstickChange, str]]:
    """The changes other than renames, each with why it fails the check ("" when it passes)."""
    return [(c, why_not(c, comparison.accepted)) for c in comparison.changes
            if c.what != RENAMED]


def acceptance_lines(comparison: Comparison, markdown: str = "`") -> list[str]:
    """What the comment says of identities and of the label: that a local run has no event,
    who accepted this commit, or that the label was given for another commit."""
    acceptance = comparison.acceptance
    if acceptance is None:
        return []
    event = acceptance.event
    if event is None:
        return ["no pull-request event: identities unknown, acceptance from --accept"]
    label, this = as_name(ACCEPT_LABEL, markdown), as_name(event.head[:12], markdown)
    if acceptance.accepted:
        return [f"✅ accepted by @{acceptance.actor} for this commit {this} (the {label} label)"]
    if event.labelled and acceptance.actor:
        given = (as_name(acceptance.given_for[:12], markdown) if acceptance.given_for
                 else "no measured commit")
        return [f"⚠️ the {label} label was applied by @{acceptance.actor} for {given}, not for "
                f"this commit {this}: apply it again"]
    return []


def change_lines(comparison: Comparison) -> list[str]:
    """The yardstick's changes as text: renames, those that fail the check, then those that
    pass."""
    changes = _judged(comparison)
    lines = [f"renamed: {plain(c.old)} -> {plain(c.new)}" for c in _renamed(comparison)]
    lines += [f"rejected change: {named(c.label, '')} {plain(c.what)} {plain(c.old)} -> "
              f"{plain(c.new)}: {plain(why)}" for c, why in changes if why]
    for change, why in changes:
        if not why:
            where, reason = _changed_in(change, comparison), _reason(change)
            said = f" (changed in {where}{': ' + reason if reason else ''})" if where else ""
            lines.append(f"{_status(change, comparison)} change: {named(change.label, '')} "
                         f"{plain(change.what)} {plain(change.old)} -> {plain(change.new)}{said}")
    return lines


def change_sections(comparison: Comparison) -> list[tuple[list[str], list[str], list[str]]]:
    """Markdown: the renamed variants, the changes that fail the check, then those that pass
    (old -> new, where they were made and why)."""
    sections = []
    if renamed := _renamed(comparison):
        sections.append((["#### ↪️ Renamed variants (each judged by its old baseline)", "",
                          "| old name | new name |", "|---|---|"],
                         [f"| {verbatim(c.old)} | {verbatim(c.new)} |" for c in renamed], [""]))
    changes = _judged(comparison)
    columns = lambda c: (f"| {named(c.label)} | {md(c.what)} | {md(c.old)} | {md(c.new)} |")
    origin = lambda c: f"{_changed_in(c, comparison, '`')} | {_reason(c, '`')} |"
    if failing := [(c, why) for c, why in changes if why]:
        sections.append((["#### ⛔ Changes to the yardstick that fail the check", "",
                          "| variant | what | old | new | why | changed in | reason |",
                          "|---|---|--:|--:|---|---|---|"],
                         [f"{columns(c)} {md(why) if c.refused else why} | {origin(c)}"
                          for c, why in failing], [""]))
    if passing := [c for c, why in changes if not why]:
        sections.append((["#### ✅ Changes that pass the check", "",
                          "| variant | what | old | new | status | changed in | reason |",
                          "|---|---|--:|--:|---|---|---|"],
                         [f"{columns(c)} {_status(c, comparison)} | {origin(c)}"
                          for c in passing], [""]))
    return sections
