"""One process per variant, with a footprint check before it serves.

On the CPU backend an allocation larger than RAM kills the process (SIGSEGV) and
`set_memory_limit` does not raise, so a variant runs in a child: a child that dies, hangs past
its timeout or stops before its workload is done becomes a failed run with its exit status and
the last step it reached, and the other variants go on. User components are imported only in
the child, so one that exits or crashes at import cannot end the parent, and only after kvmem
and MLX are imported there from their installation (`harness.common.child`); the child imports
the probe, which binds MLX's counters, before its first component (`harness.run.probe`).

The child writes its rows as they come to spool files in a folder the parent made for the run
(`harness.run.rows`), so a run of any length holds little memory and a child that is killed
still leaves what it sampled; the parent reads them when the child ends and removes the folder.
On Linux the child also dies with its parent (`harness.common.child`).

What the child sends ends its run: the parent reads the spool files, and its caller writes the
report, only once the child has been joined and every process it started has gone
(`Child.survivors`); a process still alive then is killed and fails the variant, named, so none
can rewrite a report after kvmem wrote it. In the child the probe is guarded before any of the
variant's code is imported (`Probe.guard`): a reset of MLX's peak by that code is counted and
lowers no step's peak, and a rebinding of the probe's counters fails the run.

An interrupt (`stop`) ends a child as a soak's end would, only sooner: the parent sends it
SIGTERM, which stops its engine where it stands; the child stops what it started (a server and
its folder) and says so, and the parent reads what was spooled: an `interrupted` run, with its
report. A child that has not ended `INTERRUPT_GRACE` seconds later is killed, and the temporary
folders it leaves are removed (`harness.run.workdirs`).

The child works in two phases so that the parent can schedule by memory without importing user
code: it computes its footprint estimate (which may import components), sends it (`Estimate`),
and waits for the parent's verdict (`admit`): serve, or a refusal message
(`harness.pipeline.schedule` decides). Its last message, `Ended`, says how its run ended.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from ..common.child import CONTEXT, Child, how
from ..common.units import GiB
from ..judge.summary import ModelFacts
from ..run import holders_log
from ..run.engine_choice import create, engine_class
from ..run.engines import RunFailure
from ..run.probe import REQUEST, REQUESTS_SPOOL, ROW, SAMPLES_SPOOL, CounterReplaced, Probe
from ..run.rows import read
from ..run.workdirs import ROWS, made, sweep
from ..scenario import ScenarioSpec, Variant
from .defaults import DEFAULT_TIMEOUT

NOTE_BYTES = 200  # the longest progress note a child shows beside its bar
INTERRUPT_GRACE = 30.0  # seconds an interrupted child has to stop its work and report
INTERRUPTED = "interrupted"


@dataclass
class RunOutcome:
    variant: Variant
    status: str  # ok | failed | refused | interrupted
    rows: np.ndarray
    error: str | None
    exit_status: int | None
    last_step: int
    wall_s: float
    estimate: int
    store_stats: dict | None = None  # the store's `stats` at the end of the run, if it has any
    model: ModelFacts | None = None  # the real model served (Engine.facts), None on synthetic K/V
    # The requests a server was sent (REQUEST rows); empty for the other engines.
    requests: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=REQUEST))
    # The holders walked at each point at rest (harness.run.holders_log's rows).
    holders: list[tuple] = field(default_factory=list)
    resets: int = 0  # the measured code's calls of mx.reset_peak_memory (PeakMark)


def estimate_bytes(spec: ScenarioSpec) -> int:
    """The footprint the variant's engine bounds it at (Engine.estimate_bytes): run where user
    code may run, in the variant's process."""
    return engine_class(spec.engine).estimate_bytes(spec)


def available_memory() -> int:
    """Bytes the machine can still give a new variant (tests patch it to make memory scarce)."""
    return int(psutil.virtual_memory().available)


def refusal(estimate: int, available: int) -> str:
    """Why a variant was refused, with its estimate: the refused summary's error."""
    return (f"estimated footprint {estimate / GiB:.2f} GiB exceeds the "
            f"{available / GiB:.2f} GiB available")


def fits_alone(estimate: int) -> str | None:
    """The default verdict: serve a variant that fits in available memory, else the refusal."""
    available = available_memory()
    return refusal(estimate, available) if estimate > available else None


