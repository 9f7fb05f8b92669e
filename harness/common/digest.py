"""sha256 digests of a file and of a folder's files: what the gate compares when a scenario
points at bytes outside itself (a model folder) or code runs before kvmem (a `sitecustomize`,
a package shadowing `mlx_lm`), so that the same bytes under another path are the same thing
and other bytes under the same path are not."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .units import MiB

CHUNK = MiB  # files are read in pieces: a model's weights can be gigabytes
SKIPPED = ("__pycache__",)  # written by Python itself, not part of what the folder holds


@dataclass(frozen=True)
class TreeDigest:
    """A folder's digest: sha256 over each file's relative path and contents, in sorted order,
    and how many files and bytes it covers."""

    sha256: str
    files: int
    bytes: int


def _feed(digest: hashlib._Hash, path: Path) -> int:
    """Add the file's bytes to `digest`; its size."""
    size = 0
    with open(path, "rb") as stream:
        while chunk := stream.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    _feed(digest, path)
    return digest.hexdigest()


def members(folder: Path) -> list[Path]:
    """The files a folder's digest covers: every regular file under it (links followed), but
    hidden names and `__pycache__`, sorted by relative path."""
    found = [path for path in folder.rglob("*") if path.is_file()
             and not any(part.startswith(".") or part in SKIPPED
                         for part in path.relative_to(folder).parts)]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def tree_digest(folder: Path) -> TreeDigest:
    """The folder's digest: each member's relative path (POSIX, NUL-ended), its size and its
    bytes, so that moving bytes from one file into another changes it. OSError when the folder
    or a file cannot be read."""
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder}: not a folder")
    digest = hashlib.sha256()
    files = members(folder)
    total = 0
    for path in files:
        size = path.stat().st_size
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(size.to_bytes(8, "big"))
        total += _feed(digest, path)
    return TreeDigest(digest.hexdigest(), len(files), total)
