"""`kvmem record`: profile a command kvmem did not configure, as `py-spy record -- CMD` does.

Many servers are not started the way a scenario starts one (a launcher script, a port of their
own, real clients as the traffic). kvmem starts the command with its agent injected
(`harness.run.agented`, as serve mode does), drains the agent's samples about once a second
into a probe until the command exits, `--duration` passes or Ctrl-C, and writes the report
folder `run` writes, under OUT/record/<name>/. The command sends and receives whatever its own
clients do: without request boundaries, the samples are judged against time (`drift`,
harness.judge.over_time). With `--traffic`, a scenario's HTTP traffic is sent to it instead,
through serve mode itself (`with_command`).

The agent follows the command's Python children (`subprocess`, `multiprocessing`, `os.fork`),
each sampled on its own and summed (`harness.record.followed`): `processes.csv` holds every
process's rows, the summary each one's figures and what kvmem could not see.

The first process's agent also walks the holders of its MLX arrays (`harness.agent.kvmem_holders`)
at the first drain, at each drain once the recording has passed the next power of two seconds,
and at the last drain while the command still runs: a program at work, so nothing is collected.
Each walk goes to holders.csv at the last sample at or before it, and `drift` names the groups
that grew from the first walk to the last. Children are not walked.

The command's output goes to a log beside the report while it runs, moved into the report
folder at the end (`command.log`). The command never outlives kvmem: it is stopped, with its
process group, however the recording ends, and the report is written on Ctrl-C too (a second
Ctrl-C waits for it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from rich.console import Console
from rich.live import Live
from rich.text import Text

from ..common.child import how
from ..common.errors import BadInput, cannot_write
from ..common.names import flaw
from ..common.units import format_bytes
from ..judge.detectors import DetectSpec
from ..judge.expect import ExpectSpec
from ..judge.metrics import RunFacts
from ..judge.over_time import describe, fit, per_second
from ..judge.summary import ModelFacts, Summary
from ..pipeline.judged import Measured
from ..pipeline.judged import summarize as judged
from ..pipeline.suite import write
from ..report import writing as report
from ..run.agented import Agented, AgentSettings, ServerError
from ..run.environment import environment as describe_environment
from ..run.probe import to_frame
from ..run.server_engine import free_port
from ..scenario import Variant
from ..scenario.server import ServerSpec
from .followed import REPLY_TIMEOUT, Family, Walk, combine, holder_rows, next_walk, origin

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

SCENARIO = "record"  # reports go to OUT/record/<name>/, the scenario a summary names
DRAIN_EVERY = 1.0    # seconds between two drains of the agent's rows
QUIET_EVERY = 10.0   # seconds between two progress lines where no terminal shows a live one
PORT = "{port}"
PROCESSES = "processes.csv"  # every process's own rows, in the report folder
_PYTHON = re.compile(r"^(python[0-9.]*|pypy[0-9.]*)$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class Settings:
    """What `kvmem record` was asked: the command's words, the report's name and folder, the
    agent's period and what it reads, when to stop, and the budgets `drift` judges."""

    command: list[str]
    name: str
    out: Path
    period: float = 0.1
    duration: float | None = None
    logical: str | None = None
    cap: str | None = None
    budget: int | None = None
    rate: int | None = None
    ready_timeout: float = 120.0
    holders: bool = True

    @property
    def folder(self) -> Path:
        return self.out / SCENARIO / self.name

    @property
    def log(self) -> Path:
        """Where the command writes while it runs: beside the report folder, which is replaced
        as a unit at the end (the log then moves into it)."""
        return self.out / SCENARIO / f"{self.name}.command.log"


@dataclass(frozen=True)
class Ending:
    """How the recording ended: the status its summary says, the error, the command's exit
    status where it exited, and a line for the terminal."""

    status: str
    note: str
    error: str | None = None
    code: int | None = None


# -- names and ports ---------------------------------------------------------------------------

def default_name(command: list[str]) -> str:
    """The report's name from the command: `-m`'s module or the script for a Python, else the
    program (`serve.sh` → `serve`); `command` where nothing usable is left."""
    words = list(command)
    program = PurePath(words[0]).name if words else ""
    picked = program
    if _PYTHON.match(program):
        rest = words[1:]
        if "-m" in rest and rest.index("-m") + 1 < len(rest):
            picked = rest[rest.index("-m") + 1]
        elif rest and not rest[0].startswith("-"):
            picked = PurePath(rest[0]).stem
    else:
        picked = PurePath(program).stem or program
    name = _UNSAFE.sub("_", picked).lstrip(".")[:100]
    return name if name and flaw(name) is None else "command"


