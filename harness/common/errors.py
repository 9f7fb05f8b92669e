"""The root of every error kvmem raises on purpose, `KvmemError`; under it bad input, one error
type for every refusal kvmem makes (exit 2), and one message for each kind of refusal that
several commands share.

Each part of kvmem raises its own subclass (a scenario's, a summary's, a report folder's...),
so its callers can tell them apart; the command line catches `BadInput` alone and prints its
message, which names the file and the field, on one line. A run that fails (`RunFailure`, in
harness.run.engines) and kvmem's other errors derive from `KvmemError` too, each beside the
standard exception its callers catch (ValueError, RuntimeError), which it stays.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


class KvmemError(Exception):
    """An error kvmem raises on purpose, with a message meant for its user."""


class BadInput(KvmemError, ValueError):
    """Input kvmem refuses: a scenario, a summary, an option, a folder it cannot use. A
    ValueError still: pydantic reads one raised in a validator as the field's error."""


def no_summaries(paths: Iterable[str | Path]) -> BadInput:
    """Folders or files that hold no summary where a command needs one."""
    return BadInput(f"{', '.join(map(str, paths))}: no summaries found")


def cannot_write(path: str | Path, exc: OSError) -> BadInput:
    """A file or folder kvmem cannot write, with the system's reason."""
    return BadInput(f"{path}: cannot write: {exc.strerror or exc}")
