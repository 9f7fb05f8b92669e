"""One process per variant, with a footprint check before it serves.

On the CPU backend an allocation larger than RAM kills the process (SIGSEGV) and
`set_memory_limit` does not raise, so a variant runs in a child: a child that dies, hangs past
its timeout or stops before its workload is done becomes a failed run with its exit status and
the last step it reached, and the other variants go on. User components are imported only in
the child, so one that exits or crashes at import cannot end the parent.

The child sends its rows back through a pipe, not a file, so nothing is left on disk when either
side is killed; on Linux the child also dies with its parent (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import psutil

from ..components import resolve
from ..scenario import ComponentSpec, ScenarioSpec, Variant
from .engine import Engine
from .probe import ROW, Probe
from .synthetic import SyntheticKV

RUNTIME_SLACK = 256 * 2**20  # interpreter, MLX and the sample rows
DEFAULT_TIMEOUT = 1800.0  # seconds; a scenario or `--timeout` says otherwise
_PR_SET_PDEATHSIG = 1


@dataclass
class RunOutcome:
    variant: Variant
    status: str  # ok | failed | refused
    rows: np.ndarray
    error: str | None
    exit_status: int | None
    last_step: int
    wall_s: float
    estimate: int


def _context_tokens(spec: ScenarioSpec) -> int:
    workload = spec.workload
    if workload.chat is not None:
        return workload.chat.turns * (workload.chat.user + workload.chat.model)
    return max(r.prompt + r.decode for r in workload.requests or [])


def estimate_bytes(spec: ScenarioSpec) -> int:
    """An upper bound on a variant's footprint, from the geometry, the workload and the components.

    Each layer's cache at the longest context, twice (a growth step briefly holds old and new
    buffers), or what its factory's `estimate_bytes(layer, tokens, **options)` says when that is
    more (a cache that allocates its whole window up front); a prefill chunk's K/V twice; and
    whatever a store or session's `estimate_bytes(geometry, workload, **options)` adds on top.
    Resolves components, so it runs where user code may run: in the child.
    """
    geometry, workload = spec.geometry(), spec.workload
    context = _context_tokens(spec)
    layer_caches = {"full": spec.cache.layer, "sliding": spec.cache.sliding}
    caches = sum(max(2 * layer.minimum_bytes(context + 256),
                     _stated(layer_caches.get(layer.kind), layer, context))
                 for layer in geometry.layers)
    chunk = sum(SyntheticKV.input_bytes(layer, workload.prefill_chunk) for layer in geometry.layers)
    extra = sum(_stated(part, geometry, workload) for part in (spec.cache.store, spec.cache.session))
    return caches + 2 * chunk + extra + RUNTIME_SLACK


def _stated(component: ComponentSpec | None, *args: Any) -> int:
    """What a component's factory says it holds (its `estimate_bytes`), or 0 if it says nothing."""
    if component is None:
        return 0
    estimate = getattr(resolve(component.component), "estimate_bytes", None)
    return 0 if estimate is None else int(estimate(*args, **component.options))


def _die_with_parent(parent: int) -> None:
    """Ask Linux to kill this child when its parent goes, however the parent ends."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent was gone before the request took effect
            os._exit(1)


def _child(variant: Variant, pipe: Connection, last_step, parent: int) -> None:
    """Runs in the child: check the footprint, serve, and send back rows and the outcome.

    Ctrl-C reaches the whole process group; the parent decides what the child does about it.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent)
    probe = Probe()
    message: dict = {"error": None, "completed": False, "estimate": 0, "refused": None}
    engine = None
    try:
        message["estimate"] = estimate = estimate_bytes(variant.spec)
        available = psutil.virtual_memory().available
        if estimate > available:
            message["refused"] = (f"estimated footprint {estimate / 2**30:.2f} GiB exceeds the "
                                  f"{available / 2**30:.2f} GiB available")
        else:
            engine = Engine(variant.spec, probe, lambda steps: setattr(last_step, "value", steps))
            engine.serve()
            message["completed"] = True
    except BaseException as exc:  # SystemExit from a component is a failed run too
        message["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"
    finally:
        if engine is not None:
            try:
                engine.close()
            except BaseException as exc:
                message["error"] = message["error"] or f"{type(exc).__name__} on close: {exc}"
                message["completed"] = False
    message["rows"] = probe.rows()
    pipe.send(message)
    pipe.close()
    if message["error"] is not None:
        os._exit(1)


def _how(code: int | None) -> str:
    if code is None:
        return "did not exit"
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def execute(variant: Variant, on_step: Callable[[int], None] | None = None,
            timeout: float | None = None) -> RunOutcome:
    """Run one variant in a child process; never raises for what happens inside the child.

    A run counts as `ok` only when the child says it served the whole workload: a child that
    exits early, even with status 0, is a failed run. `timeout` (seconds, default
    DEFAULT_TIMEOUT) kills a child that hangs. An interrupt of the parent kills the child first.
    """
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    context = mp.get_context("spawn")
    last_step = context.Value("q", 0, lock=False)
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(variant, send, last_step, os.getpid()),
                            name=f"kvmem {variant.label}", daemon=True)
    start = time.perf_counter()
    message: dict | None = None
    timed_out = False
    try:
        child.start()
        send.close()
        while message is None:
            if receive.poll(0.1):
                try:
                    message = receive.recv()
                except (EOFError, OSError):
                    break  # the child died while sending, or before
            elif not child.is_alive() and not receive.poll(0):
                break
            if on_step is not None:
                on_step(last_step.value)
            if time.perf_counter() - start > timeout:
                timed_out = True
                break
        if timed_out:
            child.kill()
        child.join(timeout=30)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        receive.close()
    wall = time.perf_counter() - start
    code, steps = child.exitcode, last_step.value
    message = message or {}
    rows = message.get("rows", np.zeros(0, dtype=ROW))
    estimate = message.get("estimate", 0)
    if message.get("refused"):
        return RunOutcome(variant, "refused", rows, message["refused"], None, 0, wall, estimate)
    if timed_out:
        error = f"timed out after {timeout:g} s at step {steps}: the variant's process was killed"
    elif message.get("error"):
        error = message["error"]
    elif not message.get("completed"):
        error = (f"the variant's process {_how(code)} at step {steps} before completing its "
                 "workload")
    else:
        return RunOutcome(variant, "ok", rows, None, code, steps, wall, estimate)
    return RunOutcome(variant, "failed", rows, error, code, steps, wall, estimate)
