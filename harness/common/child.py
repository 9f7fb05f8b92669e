"""Child processes for user code: neither can one outlive kvmem nor hang it.

User code (components imported to check them, a variant served) runs in a spawned child, so
that one that exits, crashes or hangs becomes an error message instead of the end of kvmem. The
child ignores Ctrl-C, which reaches the whole process group: the parent decides what the child
does about it. It is deaf from its first instruction: the parent blocks SIGINT while it starts
the child, which inherits the blocked signal through exec, so a Ctrl-C while the new
interpreter still imports (a second or two) prints no traceback there. On Linux the child dies
with its parent (`PR_SET_PDEATHSIG`), however the parent ends, and defers mlx-lm's package
`__init__` (`harness.common.mlx_lm_import`): most children need mlx-lm's caches alone. The parent
talks to it over one two-way pipe and kills and joins it however the `with` block ends.

The code a child runs may be measured, never choose how: the child starts with the working
directory off its `sys.path` (and off the new interpreter's own, `PYTHONSAFEPATH`), so kvmem's
packages and MLX come from their installation, and only then is the directory put back for the
user's `module:Class` paths. A repository's own `harness/` or `reference_impl/` is never imported
in their place, and a component cannot replace MLX before kvmem's probe has bound its counters.

Nothing a child starts outlives it: on Linux kvmem's process and each child are child
subreapers (`PR_SET_CHILD_SUBREAPER`), so a process the child left behind comes back to the
child, then to kvmem when the child ends, however it detached (its own session, a double fork),
rather than to init or to another child running beside it; elsewhere the child's descendants
are listed as it ends. Once the child has gone, each of those still alive after `LEFT_GRACE`
seconds is killed, with its descendants, and named in `Child.survivors`: a process that could
rewrite what kvmem writes next is gone before kvmem writes it.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from .lifeline import die_with_parent, subreaper
from .mlx_lm_import import defer_init

CONTEXT = mp.get_context("spawn")  # a fresh interpreter: none of the parent's threads or locks
_COMMAND_CHARS = 200  # of a left-behind process's command line, in the variant's failure
LEFT_GRACE = 0.5  # seconds a process a child left behind has to end of itself (a dying server)
# kvmem's own packages and the MLX it reads memory with: imported before the working directory is
# on sys.path, so a repository's packages of the same names never stand in for them.
FIRST = ("harness", "reference_impl", "mlx.core")
_INSTALLED = os.path.realpath(Path(__file__).parents[2])  # the folder holding kvmem's packages
_PATH_LOCK = threading.Lock()
# The children Child started and has not yet joined: never another's leftovers, as threads run
# several at once. Held while one starts and while a leftover is looked for.
_LIVE: set[int] = set()
_LIVE_LOCK = threading.Lock()


def _without_working_directory(path: list[str]) -> list[str]:
    """`path` less the working directory ('' included), unless kvmem itself is there (its own
    checkout, run from its root)."""
    try:
        here = os.path.realpath(os.getcwd())
    except OSError:  # the directory is gone: nothing can be imported from it
        return list(path)
    if here == _INSTALLED:
        return list(path)
    return [entry for entry in path if os.path.realpath(entry or os.curdir) != here]


def _set_safe_path(value: str | None) -> None:
    if value is None:
        os.environ.pop("PYTHONSAFEPATH", None)
    else:
        os.environ["PYTHONSAFEPATH"] = value


@contextlib.contextmanager
def kvmem_first() -> Iterator[None]:
    """For the block, sys.path without the working directory, and a Python started meanwhile
    without it either (`PYTHONSAFEPATH`, from Python 3.11): what is imported then comes from
    kvmem's installation and the installed packages. Under a lock, as threads start children."""
    with _PATH_LOCK:
        path, safe = sys.path, os.environ.get("PYTHONSAFEPATH")
        sys.path = _without_working_directory(path)
        os.environ["PYTHONSAFEPATH"] = "1"
        try:
            yield
        finally:
            sys.path = path
            _set_safe_path(safe)


def _settings() -> tuple[list[str], str | None]:
    """This process's sys.path and PYTHONSAFEPATH, read while no other thread has set them aside."""
    with _PATH_LOCK:
        return list(sys.path), os.environ.get("PYTHONSAFEPATH")


def import_first() -> None:
    """Import FIRST from kvmem's installation unless done: before a `reference.*` component in
    kvmem's own process, where the working directory is on sys.path."""
    if not all(name in sys.modules for name in FIRST):
        with kvmem_first():
            for name in FIRST:
                importlib.import_module(name)


def _children() -> set[int]:
    """The pids of this process's children now."""
    with contextlib.suppress(psutil.Error):
        return {child.pid for child in psutil.Process().children()}
    return set()


def _descendants(pid: int) -> list[psutil.Process]:
    """The descendants of process `pid` now (none if it has gone)."""
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def _named(process: psutil.Process) -> str:
    """A process as a failure names it: its pid and command line, on one line and clipped."""
    try:
        command = " ".join(" ".join(process.cmdline()).split()) or process.name()
    except psutil.Error:
        command = "?"
    return f"pid {process.pid} ({command[:_COMMAND_CHARS]})"


