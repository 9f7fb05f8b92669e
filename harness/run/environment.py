"""What produced a run's figures: the backend, the versions, the machine, the revision.

Summaries from different backends are never compared, and summaries from different MLX versions
are compared with a note, so each summary records this block.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

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


def _revision(folder: Path) -> str | None:
    """The git commit checked out in `folder`, or None outside a git work tree."""
    try:
        return subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
            text=True, timeout=5, check=False,
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """What produced a run's figures; summaries from different backends are never compared.

    `git_revision` is the commit of the folder kvmem ran in (the project under test);
    `kvmem` is kvmem's own version and, from a git checkout, its commit.
    """
    import importlib.metadata as md

    try:
        mlx_lm = md.version("mlx-lm")
    except md.PackageNotFoundError:  # kvmem without its `mlx` extra, beside a server's own
        mlx_lm = "not installed"
    return {
        "backend": backend(),
        "buffer_limit": buffer_limit(),
        "mlx": md.version("mlx"),
        "mlx_lm": mlx_lm,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "git_revision": _revision(Path.cwd()),
        "kvmem": {"version": md.version("kvmem"), "revision": _revision(Path(__file__).parent)},
    }