def checked_name(name: str) -> str:
    """A `--name` that can be one folder of the report."""
    problem = flaw(name)
    if problem is not None:
        raise BadInput(f"--name {name!r} {problem.value}: it names the report's folder")
    return name


def placed(command: list[str]) -> tuple[list[str], int | None]:
    """The command with `{port}` in any word replaced by a free port, and that port (None where
    no word asks for one). Only `{port}` is replaced: other braces are the command's own."""
    if not any(PORT in word for word in command):
        return list(command), None
    port = free_port()
    return [word.replace(PORT, str(port)) for word in command], port


# -- sampling ----------------------------------------------------------------------------------

class Recording:
    """The command with its agents (its first process's and each child's), and the rows they
    send: `start`, `watch` until an ending, `stop` (a last drain, then the whole process
    group)."""

    def __init__(self, settings: Settings, words: list[str]):
        self.settings = settings
        # Unbuffered unless the user's environment says otherwise: its log reads as it runs
        # (`tail -f`), and what it printed before kvmem stopped it is there.
        env = {"PYTHONUNBUFFERED": "1", **os.environ}
        self.agented = Agented(words, env, AgentSettings(
            settings.period, settings.logical, settings.cap, follow=True), settings.log,
            what="the command")
        self.family: Family | None = None  # the command's processes, once the first is up
        self.began: float | None = None   # when sampling began, on kvmem's monotonic clock
        self.walks: list[Walk] = []
        self._walk_after = 0.0  # the elapsed seconds after which a drain walks again
        self._asking = False  # a drain in progress: cut short, its answers are not to be read
        self._stopped = False

    def start(self) -> None:
        timeout = self.settings.ready_timeout
        self.agented.start(time.monotonic() + timeout, timeout)
        self.family = Family(self.agented.hello)
        self.began = time.monotonic()

    @property
    def elapsed(self) -> float:
        return 0.0 if self.began is None else time.monotonic() - self.began

    def drain(self, when: str, last: bool = False) -> bool:
        """The rows every process sampled since the last drain, with a walk of the first
        process's holders where one is due (`next_walk`) or `last`; False where the command
        has exited meanwhile. A counter the command's code replaced fails the recording."""
        walking = self.settings.holders and (last or self.elapsed >= self._walk_after)
        self._asking = True
        try:
            answer = self.agented.ask({"op": "rows", "holders": walking}, when, REPLY_TIMEOUT)
        except ServerError:
            self._asking = False
            if self.agented.exited(wait=1.0) is not None:
                return False
            raise
        assert self.family is not None
        if "holders" in answer:
            self.walks.append(Walk(answer["now"], answer["holders"], answer["census"]))
            self._walk_after = next_walk(self.elapsed)
        self.family.kept(self.family.processes[0], answer)
        self.family.drain(self.agented.followers, when)
        self._asking = False
        self.family.look(self.agented.pid)
        return True

    def rows(self) -> np.ndarray:
        """The report's samples: the processes' sum."""
        return combine([] if self.family is None else self.family.processes)

    def watch(self, ticker: Ticker) -> Ending:
        """Drain about once a second until the command exits or `duration` passes."""
        duration = self.settings.duration
        following = time.monotonic() + DRAIN_EVERY
        while True:
            code = self.agented.exited()
            if code is not None:
                return self.exited(code)
            now = time.monotonic()
            if duration is not None and self.elapsed >= duration:
                return Ending("ok", f"stopped after --duration {duration:g} s")
            if now >= following:
                if self.drain("while recording"):
                    ticker.show(self.rows(), self.elapsed)
                following = now + DRAIN_EVERY
            time.sleep(0.05)

    def exited(self, code: int) -> Ending:
        """A command that exited: fine with status 0, else a failed recording with its output."""
        after = f"after {self.elapsed:.1f} s of recording"
        if code == 0:
            return Ending("ok", f"the command exited with status 0 {after}", code=0)
        return Ending("failed", f"the command {how(code)} {after}",
                      str(self.agented.failure(f"the command {how(code)} {after}")), code)

    def failed(self, exc: ServerError) -> Ending:
        code = self.agented.exited() if self.agented.process is not None else None
        return Ending("failed", "the recording failed", str(exc), code)

    def stop(self) -> None:
        """A last drain (not after a drain cut short: its answers would be read as the next):
        of every process while the command still runs, else of the children it left; then the
        agents and the command's whole process group."""
        if self._stopped:
            return
        self._stopped = True
        try:
            running = self.agented.process is not None and self.agented.exited() is None
            if running and self.agented.connection is not None and not self._asking:
                self.drain("at the end of the recording", last=True)
            elif self.family is not None and not self._asking:
                self.family.drain(self.agented.followers, "at the end of the recording")
        except ServerError:
            pass  # what was drained before is kept
        finally:
            self.agented.stop()

    def frame(self) -> pd.DataFrame:
        return to_frame(self.rows())

    def holders(self) -> pd.DataFrame:
        """holders.csv's rows: each walk at the report's sample at or before it."""
        processes = [] if self.family is None else self.family.processes
        return holder_rows(self.walks, self.rows(), origin(processes))

