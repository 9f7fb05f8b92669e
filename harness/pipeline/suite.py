"""Runs scenario variants end to end: execute, detect, check, write the reports.

`run_variants` runs each variant once in its own process (`harness.pipeline.isolation.execute`),
then `summarize` (samples, findings, and the summary of harness.pipeline.judged) and the report
writer; with `jobs` > 1 several children run at once, admitted by memory
(`harness.pipeline.schedule`), and each report is written from the main thread as its run finishes.
`harness.pipeline.repeat` runs the whole list N times through it and keeps each variant's median run
with its measured spread.
Ctrl-C or SIGTERM during `run_variants` stops the variants running, each of which reports what
it sampled (status `interrupted`), starts no other, and raises `Interrupted` with the
summaries written; a second one stops at once, as an interrupt always did.
`harness.cli` chooses between them: `run` and `baseline check` call `run_variants`, `noise`
calls `run_repeated`, `baseline update` either (`--runs N` > 1 repeats); both baseline commands
read existing reports instead when given `--from`; `merge` (harness.pipeline.merge) joins the
reports of sharded runs. The scenario tests serve reduced specs in their own process through
the engine (tests/conftest.py) or call `execute` and `summarize`; the gate's end-to-end tests
call `run_variants`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.progress import Progress, TaskID

from ..judge.metrics import RunFacts
from ..judge.records import Finding
from ..judge.summary import Environment, Summary
from ..report import writing as report
from ..report.console import progress_bars, warn
from ..report.plots import plot_overlay
from ..run.environment import environment as describe_environment
from ..run.environment import model_folder
from ..run.holders_log import frame as holders_frame
from ..run.probe import to_frame
from ..run.workdirs import sweep
from ..scenario import ScenarioSpec, Variant
from .defaults import DEFAULT_TIMEOUT
from .isolation import RunOutcome, execute
from .judged import Measured
from .judged import summarize as judged
from .schedule import Scheduler, in_parallel, planned_steps

Ran = tuple[TaskID, RunOutcome | None]  # a variant's bar and what its run gave (None: not run)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM ended a suite early: the summaries written, those of the variants it
    stopped (status `interrupted`) among them, in suite order."""

    def __init__(self, summaries: list[Summary]):
        super().__init__()
        self.summaries = summaries


