"""The head's side of the pull-request check: its summaries, read from the reports the pull
request's workflow wrote (`--from`) or measured here, each worked out again from its rows by the
judge (harness.gate.rejudge) under the head's scenario files, read once as data
(harness.gate.definition.HeadFiles) for that and for what they ask.

A head that cannot even start (a scenario refused, a component that crashes on import) gives no
summaries and its error, so that the comment still says what happened.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ..common.errors import BadInput, no_summaries
from ..judge.summary import Summary, exit_status
from ..pipeline.selection import variants
from ..report import console as term
from ..store.summaries import read_summary, summaries_under
from .definition import HeadFiles, Key
from .form import as_gated
from .rejudge import recomputed


@dataclass(frozen=True)
class Head:
    """The head's summaries as the judge recomputed them, with why each its rows contradict
    fails, its scenario files, and why it could not start (then it has no summaries)."""

    summaries: tuple[Summary, ...]
    refused: Mapping[Key, str]
    files: HeadFiles
    error: str | None = None

    @property
    def status(self) -> int:
        """The runs' own exit status, as `kvmem run` gives it: 2 where one did not complete
        (or none started), 1 where one broke its expectations."""
        return 2 if self.error is not None else exit_status(list(self.summaries))


def measured(paths: Sequence[str], source: str | None, reports: Path, jobs: int, top: Path,
             errors: Console) -> Head:
    """The head's summaries, read from the reports under `source` or measured here (under
    `reports`, `jobs` at once, progress and failures on `errors`), recomputed from their rows.
    A head measured here is judged from the files its runs wrote, read as `--from` reads them
    (CI judges those)."""
    try:
        if source:
            found = summaries_under(source)
            if not found:
                raise no_summaries([source])
        else:
            chosen = as_gated(variants(paths, console=errors))
    except BadInput as exc:
        if source:
            raise
        errors.print(f"error: {escape(str(exc))}", highlight=False)
        return Head((), {}, HeadFiles(top, paths), str(exc))
    if not source:
        from ..pipeline.suite import run_variants

        ran = run_variants(chosen, reports, errors, jobs=jobs)
        errors.print(term.results(ran))
        term.failures(errors, ran)
        found = [read_summary(s.path) if s.path.is_file() else s for s in ran]
    files = HeadFiles(top, paths)
    again = recomputed(found, files.spec)
    return Head(tuple(again.summaries), again.refused, files)
