"""Names that become one path component: a scenario's and a variant's (reports/<scenario>/
<variant>/), and a backend's (baselines/<backend>/<scenario>/<variant>.json).

One set of rules for all of them, so a name a scenario may have is one its report and its
baseline can be placed under, and a hand-written summary cannot name a folder outside them.
Callers phrase the flaw as their messages need it.
"""

from __future__ import annotations

from enum import Enum
from pathlib import PureWindowsPath

MAX_NAME = 100


class Flaw(Enum):
    """Why a name cannot be one path component, as "<name> <value>" says it."""

    NOT_TEXT = "is not a string"
    EMPTY = "is empty"
    TOO_LONG = f"is longer than {MAX_NAME} characters"
    CONTROL = "contains a control character"
    RELATIVE = "is a relative folder"
    SEPARATOR = "contains a path separator"
    LEADING_DOT = "starts with '.'"
    SPACES = "has leading or trailing spaces"
    ABSOLUTE = "is an absolute path"


def flaw(name: object) -> Flaw | None:
    """The first rule `name` breaks as one plain path component, or None when it breaks none."""
    if not isinstance(name, str):
        return Flaw.NOT_TEXT
    if not name:
        return Flaw.EMPTY
    if len(name) > MAX_NAME:
        return Flaw.TOO_LONG
    if not name.isprintable():
        return Flaw.CONTROL
    if name in (".", ".."):
        return Flaw.RELATIVE
    if "/" in name or "\\" in name:
        return Flaw.SEPARATOR
    if name.startswith("."):
        return Flaw.LEADING_DOT
    if name != name.strip():
        return Flaw.SPACES
    if PureWindowsPath(name).anchor:  # a drive, "C:name"
        return Flaw.ABSOLUTE
    return None
