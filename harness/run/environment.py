"""What produced a run's figures: the backend, the versions, the machine, the revision, and
what the gate counts in the yardstick beside the scenario (harness.judge.provenance): the
runner class, the code that runs before kvmem, the model folder a variant loads by path.

Summaries from different backends are never compared, and summaries from different MLX versions
are compared with a note, so each summary records this block.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import psutil

from ..common.digest import tree_digest
from ..common.units import GiB
from ..judge.provenance import FolderDigest, Preloaded, Runner
from ..judge.summary import Environment
from .preloaded import preloaded

BACKENDS = ("cpu", "metal", "cuda")  # what `backend` can say


def backend() -> str:
    """Which MLX backend produces the figures: one of BACKENDS."""
    import mlx.core as mx  # here, not at the top: reading summaries must not load MLX

    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda"


def buffer_limit() -> int | None:
    """How many live buffers the backend allows a process, where MLX says (Metal's
    `resource_limit`, 499,000 by default); None elsewhere."""
    import mlx.core as mx

    from ..agent.kvmem_holders import buffer_limit as reported

    return reported(mx)


def runner() -> Runner:
    """The class of machine that measures: two runs of unchanged code on one class give
    figures the gate compares as like with like."""
    cpus = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)
    return Runner(backend=backend(), machine=platform.machine(), cpus=cpus,
                  memory_gib=round(psutil.virtual_memory().total / GiB), os=platform.system())


def model_folder(path: str | None) -> FolderDigest | None:
    """The digest of the model folder a scenario names by `path` (relative to where kvmem
    runs), as `environment.model_folder` records it; None for a model kvmem builds itself, and
    a digest of `unreadable` where the folder cannot be read (the run fails on it anyway)."""
    if path is None:
        return None
    try:
        digest = tree_digest(Path(path))
    except OSError as exc:
        return FolderDigest(path=path, sha256=f"unreadable: {exc.strerror or exc}", files=0,
                            bytes=0)
    return FolderDigest(path=path, sha256=digest.sha256, files=digest.files, bytes=digest.bytes)


def _revision(folder: Path) -> str | None:
    """The git commit checked out in `folder`, or None outside a git work tree."""
    try:
        return subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
            text=True, timeout=5, check=False,
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> Environment:
    """What produced a run's figures; summaries from different backends are never compared.

    `git_revision` is the commit of the folder kvmem ran in (the project under test);
    `kvmem` is kvmem's own version and, from a git checkout, its commit.
    """
    import importlib.metadata as md

    try:
        mlx_lm = md.version("mlx-lm")
    except md.PackageNotFoundError:  # kvmem without its `mlx` extra, beside a server's own
        mlx_lm = "not installed"
    return Environment(
        backend=backend(), buffer_limit=buffer_limit(), mlx=md.version("mlx"), mlx_lm=mlx_lm,
        python=platform.python_version(), machine=platform.machine(),
        platform=platform.platform(), git_revision=_revision(Path.cwd()),
        kvmem={"version": md.version("kvmem"), "revision": _revision(Path(__file__).parent)},
        runner=runner(),
        preloaded=[Preloaded.model_validate(entry) for entry in preloaded(Path.cwd())])