class Ticker:
    """Progress: a live line on a terminal, else a line every QUIET_EVERY seconds at most."""

    def __init__(self, console: Console):
        self.console = console
        self.live = (Live(console=console, auto_refresh=False, transient=True)
                     if console.is_terminal else None)
        self.printed = -QUIET_EVERY

    def __enter__(self) -> Ticker:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()

    def show(self, rows: np.ndarray, elapsed: float) -> None:
        line = progress(rows, elapsed)
        if self.live is not None:
            self.live.update(Text(line), refresh=True)
        elif elapsed - self.printed >= QUIET_EVERY:
            self.console.print(line, highlight=False)
            self.printed = elapsed


def progress(rows: np.ndarray, elapsed: float) -> str:
    """`recording 12 s · 118 samples · MLX active 118 MiB · RSS 260 MiB · growth 10 MiB/s`."""
    words = [f"recording {elapsed:.0f} s", f"{len(rows)} samples"]
    if len(rows):
        words += [f"MLX active {format_bytes(int(rows['active'][-1]))}",
                  f"RSS {format_bytes(int(rows['rss'][-1]))}"]
    line = fit(rows["time"], rows["active"]) if len(rows) else None
    if line is not None:
        words.append(f"growth {per_second(line.slope)} (r²={line.r2:.2f})")
    return " · ".join(words)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[list[int]]:
    """Ctrl-C and SIGTERM wait until the block ends (the signals that came are listed): stopping
    the command and writing its report are not cut short by a second one."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, frame: came.append(signum))
                for sig in held}
    try:
        yield came
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# -- the report --------------------------------------------------------------------------------

def thresholds(settings: Settings) -> DetectSpec:
    """Every detector's defaults, `drift` with the budgets stated."""
    stated = {key: value for key, value in (("budget", settings.budget), ("rate", settings.rate))
              if value is not None}
    return DetectSpec.model_validate({"drift": stated})


def summarize(settings: Settings, frame: pd.DataFrame, ending: Ending, wall_s: float,
              processes: list[dict[str, Any]], notes: list[str],
              holders: pd.DataFrame) -> Summary:
    """The recording's summary, as `run` writes one (harness.pipeline.judged): findings, with the
    holders they name, and expectations where sampling went as planned, the figures of
    whatever samples there are."""
    run = Measured(
        scenario=SCENARIO, variant=settings.name, description=shlex.join(settings.command),
        status=ending.status, error=ending.error, exit_status=ending.code,
        last_step=len(frame), facts=RunFacts(wall_s, 0), environment=describe_environment(),
        given={"model": ModelFacts(engine="record", processes=processes, notes=notes)},
        nulls=("holders",))
    summary = judged(run, frame, holders, thresholds(settings), ExpectSpec())
    return summary.at(settings.folder / "summary.json")


def finish(settings: Settings, recording: Recording, ending: Ending, wall_s: float
           ) -> Summary:
    """Write the report folder, then move the command's log into it and add each process's
    rows."""
    frame = recording.frame()
    if ending.status == "ok" and frame.empty:
        ending = Ending("failed", "the agent took no sample",
                        "the command ended before its agent took a sample", ending.code)
    family = recording.family
    facts = [] if family is None else [process.facts() for process in family.processes]
    notes = [] if family is None else family.notes()
    holders = recording.holders()
    summary, written = write(summarize(settings, frame, ending, wall_s, facts, notes, holders),
                             frame, holders=holders)
    if written:
        with contextlib.suppress(OSError):
            os.replace(settings.log, settings.folder / "command.log")
    if written and family is not None:
        with contextlib.suppress(OSError):
            family.per_process().to_csv(settings.folder / PROCESSES, index=False)
    return summary


