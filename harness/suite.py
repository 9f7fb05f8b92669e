"""Runs scenario variants end to end: execute, detect, check, write the reports.

This is the one path from a scenario to its summary: the CLI's `run`, the baseline commands and
the tests all go through `run_variants`.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import detect, report
from .isolation import RunOutcome, execute
from .probe import to_frame
from .runner import planned_steps
from .scenario import Scenario


def summarize(outcome: RunOutcome, environment: dict) -> tuple[pd.DataFrame, list, dict]:
    """Samples, findings and the summary dict of one executed variant."""
    spec = outcome.scenario.spec
    frame = to_frame(outcome.rows)
    findings, figures, expectations = [], {}, []
    if outcome.status == "ok" and not frame.empty:
        findings = detect.detect(frame, spec.detect, environment["backend"])
        figures = detect.metrics(frame, findings, spec.detect)
        expectations = detect.check(spec.expect, findings, figures)
    figures["wall_s"] = round(outcome.wall_s, 3)
    figures["estimate"] = outcome.estimate
    summary = {
        "schema": report.SCHEMA,
        "scenario": spec.name,
        "variant": outcome.scenario.variant,
        "scenario_file": str(outcome.scenario.path),
        "description": spec.description,
        "status": outcome.status,
        "error": outcome.error,
        "exit_status": outcome.exit_status,
        "last_step": outcome.last_step,
        "metrics": figures,
        "findings": [f.to_dict() for f in findings],
        "expectations": expectations,
        "passed": outcome.status == "ok" and all(e["ok"] for e in expectations),
        "compare": {metric: tolerance.model_dump(mode="json")
                    for metric, tolerance in spec.expect.compare.items()},
        "series": {"active": report.series(frame)},
        "environment": environment,
    }
    return frame, findings, summary


def run_variants(scenarios: list[Scenario], out: Path,
                 console: Console | None = None) -> list[dict]:
    """Execute each variant in its own process and write its report under out/scenario/variant."""
    console = console or Console(stderr=True)
    environment = report.environment()
    summaries: list[dict] = []
    frames: dict[str, dict[str, pd.DataFrame]] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("steps"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        for scenario in scenarios:
            label = f"{scenario.name}/{scenario.variant}"
            task = progress.add_task(label, total=planned_steps(scenario.spec))
            outcome = execute(scenario, lambda n: progress.update(task, completed=n))
            progress.update(task, completed=outcome.last_step,
                            description=f"{label} [{outcome.status}]")
            if outcome.status == "ok":
                # The plan is an estimate (prefix hits skip steps, re-prefills add some): a
                # finished run's bar ends full at the steps it took.
                progress.update(task, total=outcome.last_step)
            frame, findings, summary = summarize(outcome, environment)
            report.write_variant(out / scenario.name / scenario.variant, frame, summary, findings)
            if not frame.empty:  # a refused variant has no samples to draw
                frames.setdefault(scenario.name, {})[scenario.variant] = frame
            summaries.append(summary)
    for name, by_variant in frames.items():
        if len(by_variant) > 1:
            report.plot_overlay(by_variant, f"{name}: variants", out / name / "memory.png")
    return summaries


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def table(summaries: list[dict]) -> Table:
    """The terminal summary: one row per variant, with its findings and failed expectations."""
    grid = Table(title="kvmem results", show_lines=False)
    for column in ("scenario", "variant", "status", "peak MiB", "steady MiB", "findings",
                   "result"):
        grid.add_column(column, justify="right" if "MiB" in column else "left",
                        no_wrap=column in ("scenario", "variant"))
    for s in summaries:
        m = s["metrics"]
        found = ", ".join(f"{f['kind']}×{f['count']}" for f in s["findings"]) or "-"
        failed = [e for e in s["expectations"] if not e["ok"]]
        if s["status"] != "ok":
            verdict = f"[red]{s['error'].splitlines()[0]}[/red]"
        elif failed:
            verdict = "[red]" + "; ".join(f"{e['name']}: expected {e['expected']}, got "
                                          f"{e['actual']}" for e in failed) + "[/red]"
        else:
            verdict = f"[green]{len(s['expectations'])} ok[/green]"
        grid.add_row(s["scenario"], s["variant"], s["status"], _mib(m.get("peak")),
                     _mib(m.get("steady")), found, verdict)
    return grid


def exit_status(summaries: list[dict]) -> int:
    """0 every expectation held, 1 one failed, 2 a run could not complete."""
    if any(s["status"] != "ok" for s in summaries):
        return 2
    return 0 if all(s["passed"] for s in summaries) else 1