def _interrupt(signum: int, frame: object) -> None:
    """The parent's SIGTERM in the child: stop serving, once (the clean-up is not cut short)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


@dataclass(frozen=True)
class Estimate:
    """The child's first message: the footprint its engine bounds the variant at, which waits
    for the parent's verdict (None: serve, else the refusal)."""

    bytes: int


@dataclass(frozen=True)
class Ended:
    """The child's last message, sent once its rows are spooled: how its run ended and what
    its engine said of it."""

    estimate: int = 0
    refused: str | None = None
    completed: bool = False
    interrupted: bool = False
    error: str | None = None
    store_stats: dict | None = None
    model: ModelFacts | None = None
    resets: int = 0


def _child(variant: Variant, last_step: Any, note: Any, spool: Path, pipe: Connection) -> None:
    """Runs in the child: estimate, wait for the parent's verdict, serve (rows to `spool`),
    send the outcome; SIGTERM (an interrupt) ends the serving early, what was served kept."""
    signal.signal(signal.SIGTERM, _interrupt)
    probe = Probe(spool=spool)  # made before any of the variant's code is imported
    sealed = probe.guard()  # kept here, where the variant's code does not look

    def progress(steps: int, said: str | None = None) -> None:
        last_step.value = steps
        if said is not None:
            note.value = said.encode("utf-8", "replace")[:NOTE_BYTES - 1]
    ended = _serve(variant, probe, progress, pipe)
    rebound = sealed()
    if rebound is not None and ended.error is None:
        ended = replace(ended, error=rebound, completed=False)
    probe.close()
    ended = replace(ended, resets=probe.resets)
    pipe.send(ended)
    pipe.close()
    if ended.error is not None:
        os._exit(1)


def _serve(variant: Variant, probe: Probe, progress: Callable[..., None],
           pipe: Connection) -> Ended:
    """The child's run up to its seal check: estimate, verdict, serve, close."""
    ended, engine = Ended(), None
    try:
        ended = Ended(estimate=estimate_bytes(variant.spec))
        pipe.send(Estimate(ended.estimate))
        ended = replace(ended, refused=pipe.recv())  # None: serve
        if ended.refused is None:
            engine = create(variant.spec, probe, progress)
            engine.serve()
            probe.verify()
            ended = replace(ended, store_stats=engine.store_stats(), model=engine.facts(),
                            completed=True)
    except KeyboardInterrupt:
        ended = replace(ended, interrupted=True)
        if engine is not None:  # what it served until then (a server's requests, latency)
            with contextlib.suppress(Exception):
                ended = replace(ended, store_stats=engine.store_stats(), model=engine.facts())
    except (RunFailure, CounterReplaced) as exc:
        ended = replace(ended, error=str(exc))
    except BaseException as exc:  # SystemExit from a component is a failed run too
        ended = replace(ended, error=f"{type(exc).__name__}: {exc}\n"
                                     f"{traceback.format_exc(limit=-3)}")
    finally:
        if engine is not None:
            try:
                engine.close()
            except BaseException as exc:
                ended = replace(ended, error=ended.error
                                or f"{type(exc).__name__} on close: {exc}", completed=False)
    return ended


def execute(variant: Variant, on_step: Callable[[int, str], None] | None = None,
            timeout: float | None = None, admit: Callable[[int], str | None] = fits_alone,
            stop: threading.Event | None = None) -> RunOutcome:
    """Run one variant in a child process; never raises for what happens inside the child.

    A run counts as `ok` only when the child says it served the whole workload: a child that
    exits early, even with status 0, is a failed run. `timeout` (seconds, default
    DEFAULT_TIMEOUT) kills a child that hangs. An interrupt raised in this thread kills the
    child first. `stop`, once set (by a signal handler or another thread), ends the run
    `interrupted`: the child stops serving and the outcome holds what it sampled. `admit` gets
    the child's estimate and returns None (serve) or a refusal message; time spent in it
    (waiting for memory) counts toward neither the timeout nor the wall time. `on_step` is told
    the steps served (a server's requests) and the child's latest progress note.
    """
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    last_step = CONTEXT.Value("q", 0, lock=False)
    note = CONTEXT.Array("c", NOTE_BYTES, lock=False)
    spool = made(ROWS)
    try:
        with Child(_child, variant, last_step, note, spool, grace=30,
                   name=f"kvmem {variant.label}") as child:
            def shown() -> None:  # a note cut mid-character by NOTE_BYTES reads on
                if on_step is not None:
                    on_step(last_step.value, note.value.decode("utf-8", "replace"))

            message, ended, wall = _watch(child, timeout, admit, stop, shown)
        rows, requests = read(spool / SAMPLES_SPOOL, ROW), read(spool / REQUESTS_SPOOL, REQUEST)
        holders = holders_log.read(spool / holders_log.HOLDERS_SPOOL)
    finally:
        shutil.rmtree(spool, ignore_errors=True)
        sweep()  # a killed child's own folders (a server's), once it has gone
    outcome = _outcome(variant, message, ended, child.process.exitcode, last_step.value,
                       wall, rows, requests)
    outcome.holders, outcome.resets = holders, message.resets if message is not None else 0
    if child.survivors and outcome.status != "refused":
        left = left_behind(child.survivors)
        earlier = outcome.error if outcome.status == "failed" else None
        outcome.status, outcome.error = "failed", left if earlier is None else f"{earlier}\n{left}"
    return outcome