@contextlib.contextmanager
def interrupts(stop: threading.Event) -> Iterator[None]:
    """For the block, the first Ctrl-C or SIGTERM sets `stop` and the next raises
    KeyboardInterrupt. SIGINT that kvmem was started ignoring (nohup, a shell's background
    job) stays ignored; only the main thread can set handlers, so elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stopping(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    held = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        held.append(signal.SIGINT)
    previous = {sig: signal.signal(sig, stopping) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _environment(environment: Environment, outcome: RunOutcome) -> Environment:
    """kvmem's environment with the packages the variant's components loaded (the pre-run
    check saw them); for a server in an environment of its own, that environment's MLX, mlx-lm
    and required packages, which produced the figures."""
    own = outcome.model.packages if outcome.model is not None else None
    versions = {} if own is None else {"mlx": own.get("mlx", "?"),
                                       "mlx_lm": own.get("mlx-lm", "not installed")}
    folder = model_folder(outcome.variant.spec.model.path)  # the bytes a `model.path` names
    return Environment.model_validate({**environment.model_dump(), **versions,
                                       **({"model_folder": folder} if folder else {}),
                                       "packages": {**outcome.variant.packages, **(own or {})}})


def requests_frame(requests: Any) -> pd.DataFrame:
    """A server's requests (REQUEST rows) as requests.csv has them: times in seconds on the
    samples' clock, `status` ok, or disconnected (a client that gave up mid-stream on
    purpose). A request that failed ends the run, so none reads so."""
    frame = pd.DataFrame(requests)
    if frame.empty:
        return frame
    frame["status"] = frame.pop("disconnected").map({0: "ok", 1: "disconnected"})
    return frame


def summarize(outcome: RunOutcome, environment: Environment,
              out: Path = Path()) -> tuple[pd.DataFrame, list[Finding], Summary]:
    """Samples, findings and the summary of one executed variant, whose report goes to `out`
    (out/scenario/variant/summary.json)."""
    spec, variant = outcome.variant.spec, outcome.variant
    frame = to_frame(outcome.rows)
    weights = outcome.model.weights if outcome.model is not None else None
    run = Measured(
        scenario=spec.name, variant=variant.name, description=spec.description,
        status=outcome.status, error=outcome.error, exit_status=outcome.exit_status,
        last_step=outcome.last_step, facts=RunFacts(outcome.wall_s, outcome.estimate, weights),
        environment=_environment(environment, outcome),
        given={"scenario_file": str(variant.path), "compare": spec.expect.compare,
               "peak_resets": outcome.resets or None, "store_stats": outcome.store_stats,
               "model": outcome.model})
    summary = judged(run, frame, holders_frame(outcome.holders), spec.detect, spec.expect)
    return frame, summary.findings, summary.at(out / spec.name / variant.name / "summary.json")


def run_variants(variants: list[Variant], out: Path, console: Console | None = None,
                 timeout: float | None = None, jobs: int = 1,
                 scheduler: Scheduler | None = None) -> list[Summary]:
    """Execute each variant in its own process and write its report under out/scenario/variant.

    `out` is reserved first (a writable folder no other run holds). A report that cannot be
    written fails its variant, with the reason, and the others still run. `timeout` (seconds)
    overrides each scenario's own. Up to `jobs` variants run at once, each started only when
    the scheduler finds its estimate fits beside the running ones (`scheduler`, given, brings
    its own jobs, memory and log); reports are written as runs finish, while the summaries
    and each scenario's overlay keep the order of `variants`. An interrupt raises
    `Interrupted` once the variants it stopped have written their reports (module docstring).
    """
    console = console or Console(stderr=True)
    environment = describe_environment()
    scheduler = scheduler or Scheduler(jobs)
    summaries: dict[int, Summary] = {}
    frames: dict[int, pd.DataFrame] = {}
    stop = threading.Event()
    sweep()  # what runs killed outright (kill -9) left in the temporary directory
    with report.reserve(out), interrupts(stop), progress_bars(console) as progress:
        run = partial(_supervise, variants, progress, scheduler, timeout)
        with closing(_outcomes(len(variants), run, scheduler, stop)) as outcomes:
            for index, (task, outcome) in outcomes:
                variant = variants[index]
                if outcome is None or (stop.is_set() and not _served(outcome)):
                    progress.update(task, description=f"{variant.label} [not run: interrupted]")
                    continue
                _finish_bar(progress, task, variant.label, outcome)
                frame, _, summary = summarize(outcome, environment, out)
                summary, written = write(summary, frame, requests_frame(outcome.requests),
                                         holders_frame(outcome.holders))
                if not written:
                    progress.update(task, description=f"{variant.label} [failed: report not written]")
                elif not frame.empty:  # a refused variant has no samples to draw
                    frames[index] = frame
                summaries[index] = summary
        overlays(((v.scenario, v.name, frames[i]) for i, v in enumerate(variants) if i in frames),
                 out, console)
    reported = [summaries[index] for index in range(len(variants)) if index in summaries]
    if stop.is_set():
        raise Interrupted(reported)
    return reported


def _served(outcome: RunOutcome) -> bool:
    """Whether a run got as far as sampling: one refused, or stopped before it served, is not
    worth a report once the suite is interrupted."""
    return outcome.status != "refused" and len(outcome.rows) > 0


def _outcomes(count: int, run: Callable[[int, threading.Event], Ran], scheduler: Scheduler,
              stop: threading.Event) -> Generator[tuple[int, Ran], None, None]:
    """Each variant's run as it finishes: in turn for one job (each report written before the
    next variant starts, as ever; none started once `stop` is set), else from one worker
    thread per job and one more, whose child gets ready while the others serve."""
    if scheduler.jobs == 1:
        for index in range(count):
            if stop.is_set():
                return
            yield index, run(index, stop)
    else:
        yield from in_parallel(count, scheduler.jobs + 1, run, scheduler.cancel, stop)


def _supervise(variants: list[Variant], progress: Progress, scheduler: Scheduler,
               timeout: float | None, index: int, stop: threading.Event) -> Ran:
    """Run variant `index` in its child, with its own bar, admitted by the scheduler; None for
    a variant reached after an interrupt."""
    variant = variants[index]
    # One job: the bar's clock runs from the spawn, as ever; several: from the admission.
    http = variant.spec.workload.http
    soak = http is not None and http.duration is not None  # requests until a time: no total
    task = progress.add_task(variant.label, total=None if soak else planned_steps(variant.spec),
                             start=scheduler.jobs == 1)
    if stop.is_set():
        return task, None
    admit = partial(_admit, scheduler, progress, task, index, variant.label)
    try:
        outcome = execute(variant, partial(_advance, progress, task, variant.label),
                          allowed(variant.spec, timeout), admit, stop)
    finally:
        scheduler.release(index, variant.label)
    return task, outcome


def allowed(spec: ScenarioSpec, timeout: float | None = None) -> float:
    """The seconds a variant may run: `timeout` (`--timeout`), else its scenario's, else the
    default; a soak's duration on top (`workload.http.duration`)."""
    http = spec.workload.http
    soak = http.duration or 0.0 if http is not None else 0.0
    return (timeout or spec.timeout or DEFAULT_TIMEOUT) + soak


