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

import tempfile
from pathlib import Path

from rich.console import Console

from ..judge.metrics import exact, noisy
from ..judge.summary import NoiseBlock, Summary
from ..report import writing as report
from ..scenario import Variant
from .suite import run_variants, samples, write


def run_repeated(variants: list[Variant], runs: int, out: Path,
                 console: Console | None = None, jobs: int = 1) -> list[Summary]:
    """Run every variant `runs` times; write each variant's median run under out/scenario/variant
    with the spread measured over all its runs (`combine`).

    Each round goes through run_variants (one process per variant) and runs every variant once,
    so a change in the machine's load reaches all variants alike. Rounds are written to a
    temporary folder; only the chosen runs' reports land in `out`, reserved for the whole time.
    """
    console = console or Console(stderr=True)
    with report.reserve(out), tempfile.TemporaryDirectory(prefix="kvmem-noise-") as tmp:
        rounds = []
        for index in range(runs):
            console.print(f"run {index + 1} of {runs}")
            rounds.append(run_variants(variants, Path(tmp) / f"run{index}", console, jobs=jobs))
        summaries = []
        for variant_runs in zip(*rounds, strict=True):
            summary = combine(list(variant_runs))
            frame = samples(summary.path.parent)
            where = out / summary.scenario / summary.variant / "summary.json"
            summary, _ = write(summary.at(where), frame,
                               samples(summary.path.parent, report.REQUESTS),
                               samples(summary.path.parent, report.HOLDERS))
            summaries.append(summary)
    return summaries


def _span(values: list[float]) -> dict:
    return {"min": min(values), "max": max(values), "spread": max(values) - min(values),
            "values": values}


def block(runs: list[Summary]) -> NoiseBlock:
    """The `noise` block of one variant's completed runs (in the order they ran)."""
    metrics = [run.metrics for run in runs]
    return NoiseBlock.model_validate({
        "runs": len(runs),
        **{name: _span([m[name] for m in metrics]) for name in noisy()},
        "nondeterministic": {name: _span([m[name] for m in metrics]) for name in exact()
                             if all(m.get(name) is not None for m in metrics)
                             and len({m[name] for m in metrics}) > 1},
        "passed": sum(run.passed for run in runs),
    })


def combine(runs: list[Summary]) -> Summary:
    """The run that stands for a variant, with the `noise` block (its `path` says which run).

    The median run by peak (the lower of the two middle ones for an even count, the earlier of
    equal peaks), so the recorded figures are ones a run really produced. A run that did not
    complete, or completed without the metrics the gate compares, makes the whole measurement
    fail: its summary is reported, with which run it was.
    """
    for index, run in enumerate(runs):
        problem = (run.error or run.status) if not run.ok else run.incomplete
        if problem:
            status = run.status if not run.ok else "failed"
            return run.replace(status=status, passed=False,
                               error=f"run {index + 1} of {len(runs)}: {problem}")
    order = sorted(range(len(runs)), key=lambda i: (runs[i].metrics["peak"], i))
    chosen = order[(len(runs) - 1) // 2]
    return runs[chosen].replace(noise=block(runs))


def warnings(summaries: list[Summary]) -> list[str]:
    """What a repeated measurement found that the gate cannot absorb: exact metrics that
    differed between runs, expectations that held in some runs only."""
    lines = []
    for s in summaries:
        noise = s.noise_block
        if noise is None:
            continue
        for name, span in noise.nondeterministic.items():
            lines.append(f"{s.label}: {name} differed across {noise.runs} runs "
                         f"({span.min:,} to {span.max:,} B): active bytes must be "
                         "identical run to run; this is a real nondeterminism, not noise")
        if noise.held != noise.runs:
            lines.append(f"{s.label}: expectations held in {noise.held} of {noise.runs} runs")
    return lines
