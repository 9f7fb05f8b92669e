"""A server's own environment: the packages its scenario names, built once with uv and reused.

Servers other than mlx-lm's pin their own mlx-lm (vllm-mlx 0.6.0 wants < 0.32), so they cannot
share kvmem's environment. `server.requires` lists what the server needs (and
`server.requires_no_deps` what goes in without its declared dependencies); kvmem builds a
virtual environment from them with uv under `<KVMEM_CACHE>/envs/<key>`, the key covering the
exact requirements, the Python version and the platform. A complete environment holds a record
(`kvmem-env.json`: what was asked, what was installed) and is reused as it is, offline; one
being built is locked, so two variants of one suite build it once. A failed build is a
`ServerEnvError` naming the requirements and the resolver's own message. The server's
command runs with its interpreter's `bin/` first on PATH (`activated`), so a console script of
the environment starts it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from ..common.files import atomic_text
from ..common.lifeline import die_with_parent
from ..models.folder import cache_root
from ..scenario.server import ServerSpec
from .engines import RunFailure

FORMAT_VERSION = 1
RECORD = "kvmem-env.json"
MESSAGE_LINES = 12  # lines of uv's message a failed build quotes


class ServerEnvError(RunFailure):
    """The server's environment could not be built; the message names what and why."""


def key(server: ServerSpec) -> str:
    """What the environment's bytes depend on, hashed: its folder's name."""
    recipe = {"format": FORMAT_VERSION, "requires": sorted(server.requires),
              "no_deps": sorted(server.requires_no_deps), "python": platform.python_version(),
              "implementation": sys.implementation.name, "platform": sys.platform,
              "machine": platform.machine()}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def python_of(folder: Path) -> Path:
    return folder / "bin" / "python"


def activated(python: str, env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the folder of the server's interpreter first on PATH, as activating its
    environment would put it: a command that starts with a console script the environment
    installed (`rapid-mlx serve ...`) finds it there, not elsewhere or nowhere."""
    return {**env, "PATH": f"{Path(python).parent}{os.pathsep}{env.get('PATH') or os.defpath}"}


def installed(folder: Path) -> dict[str, str] | None:
    """The packages a complete environment holds (name: version), or None where it is not."""
    try:
        return dict(json.loads((folder / RECORD).read_text())["installed"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def environment(server: ServerSpec, root: Path | None = None) -> Path:
    """The interpreter of the server's environment, built first where it is not yet."""
    folder = (root or cache_root()) / "envs" / key(server)
    if installed(folder) is None:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _locked(folder.with_suffix(".lock")):
            if installed(folder) is None:  # another process may have built it meanwhile
                _build(server, folder)
    return python_of(folder)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def uv() -> str:
    """uv's binary: the `uv` package kvmem depends on, else one on PATH."""
    try:
        from uv import find_uv_bin

        return str(find_uv_bin())
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found is None:
            raise ServerEnvError("server.requires needs uv to build the server's environment: "
                                 "pip install uv") from None
        return found


def _build(server: ServerSpec, folder: Path) -> None:
    """A fresh environment in `folder`, then its record, written last: a build cut short
    leaves no record, and the next run starts over."""
    shutil.rmtree(folder, ignore_errors=True)
    asked = [*server.requires, *server.requires_no_deps]
    python = str(python_of(folder))
    try:
        _uv(asked, "venv", "--python", sys.executable, str(folder))
        if server.requires:
            _uv(asked, "pip", "install", "--python", python, *server.requires)
        if server.requires_no_deps:
            _uv(asked, "pip", "install", "--no-deps", "--python", python,
                *server.requires_no_deps)
        frozen = _uv(asked, "pip", "freeze", "--python", python)
    except ServerEnvError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    packages = dict(line.split("==", 1) for line in frozen.splitlines() if "==" in line)
    atomic_text(folder / RECORD, json.dumps(
        {"requires": server.requires, "requires_no_deps": server.requires_no_deps,
         "installed": packages}, indent=1, sort_keys=True) + "\n")


def _uv(asked: list[str], *args: str) -> str:
    """uv's standard output; a failure is a ServerEnvError with the end of its message."""
    try:
        done = subprocess.run([uv(), "--quiet", *args], capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, env={**os.environ, "NO_COLOR": "1"},
                              preexec_fn=functools.partial(die_with_parent, os.getpid()))
    except OSError as exc:
        raise ServerEnvError(f"cannot run uv: {exc.strerror or exc}") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()[-MESSAGE_LINES:]
        raise ServerEnvError(f"cannot build the server's environment ({', '.join(asked)}): uv "
                             f"{args[0]} {args[1] if args[0] == 'pip' else ''}".rstrip()
                             + " failed:\n" + "\n".join(lines))
    return done.stdout