def _since(process: psutil.Process, started: float) -> bool:
    """Whether `process` was created at or after `started` (the child's own creation)."""
    with contextlib.suppress(psutil.Error):
        return process.create_time() >= started
    return False


def stop_left_behind(known: set[int], seen: list[psutil.Process], started: float = 0.0
                     ) -> list[str]:
    """Kill what a child that has ended left alive: this process's children outside `known`
    (those before it, the other live children) created since the child was (`started`: an
    older orphan of something else that comes back here meanwhile is not its), and the child's
    descendants `seen` as it ended, with their own descendants, once `LEFT_GRACE` seconds have
    not ended them; each named."""
    with _LIVE_LOCK:
        mine = psutil.Process().children()
        candidates = {p.pid: p for p in mine if p.pid not in known and p.pid not in _LIVE
                      and _since(p, started)}
    candidates.update({p.pid: p for p in seen if p.pid not in candidates})
    if not candidates:
        return []
    _, alive = psutil.wait_procs(list(candidates.values()), timeout=LEFT_GRACE)
    left = {p.pid: p for p in alive}
    for process in alive:
        left.update({d.pid: d for d in _descendants(process.pid)})
    named = [_named(process) for process in sorted(left.values(), key=lambda p: p.pid)]
    for process in left.values():
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(list(left.values()), timeout=5)  # reaps those reparented here
    return named


def _run(parent: int, target: Callable[..., object], args: tuple, pipe: Connection,
         path: list[str], safe: str | None) -> None:
    """The child's entry: deaf to Ctrl-C and bound to its parent before anything else runs,
    then kvmem's packages and MLX imported from their installation before the user's code gets
    the parent's sys.path (`path`, with the working directory) and `PYTHONSAFEPATH` back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)
    subreaper()  # what it leaves behind comes back to it, then to kvmem: never to another child
    import_first()
    sys.path = path
    _set_safe_path(safe)
    defer_init()
    target(*args, pipe)


def how(code: int | None) -> str:
    """How a child with exit code `code` ended, as an error message says it."""
    if code is None:
        return "did not exit"
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


class Child:
    """`target(*args, pipe)` in a spawned child for the length of a `with` block.

    `pipe` is the child's end of a two-way pipe, `self.pipe` the parent's. Leaving the block
    normally gives the child `grace` seconds to exit; leaving it by an exception (an interrupt)
    gives it none; either way a child still alive is then killed, and joined, and whatever
    it started that is still alive is killed too and named in `survivors` (module docstring).
    """

    def __init__(self, target: Callable[..., object], *args: Any, grace: float,
                 name: str | None = None) -> None:
        self.pipe, self._end = CONTEXT.Pipe()
        self.process = CONTEXT.Process(
            target=_run, args=(os.getpid(), target, args, self._end, *_settings()), name=name,
            daemon=True)
        self.grace = grace
        self.survivors: list[str] = []
        self._known: set[int] = set()
        self._started = 0.0  # the child's creation time, as psutil reads it
        self._reaping = False

    def __enter__(self) -> Child:
        try:
            # multiprocessing starts its resource tracker with the first child and unblocks
            # SIGINT when it has: start it before blocking, so the block holds for the child.
            resource_tracker.ensure_running()
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            self._reaping = subreaper()
            try:
                with kvmem_first(), _LIVE_LOCK:
                    self._known = _children()
                    self.process.start()
                    _LIVE.add(self.process.pid or 0)
                    with contextlib.suppress(psutil.Error):
                        self._started = psutil.Process(self.process.pid).create_time()
            finally:  # a Ctrl-C that came meanwhile reaches the parent now
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        except BaseException:
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            self.pipe.close()
            raise
        finally:
            self._end.close()  # the child's own: the parent sees EOF once the child has gone
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        # Where orphans do not come back here, the child's descendants while it may still live.
        seen = [] if self._reaping else _descendants(self.process.pid or 0)
        try:
            if kind is None:
                self.process.join(timeout=self.grace)
        finally:
            if self.process.is_alive():
                self.process.kill()
            self.process.join()
            with _LIVE_LOCK:
                _LIVE.discard(self.process.pid or 0)
            try:
                self.survivors = stop_left_behind(self._known, seen, self._started)
            finally:
                self.pipe.close()

    def receive(self, timeout: float) -> Any:
        """The child's next message (never None), or None while the child is alive and has
        sent nothing for `timeout` seconds; EOFError once it has ended without sending one or
        died while sending."""
        if not self.pipe.poll(timeout):
            if self.process.is_alive():
                return None
            if not self.pipe.poll(0):
                raise EOFError("the child ended without sending a message")
        try:
            return self.pipe.recv()
        except OSError as exc:
            raise EOFError(f"the child's pipe broke: {exc}") from exc
