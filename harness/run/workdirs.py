"""Temporary folders a run works in, named by the process that owns them.

A variant's spooled rows (`kvmem-rows-`) and a server's HOME and log (`kvmem-server-`) live in
the temporary directory while the run lasts, and go with it. A process killed outright (kill -9,
the machine's out-of-memory killer) cannot remove its own, so each folder's name carries its
owner's pid, and every run first removes the folders whose owner has gone: never one of a live
run, whichever user or kvmem started it.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

ROWS, SERVER = "kvmem-rows-", "kvmem-server-"
_OWNED = re.compile(r"(?P<pid>\d+)-")  # after the prefix: the owner's pid, then mkdtemp's part


def made(prefix: str) -> Path:
    """A new folder in the temporary directory, named `<prefix><pid>-<random>` for this process."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))


def owner(folder: Path, prefix: str) -> int | None:
    """The pid a folder of `prefix` names as its owner; None for a name `made` did not give."""
    match = _OWNED.match(folder.name.removeprefix(prefix))
    return int(match["pid"]) if folder.name.startswith(prefix) and match else None


def alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(prefixes: tuple[str, ...] = (ROWS, SERVER), where: Path | None = None) -> list[Path]:
    """Remove this user's folders of `prefixes` in `where` (the temporary directory) whose owner
    has gone: the folders removed."""
    where = Path(tempfile.gettempdir()) if where is None else where
    removed: list[Path] = []
    try:
        entries = list(where.iterdir())
    except OSError:
        return removed
    for folder in entries:
        pids = [pid for prefix in prefixes if (pid := owner(folder, prefix)) is not None]
        if not pids or alive(pids[0]):
            continue
        try:
            if folder.is_symlink() or folder.lstat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
