"""Atomic writes: a report, a summary, a baseline or a comment is written whole or not at all.

Each file is written to a temporary name beside its target and renamed into place, so an
interrupted write never leaves half a file, nor destroys the one already there.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

UMASK = os.umask(0)
os.umask(UMASK)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write` on a temporary file beside `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_text(path: Path, text: str) -> None:
    def write(tmp: Path) -> None:
        tmp.write_text(text)

    atomic_write(path, write)
