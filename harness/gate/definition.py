"""What each variant asks to measure, read by the judge from the scenario files themselves:
the base's from git at the base commit, the head's from the working tree, both as data (no
component is imported, nothing of the pull request runs).

A pull request's summaries say what its runs did, in its own code's words; these say what its
files ask. So a variant whose model, workload, components, sampling or server changed is seen
as changed even where the head's summaries do not record that field, a variant that is still
defined but produced no summary is known to have failed rather than to be gone, and a variant
defined exactly as a removed one under a new name is known as a rename.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath

from ..common.echo import clip
from ..common.errors import BadInput
from ..judge.summary import Summary
from ..scenario import ScenarioSpec
from ..scenario.load import ScenarioError, definitions, discover

Key = tuple[str, str]  # scenario, variant
Definitions = dict[Key, dict]  # each variant's spec as JSON, name and description left out
# A file's variants by name, or why it cannot be read (BadInput) or parsed (ScenarioError).
Parsed = dict[str, ScenarioSpec] | BadInput

# The fields that say what a variant measures (expectations, thresholds and tolerances are
# judged apart, with whether a change loosens them: harness.gate.policy).
MEASURED = ("engine", "server", "model", "cache", "workload", "sampling", "timeout")
UNSTATED = "(none)"


def read(files: Iterable[PurePosixPath], source: Callable[[PurePosixPath], bytes | None],
         notes: list[str], side: str) -> Definitions:
    """The variants defined by `files` (paths under the repository's top), each read with
    `source` (None: not there on that side)."""
    return described({file: _parsed(file, source(file)) for file in set(files)}, source, notes,
                     side)


def _parsed(file: PurePosixPath, data: bytes | None) -> Parsed:
    if data is None:
        return BadInput(f"{file}: not there")
    try:
        return definitions(Path(file), data)
    except ScenarioError as exc:
        return exc


def described(parsed: Mapping[PurePosixPath, Parsed],
              source: Callable[[PurePosixPath], bytes | None], notes: list[str],
              side: str) -> Definitions:
    """The variants of the files `parsed` (paths under the repository's top), in path order.
    A file that does not parse is noted, not fatal: its variants are then judged by their
    summaries alone; one that is not there defines none."""
    found: Definitions = {}
    for specs in (parsed[file] for file in sorted(parsed)):
        if isinstance(specs, ScenarioError):
            notes.append(f"{side}: {clip(str(specs), 300)}")
        if isinstance(specs, BadInput):
            continue
        for name, spec in specs.items():
            dumped = spec.model_dump(mode="json", exclude={"name", "description"})
            found[(spec.name, name)] = _traced(dumped, source)
    return found


class HeadFiles:
    """The head's scenario files, each read and parsed as data once per check: those under the
    check's paths, which judge its reports first, and those its summaries name. A file inside
    the repository is parsed under its path there, as the base's are (its trace is named from
    there); one outside under the path given."""

    def __init__(self, top: Path, paths: Sequence[str]) -> None:
        self.top = top
        try:
            self.covered = sorted(discover(paths))
        except BadInput:
            self.covered = []
        self._parsed: dict[tuple[str, bool], Parsed] = {}
        self._specs: dict[Key, ScenarioSpec] | None = None

    def inside(self, given: Path) -> PurePosixPath | None:
        """The file's path under the top of the repository; None when it lies outside."""
        return repository_path(str(given.resolve()), self.top)

    def parsed(self, given: Path) -> Parsed:
        name = self.inside(given)
        key = (str(given if name is None else name), name is not None)
        if key not in self._parsed:
            try:
                data = given.read_bytes()
            except OSError as exc:
                self._parsed[key] = BadInput(f"{given}: cannot read: {exc.strerror or exc}")
            else:
                self._parsed[key] = _parsed(PurePosixPath(key[0]), data)
        return self._parsed[key]

    def spec(self, summary: Summary) -> ScenarioSpec:
        """The spec of the summary's variant in the files under the check's paths (the first
        that defines it), else in the file the summary names, whose errors are raised (a file
        elsewhere cannot stand in for one the check covers); bad input where none defines it."""
        if self._specs is None:
            self._specs = {}
            for file in self.covered:
                if not isinstance(specs := self.parsed(file), BadInput):
                    for name, spec in specs.items():
                        self._specs.setdefault((spec.name, name), spec)
        found = self._specs.get(summary.key)
        if found is None and summary.scenario_file:
            specs = self.parsed(Path(summary.scenario_file))
            if isinstance(specs, BadInput):
                raise specs
            found = {(s.name, name): s for name, s in specs.items()}.get(summary.key)
        if found is None:
            raise BadInput(f"no scenario file defines {summary.label} (its summary names "
                           f"{summary.scenario_file or 'none'})")
        return found

    def defined(self, named: Iterable[str | None], notes: list[str]) -> Definitions:
        """What the files under the check's paths and those `named` (by the head's summaries)
        ask, those inside the repository, read from the working tree as data."""
        files = {}
        for given in [*self.covered, *(Path(n) for n in named if n)]:
            if (name := self.inside(given)) is not None:
                files[name] = self.parsed(given)
        return described(files, lambda f: _read(self.top / f), notes, "head")


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _traced(dumped: dict, source: Callable[[PurePosixPath], bytes | None]) -> dict:
    """A replayed trace named with a digest of its bytes on the same side: the requests are
    in that file, not in the scenario's, and a pull request that edits them changes what is
    measured as surely as one that edits the phases."""
    http = (dumped.get("workload") or {}).get("http") or {}
    if http.get("trace"):
        data = source(PurePosixPath(os.path.normpath(http["trace"])))
        digest = "missing" if data is None else f"sha256 {hashlib.sha256(data).hexdigest()[:16]}"
        http["trace"] = f"{http['trace']} ({digest})"
    return dumped


def repository_path(recorded: str | None, top: Path) -> PurePosixPath | None:
    """A summary's `scenario_file` (as given to `run`, relative to where it ran: the top of the
    repository in CI) as a path under `top`; None when it lies outside."""
    if not recorded:
        return None
    full = Path(os.path.normpath(top / recorded))
    try:
        return PurePosixPath(full.relative_to(top).as_posix())
    except ValueError:
        return None


def _leaves(value: object, prefix: str) -> dict[str, object]:
    """Each scalar under `value` by its path: `workload.requests[2].prompt`. An empty mapping
    or list and a null state nothing, as an absent field does (`server.env: {}` is the
    default of no `env`): only what one side states differently is a difference."""
    if isinstance(value, dict):
        return {path: leaf for key, item in value.items()
                for path, leaf in _leaves(item, f"{prefix}.{key}").items()}
    if isinstance(value, list):
        return {path: leaf for index, item in enumerate(value)
                for path, leaf in _leaves(item, f"{prefix}[{index}]").items()}
    return {} if value is None else {prefix: value}


def _shown(value: object) -> str:
    return UNSTATED if value is None else clip(json.dumps(value, separators=(", ", ": ")), 120)


def differences(old: dict, new: dict) -> list[tuple[str, str, str]]:
    """Each measured field that differs, at its most specific path (`workload.requests`):
    (path, old, new), the values as JSON."""
    rows = []
    for field in MEASURED:
        before, after = _leaves(old.get(field), field), _leaves(new.get(field), field)
        for path in [*before, *(p for p in after if p not in before)]:
            if before.get(path) != after.get(path):
                rows.append((path, _shown(before.get(path)), _shown(after.get(path))))
    return rows
