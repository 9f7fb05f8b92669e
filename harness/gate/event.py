"""Who is who in a pull request, and which commit its acceptance is for: the facts the judge's
workflow reads from GitHub's API into a small JSON file (`gate pr --event FILE`), and the
decision kvmem makes from them.

Nothing here comes from git: a commit's author and committer are whatever the pull request
wrote. The pull request's author changed its baselines; the actor of the label's last
application accepted them, for the commit that was the pull request's head at that moment, the
`head_sha` of the latest measurement run created at or before it. A later push, even of a
commit measured before, needs the label again.

The file (`"schema": 1`):

    {"schema": 1,
     "pull_request": {"number": 12, "author": "alice", "base_sha": "...", "head_sha": "..."},
     "label": {"name": "memory-accepted", "on": true,
               "applied": [{"actor": "bob", "at": "2026-01-01T00:05:00Z"}]},
     "pushes": [{"sha": "...", "at": "2026-01-01T00:00:00Z"}]}

`head_sha` is the commit measured; `pushes` are the measurement workflow's `pull_request`
runs for the pull request's head repository and branch (`head_sha`, `created_at`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from ..common.errors import BadInput
from .policy import ACCEPT_LABEL

SCHEMA = 1
_SHA = re.compile(r"[0-9a-f]{40}")
_LOGIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,38}(?:\[bot\])?")
T = TypeVar("T")


class EventError(BadInput):
    """An event file kvmem cannot use, naming the file and the field."""


@dataclass(frozen=True)
class Stamp:
    """Who did something, or which commit was pushed, and when."""

    what: str  # a login (an application of the label) or a commit SHA (a push)
    at: datetime


@dataclass(frozen=True)
class Event:
    """The pull request as GitHub's API gives it when the verdict is given."""

    number: int
    author: str
    base: str
    head: str  # the commit measured and judged
    label: str
    labelled: bool  # the label is on the pull request now
    applied: tuple[Stamp, ...]  # each application of the label (actor, time)
    pushes: tuple[Stamp, ...]  # each measurement run (head SHA, creation time)

    def given_for(self) -> tuple[str, Stamp | None]:
        """The commit the label's last application accepts ("" when none: no label, or one
        applied before any push was measured), and that application."""
        if not self.labelled or not self.applied:
            return "", None
        last = max(self.applied, key=lambda s: s.at)
        before = [p for p in self.pushes if p.at <= last.at]
        return (max(before, key=lambda p: p.at).what if before else ""), last


@dataclass(frozen=True)
class Acceptance:
    """What the judge applies and the comment says: from the event, or (a local run, no event)
    from `--accept` with nobody named. `actor` applied the label last, for `given_for` (""
    when no measured push preceded it)."""

    accepted: bool
    event: Event | None = None
    actor: str = ""
    given_for: str = ""


def decide(event: Event | None, accepted: bool) -> Acceptance:
    """The acceptance the judge applies: the event's decision where there is one (the command
    line refuses `--accept` beside it), else `--accept`."""
    if event is None:
        return Acceptance(accepted)
    sha, last = event.given_for()
    return Acceptance(last is not None and sha == event.head, event,
                      last.what if last else "", sha)


_JSON = {dict: "an object", list: "a list", str: "a string", int: "a whole number",
         bool: "true or false"}  # a field's type, as JSON names it


def _at(where: str, name: str) -> str:
    """A field's place: `file: pushes` at the top of the file, `file: label.name` below."""
    return f"{where} {name}" if where.endswith(":") else f"{where}.{name}"


def _field(data: object, name: str, kind: type[T], where: str) -> T:
    value = data.get(name) if isinstance(data, dict) else None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise EventError(f"{_at(where, name)}: expected {_JSON[kind]}, got {_shown(value)}")
    return value


def _shown(value: object) -> str:
    return json.dumps(value)[:60]


def _matching(data: object, name: str, pattern: re.Pattern, what: str, where: str) -> str:
    value = _field(data, name, str, where)
    if not pattern.fullmatch(value):
        raise EventError(f"{_at(where, name)}: not {what}: {_shown(value)}")
    return value


def _time(data: object, where: str) -> datetime:
    text = _field(data, "at", str, where)
    try:
        at: datetime | None = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        at = None
    if at is None or at.tzinfo is None:
        raise EventError(f"{_at(where, 'at')}: not a time with its zone: {_shown(text)}")
    return at


def _stamps(data: object, name: str, key: str, pattern: re.Pattern, what: str,
            where: str) -> tuple[Stamp, ...]:
    """Each `{key: ..., "at": ...}` of the list `name`."""
    items = _field(data, name, list, where)
    return tuple(Stamp(_matching(item, key, pattern, what, f"{_at(where, name)}[{i}]"),
                       _time(item, f"{_at(where, name)}[{i}]"))
                 for i, item in enumerate(items))


def parse(data: object, where: str) -> Event:
    """An event from its JSON; EventError names `where` and the field at fault."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise EventError(f"{where}: schema: expected {SCHEMA} (an event written for this kvmem)")
    top = f"{where}:"
    pull = _field(data, "pull_request", dict, top)
    label = _field(data, "label", dict, top)
    at, tag = f"{where}: pull_request", f"{where}: label"
    name = _field(label, "name", str, tag)
    if name != ACCEPT_LABEL:
        raise EventError(f"{tag}.name: expected {ACCEPT_LABEL}, got {_shown(name)}")
    number = _field(pull, "number", int, at)
    if number <= 0:
        raise EventError(f"{at}.number: expected a positive number, got {number}")
    return Event(number, _matching(pull, "author", _LOGIN, "a GitHub login", at),
                 _matching(pull, "base_sha", _SHA, "a full commit SHA", at),
                 _matching(pull, "head_sha", _SHA, "a full commit SHA", at), name,
                 _field(label, "on", bool, tag),
                 _stamps(label, "applied", "actor", _LOGIN, "a GitHub login", tag),
                 _stamps(data, "pushes", "sha", _SHA, "a full commit SHA", top))


def load(path: Path) -> Event:
    """The event file at `path`."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise EventError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise EventError(f"{path}: not JSON: {exc}") from None
    return parse(data, str(path))
