"""What a variant was measured with beside its scenario, as a change to the yardstick: the model
folder a scenario names by path (its files' digest), the runner class, and the code that runs
before kvmem binds MLX's counters (harness.judge.provenance). The base's side is what its
committed baseline recorded, so a folder gone from the base's checkout is still judged by its
bytes; a baseline recorded before these facts were lists nothing.

A model folder is its bytes, not its path: a folder moved with the same bytes (the scenario's
`model.path` updated) is no change, and the path's own row is dropped; other bytes under the
same path are a change however the scenario reads.
"""

from __future__ import annotations

from dataclasses import replace

from ..judge.provenance import Preloaded, Provenance
from ..judge.summary import Summary
from .compare import Comparison
from .policy import YardstickChange

MODEL_PATH = "scenario model.path"  # the row harness.gate.definition writes for a moved folder
SHOWN = 12  # hex digits of a digest the comment shows
FACTS = ("model_folder", "runner", "preloaded")  # harness.judge.provenance's, by name


def _digest(sha256: str) -> str:
    return sha256 if sha256.startswith("unreadable") else f"digest {sha256[:SHOWN]}…"


def _preloaded(old: list[Preloaded], new: list[Preloaded]) -> list[tuple[str, str, str, bool]]:
    """Each entry added, changed or removed: (what, old, new, loosens). Code added or changed
    before kvmem binds its counters could replace them; one removed runs no more."""
    before = {(p.kind, p.path): p.sha256 for p in old}
    after = {(p.kind, p.path): p.sha256 for p in new}
    rows = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            rows.append((f"{key[0]} {key[1]}",
                         _digest(before[key]) if key in before else "(none)",
                         _digest(after[key]) if key in after else "(removed)",
                         key in after))
    return rows


def differences(base: Provenance, head: Provenance) -> list[tuple[str, str, str, bool]]:
    """What the head was measured with that its baseline was not: (what, old, new, loosens),
    for each fact the baseline recorded."""
    rows = []
    if base.model_folder is not None and head.model_folder is not None \
            and base.model_folder.sha256 != head.model_folder.sha256:
        rows.append((f"model folder {head.model_folder.path}", _digest(base.model_folder.sha256),
                     _digest(head.model_folder.sha256), True))
    if base.runner is not None and head.runner is not None and base.runner != head.runner:
        rows.append(("runner class", str(base.runner), str(head.runner), True))
    if base.preloaded is not None and head.preloaded is not None:
        rows += _preloaded(base.preloaded, head.preloaded)
    return rows


def _moved(base: Summary, head: Summary) -> bool:
    """The same bytes under another path: the base's folder and the head's digest alike."""
    old, new = base.environment.model_folder, head.environment.model_folder
    return old is not None and new is not None and old.sha256 == new.sha256


def _not_recorded(base: Summary, head: Summary) -> tuple[str, ...]:
    return tuple(name for name in FACTS if getattr(base.environment, name) is None
                 and getattr(head.environment, name) is not None)


def judged(comparison: Comparison, changes: list[YardstickChange]
           ) -> tuple[Comparison, list[YardstickChange]]:
    """`changes` with what each compared variant's head was measured with beside its scenario
    listed (each loosens but a removed start-up module), and without the `model.path` row of a
    folder that moved with its bytes; the comparison with each entry saying which facts its
    baseline did not record (`not_recorded`, in the JSON only)."""
    entries, rows = [], []
    for entry in comparison.entries:
        base, head = entry.base, entry.head
        if base is None or head is None:
            entries.append(entry)
            continue
        entries.append(replace(entry, not_recorded=_not_recorded(base, head)))
        if _moved(base, head):
            changes = [c for c in changes if not (c.label == entry.label and c.what == MODEL_PATH)]
        rows += [YardstickChange(entry.label, *row)
                 for row in differences(base.environment, head.environment)]
    return replace(comparison, entries=tuple(entries)), changes + rows
