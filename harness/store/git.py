"""Committed files at a git revision: what `gate pr` judges a pull request against.

The target branch's baselines are read from git at the revision, never from the working tree,
so a pull request that edits its own `baselines/` cannot change what it is compared with. Any
failure (no git, not a repository, an unknown revision) is bad input naming what was asked.
The gate's other reads of the repository (its top, the commit a ref names, who last changed a
file) are here too.
"""

from __future__ import annotations

import subprocess
from pathlib import Path, PurePosixPath

from ..common.echo import echo
from . import StoreError


def _git(args: list[str], cwd: Path, stdin: bytes | None = None) -> bytes:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True,
                              check=False)
    except OSError as exc:
        raise StoreError(f"cannot run git: {exc.strerror or exc}") from None
    if done.returncode:
        error = done.stderr.decode(errors="replace").strip().splitlines()
        raise StoreError(f"git {args[0]} failed: {error[-1] if error else done.returncode}")
    return done.stdout


def toplevel(cwd: Path) -> Path:
    """The work tree holding `cwd`; bad input when it is not in one."""
    try:
        return Path(_git(["rev-parse", "--show-toplevel"], cwd).decode().strip())
    except StoreError:
        raise StoreError(f"{cwd}: not in a git repository (gate pr reads the baselines "
                           "committed at --base REF from git)") from None


def commit(ref: str, top: Path) -> str:
    """The full SHA `ref` names; bad input when the repository has no such commit."""
    if ref.startswith("-"):
        raise StoreError(f"--base {echo(ref)}: not a revision")
    try:
        return _git(["rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"], top).decode().strip()
    except StoreError:
        raise StoreError(f"--base {echo(ref)}: no such commit in {top} (fetch it first, e.g. "
                           "`git fetch origin main` and --base origin/main)") from None


def files(sha: str, top: Path, folder: PurePosixPath) -> dict[PurePosixPath, bytes]:
    """Every file under `folder` (relative to the top of the tree) at commit `sha`, by its path
    relative to `folder`; empty when the commit has no such folder."""
    listing = _git(["ls-tree", "-r", "-z", "--full-tree", sha, "--", str(folder)], top)
    entries = []
    for record in filter(None, listing.split(b"\0")):
        meta, _, name = record.partition(b"\t")
        _, kind, blob = meta.decode().split()
        if kind == "blob":
            entries.append((PurePosixPath(name.decode()).relative_to(folder), blob))
    if not entries:
        return {}
    out = _git(["cat-file", "--batch"], top, "".join(f"{b}\n" for _, b in entries).encode())
    files, at = {}, 0
    for path, _ in entries:
        header_end = out.index(b"\n", at)
        size = int(out[at:header_end].split()[2])
        files[path] = out[header_end + 1:header_end + 1 + size]
        at = header_end + 1 + size + 1
    return files


def file(sha: str, top: Path, path: PurePosixPath) -> bytes | None:
    """The file at `path` (relative to the top of the tree) at commit `sha`; None when the
    commit has no such file."""
    try:
        return _git(["cat-file", "blob", f"{sha}:{path}"], top)
    except StoreError:
        return None


def last_change(top: Path, path: PurePosixPath) -> str:
    """The commit of the checked-out history that last changed `path` (its SHA's first 12
    digits), `uncommitted changes in the working tree` where the tree differs from it. Never its
    author: the pull request writes that as it likes (who made a change comes from the pull
    request's event, harness.gate.event)."""
    if _git(["status", "--porcelain", "--", str(path)], top).strip():
        return "uncommitted changes in the working tree"
    sha = _git(["log", "-1", "--format=%H", "--", str(path)], top).decode().strip()
    return sha[:12] if sha else "no commit"