def _admit(scheduler: Scheduler, progress: Progress, task: TaskID, index: int, label: str,
           estimate: int) -> str | None:
    """The scheduler's verdict on a child's estimate; the bar says why it waits, and its clock
    starts when the variant may serve."""
    waiting = lambda reason: progress.update(task, description=f"{label} [{reason}]")
    verdict = scheduler.admit(index, label, estimate, waiting)
    progress.update(task, description=label)
    progress.start_task(task)
    return verdict


def _finish_bar(progress: Progress, task: TaskID, label: str, outcome: RunOutcome) -> None:
    progress.start_task(task)  # a child that ended before its admission never started it
    progress.update(task, completed=outcome.last_step, description=f"{label} [{outcome.status}]")
    if outcome.resets:
        progress.console.print(f"{label}: note: the measured code reset MLX's peak "
                               f"{outcome.resets} times; the step peaks are kvmem's own mark",
                               highlight=False, markup=False)
    if outcome.status == "ok":
        # The plan is an estimate (prefix hits skip steps, re-prefills add some): a finished
        # run's bar ends full at the steps it took.
        progress.update(task, total=outcome.last_step)


def overlays(frames: Iterable[tuple[str, str, pd.DataFrame]], out: Path,
             console: Console) -> None:
    """out/scenario/memory.png for each scenario with more than one drawn variant.

    `frames` are (scenario, variant, samples) with samples, in the order the legend takes.
    """
    by_scenario: dict[str, dict[str, pd.DataFrame]] = {}
    for scenario, variant, frame in frames:
        by_scenario.setdefault(scenario, {})[variant] = frame
    for name, by_variant in by_scenario.items():
        if len(by_variant) > 1:
            try:
                plot_overlay(by_variant, f"{name}: variants", out / name / "memory.png")
            except OSError as exc:
                warn(console, [f"{name}: overlay plot not written: {exc}"])


LOG_EVERY = 60.0  # seconds between a long run's progress lines where no bar is drawn (CI logs)


def _advance(progress: Progress, task: TaskID, label: str, steps: int, note: str = "") -> None:
    """The bar at `steps`; a long run's note (a server's elapsed time, memory and what is over
    its budget so far) beside its name, and, where no bar is drawn (a log), a line a minute."""
    if not note:
        progress.update(task, completed=steps)
        return
    now = time.monotonic()
    fields = next(shown.fields for shown in progress.tasks if shown.id == task)
    logged = fields.setdefault("logged", now)
    progress.update(task, completed=steps, description=f"{label} {note}")
    if not progress.console.is_terminal and now - logged >= LOG_EVERY:
        progress.update(task, logged=now)
        progress.console.print(f"{label}: {steps} requests {note}", highlight=False, markup=False)


def write(summary: Summary, frame: pd.DataFrame, requests: pd.DataFrame | None = None,
          holders: pd.DataFrame | None = None) -> tuple[Summary, bool]:
    """Write one variant's report where its summary says; a write that fails fails the variant,
    with the reason: the summary as it stands, and whether it was written."""
    try:
        report.write_variant(summary.path.parent, frame, summary, requests, holders)
    except OSError as exc:
        return summary.replace(status="failed", passed=False,
                               error=f"cannot write the report: {exc}"), False
    return summary, True


def samples(folder: Path, name: str = "samples.csv") -> pd.DataFrame:
    """A run's samples.csv (or requests.csv) as written by run_variants; empty where the run
    left none."""
    try:
        return pd.read_csv(folder / name)
    except (OSError, pd.errors.EmptyDataError):
        return pd.DataFrame()