def seen(summary: Summary) -> list[str]:
    """Each process a recording sampled, in a line, where it sampled more than one, then what
    it could not see."""
    model = summary.model
    processes = (model.processes if model else None) or []
    lines = [f"process {p['pid']}{' (forked)' if p['forked'] else ''}, {p['command']}: MLX "
             f"active {format_bytes(p['active'])} at its last sample (highest "
             f"{format_bytes(p['active_max'])}), RSS {format_bytes(p['rss'])}, {p['samples']} "
             "samples" + (", exited" if p["exited"] else "")
             for p in processes] if len(processes) > 1 else []
    return lines + [f"note: {note}" for note in (model.notes if model else None) or []]


def trend(frame: pd.DataFrame) -> str | None:
    """The recording's trend in a line, finding or not: MLX active memory's and RSS's."""
    active = fit(frame["time"], frame["active"]) if len(frame) else None
    if active is None:
        return None
    rss = fit(frame["time"], frame["rss"])
    return (f"MLX active memory {describe(frame, 'active', active)}"
            + ("" if rss is None else f"; RSS {describe(frame, 'rss', rss)}"))


@dataclass(frozen=True)
class Recorded:
    """What a recording gives the command line: its summary, how it ended, its trend."""

    summary: Summary
    ending: Ending
    trend: str | None


def record(settings: Settings, console: Console) -> Recorded:
    """Record the command until it exits, `duration` passes or Ctrl-C, and write its report.

    An interrupt is raised again once the command is stopped and the report written.
    """
    with report.reserve(settings.out):
        try:
            settings.log.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise cannot_write(settings.log.parent, exc) from None
        words, port = placed(settings.command)
        if port is not None:
            console.print(f"{PORT} is port {port}", highlight=False)
        console.print(f"the command's output goes to {settings.log}", highlight=False)
        recording, began = Recording(settings, words), time.monotonic()
        interrupted = False
        try:
            try:
                recording.start()
                with Ticker(console) as ticker:
                    ending = recording.watch(ticker)
            except KeyboardInterrupt:
                interrupted, ending = True, Ending("ok", "stopped by an interrupt (Ctrl-C)")
            except ServerError as exc:
                ending = recording.failed(exc)
            with deferred_interrupts() as came:
                recording.stop()
                summary = finish(settings, recording, ending, time.monotonic() - began)
        finally:
            recording.stop()
    result = Recorded(summary, ending, trend(recording.frame()))
    if interrupted or came:
        for line in [*seen(summary), *filter(None, [result.trend])]:
            console.print(line, highlight=False)
        console.print(f"{ending.note}; report written to {settings.folder}/", highlight=False)
        raise KeyboardInterrupt
    return result


def check_agent_paths(logical: str | None, cap: str | None) -> None:
    """`--logical` and `--cap` as serve mode's `server.logical` and `server.cap` are checked."""
    try:
        ServerSpec.model_validate({"logical": logical, "cap": cap})
    except ValidationError as exc:
        raise BadInput(_problem(exc, "--")) from None


def _problem(exc: ValidationError, prefix: str) -> str:
    """A validation error in one line: `--logical: expected module:Class.attribute, got ...`."""
    problem = exc.errors()[0]
    where = ".".join(str(part) for part in problem["loc"]) or "cap"
    return f"{prefix}{where}: {problem['msg'].removeprefix('Value error, ')}"


# -- traffic from a scenario -------------------------------------------------------------------

def with_command(variants: list[Variant], command: list[str],
                 changes: dict[str, Any]) -> list[Variant]:
    """Each server variant with `server.command` replaced by `command` (its `args` still
    appended) and `changes` to the server's other fields; validated as a scenario's server is,
    so a command without `{port}` is bad input."""
    if not any(PORT in word for word in command):
        raise BadInput("--traffic: the command must say where to listen with {port} (kvmem "
                       "picks a free port and sends the scenario's traffic there)")
    changed = []
    for variant in variants:
        if variant.spec.engine != "server":
            raise BadInput(f"{variant.path}: variant {variant.name!r} has engine "
                           f"{variant.spec.engine}: --traffic sends the HTTP traffic of "
                           "engine: server variants")
        stated = variant.spec.serving().model_dump(exclude_unset=True)
        try:
            server = ServerSpec.model_validate({**stated, "command": command, **changes})
        except ValidationError as exc:
            raise BadInput(_problem(exc, "--traffic: server.")) from None
        spec = variant.spec.model_copy(update={"server": server})
        changed.append(dataclasses.replace(variant, spec=spec))
    return changed
