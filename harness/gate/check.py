"""`kvmem gate pr` as one use case: a pull request's head judged against the baselines
committed at its base, with every change it makes to that yardstick (harness.gate.pr).

The command line parses its arguments into a `PullRequest` and renders what `check` returns;
everything between is here: the revisions and the event (who's who, whose acceptance), the
head's summaries (harness.gate.head), the baselines on both sides, read from the results store
(the base's from git, never from the working tree), what the scenario files ask on both sides
(harness.gate.definition), and the comparison, built step by step, each step returning a new one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from rich.console import Console

from ..common.errors import BadInput
from ..judge.summary import Summary
from ..store import git
from ..store.summaries import Baselines, baselines_at, baselines_in
from . import event, identity, pr
from .compare import Comparison, compare, head_failed
from .definition import Definitions, read, repository_path
from .form import unordered
from .head import measured
from .rejudge import refuse
from .tolerance import flags


@dataclass(frozen=True)
class PullRequest:
    """What `kvmem gate pr` is asked, as its command line gives it: nothing is read yet."""

    base: str  # --base: the target branch's revision
    paths: tuple[str, ...]  # the scenario files or folders the check covers
    baselines: str = "baselines"  # --dir, the baselines folder in the working tree
    source: str | None = None  # --from: judge the reports there instead of running
    reports: str = "reports"  # where the head's runs write their reports
    jobs: int = 1
    backend: str | None = None  # whose baselines judge the head; None: this machine's
    event: str | None = None  # the pull request's event (JSON), which decides the acceptance
    accept: bool = False  # a local run's acceptance, where there is no event
    rel: tuple[str, ...] = ()  # --rel METRIC=X, as given
    abs_: tuple[str, ...] = ()  # --abs METRIC=SIZE, as given
    artifact_url: str | None = None  # where the run's plots are, for the comment to link


def check(request: PullRequest, errors: Console) -> Comparison:
    """The head's runs (or its reports) against the baselines committed at the base, with the
    changes the head makes to them and the acceptance applied; `errors`: where the head's runs
    report progress and failures. Its `pr_status` is the command's exit status."""
    top = git.toplevel(Path.cwd())
    sha = git.commit(request.base, top)
    acceptance = event.decide(_event(request, sha, top), request.accept)
    root = Path(request.baselines).resolve()
    if top not in (root, *root.parents):
        raise BadInput(f"--dir {request.baselines}: not inside the repository at {top}")
    folder = PurePosixPath(root.relative_to(top).as_posix())
    backend = request.backend or _this_backend()
    head = measured(request.paths, request.source, Path(request.reports), request.jobs, top,
                    errors)
    on = [s for s in head.summaries if s.backend == backend]
    notes = [f"{name}: open-loop traffic gated as an ordered replay, arrival times ignored "
             "(workload.http.gate)"
             for name in sorted({s.scenario for s in on if s.model and s.model.ordered})]
    # The results store: the base's baselines from git at its commit, the head's from the tree.
    base = baselines_at(sha, top, folder, f"{request.base}:{folder}")
    defined = (_base_definitions(base, sha, top, notes),
               head.files.defined((s.scenario_file for s in head.summaries), notes))
    new = baselines_in(root, request.baselines)
    old, new = (_kept(found, on, defined[1], request.paths, backend) for found in (base, new))
    rel, abs_ = flags(request.rel, request.abs_)
    if head.error is not None:
        comparison = head_failed(list(old.values()), head.error)
    else:
        comparison = compare(list(old.values()), on, rel, abs_)
        comparison = unordered(identity.off_backend(comparison, list(head.summaries), backend),
                               defined[1])
        commits = {path: git.last_change(top, folder / path) for path in pr.rewritten(old, new)}
        comparison = refuse(pr.judge(comparison, old, new, acceptance.accepted, defined, commits,
                                     (rel, abs_)), head.refused)
    return replace(comparison, notes=(*comparison.notes, *notes), acceptance=acceptance,
                   artifact_url=request.artifact_url, runs_status=head.status)


def _kept(found: Baselines, on: list[Summary], defined: Definitions, paths: tuple[str, ...],
          backend: str) -> Baselines:
    """The baselines of the check's backend that answer for what it covers: the scenarios the
    head ran or defines, and those whose scenario file lies under the check's paths."""
    names = {s.scenario for s in on} | {key[0] for key in defined}
    covered = [PurePosixPath(os.path.normpath(os.path.relpath(p))) for p in paths]
    return {path: s for path, s in found.items() if s.backend == backend and (
        s.scenario in names or pr.selected([s], covered, {backend}))}


def _event(request: PullRequest, base: str, top: Path) -> event.Event | None:
    """The pull request's event (`--event`), checked to be about this comparison: its base
    commit is --base's and its head the commit checked out. None for a local run."""
    if request.event is None:
        return None
    if request.accept:
        raise BadInput("--accept: the acceptance comes from --event (the label's actor and the "
                       "commit it was applied for); give one or the other")
    found = event.load(Path(request.event))
    head = git.commit("HEAD", top)
    for name, sha, expected in (("base_sha", found.base, base), ("head_sha", found.head, head)):
        if sha != expected:
            raise BadInput(f"{request.event}: pull_request.{name} {sha[:12]} is not the commit "
                           f"judged here ({expected[:12]})")
    return found


def _this_backend() -> str:
    from ..run.environment import backend

    return backend()


def _base_definitions(baselines: Baselines, sha: str, top: Path, notes: list[str]) -> Definitions:
    """What the scenario files behind the base's baselines asked, read from git at the base."""
    files = {f for s in baselines.values()
             if (f := repository_path(s.scenario_file, top)) is not None}
    return read(files, lambda f: git.file(sha, top, f), notes, "base")