def left_behind(survivors: list[str]) -> str:
    """The failure of a variant whose process left others running after it ended."""
    return (f"the variant's process left {len(survivors)} process(es) running after it ended, "
            f"killed by kvmem: {'; '.join(survivors)}")


def _watch(child: Child, timeout: float, admit: Callable[[int], str | None],
           stop: threading.Event | None,
           shown: Callable[[], None]) -> tuple[Ended | None, str | None, float]:
    """Wait for the child's outcome, answering its estimate, showing its progress (`shown`),
    killing it on timeout, stopping it on `stop`: its last message, why it was ended early
    (None if it was not) and the seconds it served."""
    start = time.perf_counter()
    message: Ended | None = None
    ended, stopped = None, None
    while message is None:
        try:
            received = child.receive(0.1)
        except EOFError:
            break  # the child died while sending, or before
        if isinstance(received, Estimate):  # awaits a verdict
            start += _admission(received.bytes, admit, child.pipe)
        elif isinstance(received, Ended):
            message = received
        shown()
        if message is not None:
            break
        if stopped is None and stop is not None and stop.is_set():
            ended, stopped = INTERRUPTED, time.perf_counter()
            with contextlib.suppress(OSError):  # asks it to stop where it stands and report
                child.process.terminate()
        if stopped is not None:
            if time.perf_counter() - stopped > INTERRUPT_GRACE:
                child.process.kill()
                break
        elif time.perf_counter() - start > timeout:
            ended = f"timed out after {timeout:g} s"
            child.process.kill()
            break
    return message, ended, time.perf_counter() - start


def _admission(estimate: int, admit: Callable[[int], str | None], pipe: Connection) -> float:
    """Send the child its verdict; the seconds spent deciding (waiting for memory)."""
    began = time.perf_counter()
    decision = admit(estimate)
    with contextlib.suppress(OSError):  # a child that died meanwhile is seen by the caller
        pipe.send(decision)
    return time.perf_counter() - began


def _outcome(variant: Variant, message: Ended | None, ended: str | None, code: int | None,
             steps: int, wall: float, rows: np.ndarray, requests: np.ndarray) -> RunOutcome:
    """What the child's last message, or its silence (None), says about the run, with what it
    sampled (a killed child's rows too, up to its last spill)."""
    said = message or Ended()
    if said.refused:
        return RunOutcome(variant, "refused", rows, said.refused, None, 0, wall, said.estimate)
    if ended == INTERRUPTED or said.interrupted:  # a SIGTERM may reach it first
        stopped = ("stopped" if message is not None
                   else f"{how(code)} before it had stopped (it has {INTERRUPT_GRACE:g} s)")
        return RunOutcome(variant, INTERRUPTED, rows,
                          f"interrupted at step {steps}: the variant's process {stopped}; "
                          "the report holds what was sampled until then", code, steps, wall,
                          said.estimate, said.store_stats, said.model, requests)
    if ended:
        error = f"{ended} at step {steps}: the variant's process was killed"
    elif said.error:
        error = said.error
    elif not said.completed:
        error = (f"the variant's process {how(code)} at step {steps} before completing its "
                 "workload")
    else:
        return RunOutcome(variant, "ok", rows, None, code, steps, wall, said.estimate,
                          said.store_stats, said.model, requests)
    return RunOutcome(variant, "failed", rows, error, code, steps, wall, said.estimate,
                      requests=requests)
