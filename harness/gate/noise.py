"""Run-to-run noise: each variant run N times, the spread of its step peak measured and recorded.

On CPU the step peak moves between identical runs (an MLX worker thread frees inputs
asynchronously): mlx-lm's rotating `before` read 312.03 MiB in 11 of 12 runs and 304.05 MiB once,
twice the gate's 4 MiB floor. A baseline recorded with its measured spread lets the gate widen
its floor to that spread (harness.gate.compare.NOISE_MARGIN). Active-byte metrics are exact: if they
differ between runs, that is a real nondeterminism, said loudly and never absorbed.

A variant's report is its median run (by peak), with a top-level `noise` block:

    {"runs": 5, "peak": {"min", "max", "spread", "values"}, "largest_spike": {...},
     "nondeterministic": {metric: {...} for each exact metric that differed}, "passed": 5}
"""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..metrics import EXACT, NOISY
from ..summary_io import invalid
from ..units import format_bytes, mib

DEFAULT_RUNS = 5
DEFAULT_OUT = "reports-noise"  # beside `kvmem run`'s reports, so a walk of one never finds both


def _span(values: list[float]) -> dict:
    return {"min": min(values), "max": max(values), "spread": max(values) - min(values),
            "values": values}


def block(runs: list[dict]) -> dict:
    """The `noise` block of one variant's completed runs (in the order they ran)."""
    metrics = [run["metrics"] for run in runs]
    return {
        "runs": len(runs),
        **{name: _span([m[name] for m in metrics]) for name in NOISY},
        "nondeterministic": {name: _span([m[name] for m in metrics]) for name in EXACT
                             if len({m[name] for m in metrics}) > 1},
        "passed": sum(bool(run.get("passed")) for run in runs),
    }


def combine(runs: list[dict]) -> tuple[int, dict]:
    """Which run stands for a variant, and its summary with the `noise` block.

    The median run by peak (the lower of the two middle ones for an even count, the earlier of
    equal peaks), so the recorded figures are ones a run really produced. A run that did not
    complete, or completed without the metrics the gate compares, makes the whole measurement
    fail: its summary is reported, with which run it was.
    """
    for index, run in enumerate(runs):
        problem = (run.get("error") or run["status"]) if run["status"] != "ok" else invalid(run)
        if run["status"] != "ok" or problem:
            status = run["status"] if run["status"] != "ok" else "failed"
            return index, {**run, "status": status, "passed": False,
                           "error": f"run {index + 1} of {len(runs)}: {problem}"}
    order = sorted(range(len(runs)), key=lambda i: (runs[i]["metrics"]["peak"], i))
    chosen = order[(len(runs) - 1) // 2]
    return chosen, {**runs[chosen], "noise": block(runs)}


def warnings(summaries: list[dict]) -> list[str]:
    """What a repeated measurement found that the gate cannot absorb: exact metrics that
    differed between runs, expectations that held in some runs only."""
    lines = []
    for s in summaries:
        noise, label = s.get("noise"), f"{s['scenario']}/{s['variant']}"
        if not noise:
            continue
        for name, span in noise["nondeterministic"].items():
            lines.append(f"{label}: {name} differed across {noise['runs']} runs "
                         f"({span['min']:,} to {span['max']:,} B): active bytes must be "
                         "identical run to run; this is a real nondeterminism, not noise")
        if noise["passed"] != noise["runs"]:
            lines.append(f"{label}: expectations held in {noise['passed']} of {noise['runs']} "
                         "runs")
    return lines


def table(summaries: list[dict]) -> Table:
    """One row per variant: the median peak, the range and spread of peak and spike."""
    grid = Table(title="kvmem run-to-run noise")
    for column in ("scenario", "variant", "runs", "peak MiB", "peak min–max MiB", "peak spread",
                   "spike spread", "exact metrics", "result"):
        grid.add_column(column, no_wrap=column in ("scenario", "variant"),
                        justify="right" if column in ("runs", "peak MiB") else "left")
    for s in summaries:
        noise = s.get("noise")
        if not noise:
            first = (s.get("error") or s["status"]).splitlines()[0]
            grid.add_row(s["scenario"], s["variant"], "-", "-", "-", "-", "-", "-",
                         f"[red]{s['status']}: {escape(first)}[/red]")
            continue
        peak, spike = noise["peak"], noise["largest_spike"]
        differ = ", ".join(noise["nondeterministic"])
        exact = f"[bold red]DIFFER: {differ}[/bold red]" if differ else "[green]identical[/green]"
        result = ("[green]ok[/green]" if noise["passed"] == noise["runs"] else
                  f"[red]expectations held in {noise['passed']} of {noise['runs']}[/red]")
        grid.add_row(s["scenario"], s["variant"], str(noise["runs"]),
                     mib(s["metrics"]["peak"]), f"{mib(peak['min'])}–{mib(peak['max'])}",
                     format_bytes(peak["spread"]), format_bytes(spike["spread"]), exact, result)
    return grid
