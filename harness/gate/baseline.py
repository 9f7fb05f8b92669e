"""Committed baselines: where `baseline update` records summaries and `baseline check` finds them.

Baselines live under `<dir>/<backend>/<scenario>/<variant>.json`, one summary each, because
figures from different backends never compare. Each file is written atomically, so an
interrupted update leaves every baseline either old or new, never half written. The three path
components come from the summary, which may be hand-written: each must be one plain name, so
an update never writes outside its folder.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path, PurePosixPath, PureWindowsPath

from ..summary_io import Summary, atomic_text, checked, load_summaries
from .compare import CompareError


def _unsafe(component: object) -> str | None:
    """Why a backend, scenario or variant name cannot be one path component, or None."""
    if not isinstance(component, str):
        return "is not a string"
    if not component:
        return "is empty"
    if component in (".", ".."):
        return "is a relative folder"
    if "/" in component or "\\" in component:
        return "contains a path separator"
    if PurePosixPath(component).is_absolute() or PureWindowsPath(component).anchor:
        return "is an absolute path"
    if any(unicodedata.category(c) == "Cc" for c in component):
        return "contains a control character"
    return None


def baseline_path(root: Path, summary: Summary) -> Path:
    """`root/<backend>/<scenario>/<variant>.json`; refuses names that would leave `root`."""
    parts = {"environment.backend": summary.backend, "scenario": summary.data["scenario"],
             "variant": summary.data["variant"]}
    for field, value in parts.items():
        reason = _unsafe(value)
        if reason:
            raise CompareError(f"{summary.path}: {field} {value!r} {reason}: it must be one "
                               "plain name to place a baseline")
    backend, scenario, variant = parts.values()
    return root / backend / scenario / f"{variant}.json"


def store(summaries: list[Summary], root: Path) -> tuple[list[Path], list[Summary]]:
    """Write the summaries of completed runs as baselines; return the paths and the runs left out.

    Every summary is checked before the first is written, so bad input records nothing.
    """
    planned, skipped = [], []
    for summary in summaries:
        if not summary.ok:
            skipped.append(summary)
            continue
        planned.append((baseline_path(root, checked(summary)), summary))
    for path, summary in planned:
        try:
            atomic_text(path, json.dumps(summary.data, indent=2) + "\n")
        except OSError as exc:
            raise CompareError(f"{path}: cannot write: {exc.strerror or exc}") from None
    return [path for path, _ in planned], skipped


def load_baselines(root: Path, head: list[Summary], partial: bool) -> list[Summary]:
    """The baselines to compare `head` with: those of its backends, and with `partial` (a run of
    some scenarios only) those of its scenarios, so the others are not listed as removed."""
    base: list[Summary] = []
    for backend in sorted({s.backend for s in head}):
        folder = root / backend
        if not folder.is_dir():
            raise CompareError(f"{folder}: no baselines for backend {backend} (record them "
                               "with `python -m harness baseline update`)")
        base += load_summaries(folder)
    if partial:
        ran = {s.data["scenario"] for s in head}
        base = [s for s in base if s.data["scenario"] in ran]
    return base
