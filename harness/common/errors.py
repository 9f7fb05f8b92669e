"""Bad input: one error type for every refusal kvmem makes (exit 2), and one message for each
kind of refusal that several commands share.

Each part of kvmem raises its own subclass (a scenario's, a summary's, a report folder's...),
so its callers can tell them apart; the command line catches `BadInput` alone and prints its
message, which names the file and the field, on one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


class BadInput(ValueError):
    """Input kvmem refuses: a scenario, a summary, an option, a folder it cannot use."""


def no_summaries(paths: Iterable[str | Path]) -> BadInput:
    """Folders or files that hold no summary where a command needs one."""
    return BadInput(f"{', '.join(map(str, paths))}: no summaries found")


def cannot_write(path: str | Path, exc: OSError) -> BadInput:
    """A file or folder kvmem cannot write, with the system's reason."""
    return BadInput(f"{path}: cannot write: {exc.strerror or exc}")
