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
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath

from ..common.echo import clip
from ..scenario.load import ScenarioError, definitions

Key = tuple[str, str]  # scenario, variant
Definitions = dict[Key, dict]  # each variant's spec as JSON, name and description left out

# The fields that say what a variant measures (expectations, thresholds and tolerances are
# judged apart, with whether a change loosens them: harness.gate.policy).
MEASURED = ("engine", "server", "model", "cache", "workload", "sampling", "timeout")
UNSTATED = "(none)"


def read(files: Iterable[PurePosixPath], source: Callable[[PurePosixPath], bytes | None],
         notes: list[str], side: str) -> Definitions:
    """The variants defined by `files` (paths under the repository's top), each read with
    `source` (None: not there on that side). A file that does not parse is noted, not fatal:
    its variants are then judged by their summaries alone."""
    found: Definitions = {}
    for file in sorted(set(files)):
        data = source(file)
        if data is None:
            continue
        try:
            specs = definitions(Path(file), data)
        except ScenarioError as exc:
            notes.append(f"{side}: {clip(str(exc), 300)}")
            continue
        for name, spec in specs.items():
            dumped = spec.model_dump(mode="json", exclude={"name", "description"})
            found[(spec.name, name)] = _traced(dumped, source)
    return found


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
