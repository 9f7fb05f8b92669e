"""Summaries as they are stored: a `summary.json`, a report folder of them, a baselines folder
of `*.json` files, in the working tree or committed at a git revision.

Each file's bytes are parsed by `harness.judge.summary.summary_from_bytes`, so a summary read
from disk and one read from git are checked alike and every error names the file.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from ..judge.summary import Summary, SummaryError, summary_from_bytes
from . import StoreError, git

Baselines = dict[PurePosixPath, Summary]  # by path under the baselines folder


def read_summary(path: Path) -> Summary:
    """Load and check one summary, naming the file in every error."""
    try:
        content = Path(path).read_bytes()
    except OSError as exc:
        raise SummaryError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return summary_from_bytes(path, content)


def summaries_under(path: str | Path) -> list[Summary]:
    """Summaries under `path`: a summary file, a report folder, or a baselines folder.

    Folders are walked for `summary.json` files (report layout); a folder holding none is read
    as a baselines folder, where every `*.json` is a summary.
    """
    path = Path(path)
    if path.is_file():
        return [read_summary(path)]
    if not path.is_dir():
        raise SummaryError(f"{path}: no such file or folder")
    try:
        files = _visible(path, "summary.json") or _visible(path, "*.json")
    except OSError as exc:
        raise SummaryError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return [read_summary(f) for f in files]


def _visible(root: Path, pattern: str) -> list[Path]:
    """Files under `root` matching `pattern`, leaving out hidden names at any depth.

    Atomic writes leave `.summary.json.<random>.json` files, and report folders are staged as
    `.<variant>.new.<random>/`, when interrupted: half-written data, never a summary.
    """
    return sorted(f for f in root.rglob(pattern)
                  if not any(part.startswith(".") for part in f.relative_to(root).parts))


def baselines_of(root: Path, backends: set[str], scenarios: set[str] | None = None
                 ) -> list[Summary]:
    """The committed baselines of `backends` in the working tree's folder `root`, of
    `scenarios` only where given (a run of some scenarios: the others are not removed); a
    backend with no folder there is bad input."""
    found: list[Summary] = []
    for backend in sorted(backends):
        folder = root / backend
        if not folder.is_dir():
            raise StoreError(f"{folder}: no baselines for backend {backend} (record them "
                             "with `python -m harness baseline update`)")
        found += summaries_under(folder)
    return found if scenarios is None else [s for s in found if s.scenario in scenarios]


def baselines_in(folder: Path, where: str) -> Baselines:
    """The baselines folder `folder` of the working tree (hidden names left out); `where`
    prefixes each path in errors (`baselines`)."""
    if not folder.is_dir():
        return {}
    try:
        files = {PurePosixPath(f.relative_to(folder).as_posix()): f.read_bytes()
                 for f in _visible(folder, "*.json")}
    except OSError as exc:
        raise SummaryError(f"{folder}: cannot read: {exc.strerror or exc}") from None
    return _parsed(files, where)


def baselines_at(sha: str, top: Path, folder: PurePosixPath, where: str) -> Baselines:
    """The baselines folder `folder` (relative to the top of the tree) as committed at `sha`;
    `where` prefixes each path in errors (`origin/main:baselines`). A commit holds no
    half-written file, so hidden names are read there too."""
    return _parsed(git.files(sha, top, folder), where)


def _parsed(files: dict[PurePosixPath, bytes], where: str) -> Baselines:
    """The `*.json` files of a baselines folder as summaries, in path order."""
    return {path: summary_from_bytes(Path(f"{where}/{path}"), content)
            for path, content in sorted(files.items()) if path.suffix == ".json"}
