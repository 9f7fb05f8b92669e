"""Which of the head's summaries answers for which of the base's variants, decided by the judge.

A summary says which backend produced it and which scenario and variant it is, in the words of
the code that ran: the pull request's. The judge does not let those words choose what it is
compared with:

- the backend is the check's (`gate pr --backend`, by default the one this machine runs MLX
  on): a summary from any other backend is refused, and the base's baselines of that backend
  are what the head must answer for;
- a variant the base has, still defined in the head's scenario files but with no summary, has
  failed (its run left nothing), never "removed" and never "new";
- a variant defined exactly as a removed one, under a new name, is a rename: it is compared
  with the old variant's baseline, and the rename is listed.
"""

from __future__ import annotations

from dataclasses import replace

from ..common.echo import spelled
from ..judge.summary import Summary
from .compare import FAILED, NEW, REMOVED, Comparison, VariantComparison, compare
from .definition import Definitions
from .policy import YardstickChange

RENAMED = "variant name"  # a change's `what` where a variant is renamed (old → new label)


def off_backend(comparison: Comparison, head: list[Summary], backend: str) -> Comparison:
    """Fail each head summary that names another backend than the check's: on the base's entry
    for that variant where there is one (it stays without a head summary), else on its own."""
    entries = list(comparison.entries)
    index = {e.key: at for at, e in enumerate(entries)}
    for summary in head:
        if summary.backend == backend:
            continue
        at = index.get(summary.key)
        if at is None:
            entries.append(VariantComparison(*summary.key, FAILED, None, summary))
            at = len(entries) - 1
        entries[at] = replace(
            entries[at], state=FAILED,
            refusal=(f"the head's run reports backend {spelled(summary.backend)}; this check "
                     f"judges backend {backend} (gate pr --backend), so it is compared with "
                     "nothing and fails"))
    return replace(comparison, entries=tuple(entries))


def still_defined(comparison: Comparison, head: Definitions) -> Comparison:
    """A base variant without a head summary that the head's files still define has failed."""
    failed = lambda e: replace(e, state=FAILED, refusal=(
        "the head still defines this variant, but its run left no summary to judge"))
    return replace(comparison, entries=tuple(
        failed(e) if e.state == REMOVED and e.key in head else e for e in comparison.entries))


def renames(comparison: Comparison, defined: tuple[Definitions, Definitions],
            rel: dict[str, float], abs_: dict[str, float]
            ) -> tuple[Comparison, list[YardstickChange]]:
    """Pair each new variant with the removed one defined exactly as it is: the new one is
    compared with the old one's baseline, and the rename is a listed change (it loosens
    nothing: the old baseline still judges it)."""
    removed = {e.key: e for e in comparison.having(REMOVED) if e.key in defined[0]}
    entries = list(comparison.entries)
    changes = []
    for entry in comparison.having(NEW):
        if entry.head is None or entry.key not in defined[1]:
            continue
        old = next((e for key, e in removed.items() if defined[0][key] == defined[1][entry.key]),
                   None)
        if old is None or old.base is None:
            continue
        del removed[old.key]
        paired = compare([old.base.replace(scenario=entry.scenario, variant=entry.variant)],
                         [entry.head], rel, abs_).entries[0]
        paired = replace(paired, base=old.base, note=f"renamed from {spelled(old.label)}")
        entries = [paired if e is entry else e for e in entries if e is not old]
        changes.append(YardstickChange(entry.label, RENAMED, spelled(old.label),
                                       spelled(entry.label), False))
    return replace(comparison, entries=tuple(entries)), changes
