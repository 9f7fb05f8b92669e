"""A process bound to its parent's life, with the standard library alone: a server's own
environment imports it too (harness.models.serving), where kvmem's dependencies are absent.

On Linux a process kvmem starts dies with kvmem however kvmem ends (`PR_SET_PDEATHSIG`), and
kvmem's processes adopt the orphans their descendants leave (`PR_SET_CHILD_SUBREAPER`), so that
harness.common.child can find and stop them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def die_with_parent(parent: int) -> None:
    """Ask Linux to kill this process when `parent` goes, however it ends; exit at once if it
    is gone already. A process kvmem starts with `subprocess.Popen` gets the same with
    `preexec_fn=functools.partial(die_with_parent, os.getpid())`."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent was gone before the request took effect
            os._exit(1)


def subreaper() -> bool:
    """On Linux, have orphans of this process's descendants reparented here, not to init:
    whether they are."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1) == 0
    return False
