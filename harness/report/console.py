"""What kvmem shows in a terminal: rich tables, progress bars, warnings.

The commands (harness.cli) parse and dispatch; this module draws. Summaries may be
hand-written, so their text is always escaped: shown as text, never read as rich markup.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..common.units import GiB, KiB, format_bytes, mib
from ..judge.metrics import BYTES, METRICS
from ..judge.summary import Summary
from ..models import presets
from ..models.geometry import KINDS, Geometry
from ..scenario import ScenarioError, discover, load_variants


def progress_bars(console: Console) -> Progress:
    """One bar per variant: its name and state, the steps served of those planned, the time."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("steps"), TimeElapsedColumn())
    return Progress(*columns, console=console, transient=False)


def warn(console: Console, lines: list[str]) -> None:
    for line in lines:
        console.print(f"[bold red]warning:[/bold red] {escape(line)}", highlight=False)


def _shown(name: str, value: float | None) -> str:
    """A metric in its results column: bytes in MiB (the header says so), others as they read."""
    metric = METRICS[name]
    if metric.unit == BYTES:
        return mib(value, 1)
    return "-" if value is None else metric.format(value)


def results(summaries: list[Summary]) -> Table:
    """The terminal summary: one row per variant, its metrics that have a column
    (harness.judge.metrics), its findings and failed expectations."""
    grid = Table(title="kvmem results", show_lines=False)
    shown = [name for name, metric in METRICS.items() if metric.column]
    for column in ("scenario", "variant", "status"):
        grid.add_column(column, no_wrap=column != "status")
    for name in shown:
        grid.add_column(f"{name} MiB" if METRICS[name].unit == BYTES else name, justify="right")
    for column in ("findings", "result"):
        grid.add_column(column)
    for s in summaries:
        found = ", ".join(f"{f.kind}×{'?' if f.count is None else f.count}"
                          + (" (warning)" if f.severity == "warning" else "") for f in s.findings)
        if not s.ok:
            verdict = f"[red]{escape(s.first_error)}[/red]"
        elif s.failed_expectations:
            verdict = "[red]" + escape("; ".join(e.describe() for e in s.failed_expectations)) + "[/red]"
        else:
            verdict = f"[green]{len(s.expectations)} ok[/green]"
        grid.add_row(escape(s.scenario), escape(s.variant), escape(s.status),
                     *(_shown(name, s.metric(name)) for name in shown), escape(found) or "-",
                     verdict)
    return grid


def failures(console: Console, summaries: list[Summary]) -> None:
    """Under the table, each run that could not complete with its whole error (the table keeps
    the first line): a server's last output, a traceback's last frames."""
    for s in summaries:
        if not s.ok and s.error and len(s.error.strip().splitlines()) > 1:
            console.print(f"[red]{escape(s.label)}[/red]: {escape(s.error.strip())}",
                          highlight=False)


def holders(console: Console, summaries: list[Summary]) -> None:
    """Under the table, the top holder of each finding that names one."""
    for s in summaries:
        for f in s.findings:
            if f.holders:
                console.print(f"{escape(s.label)}: {escape(f.kind)} {escape(f.held_by())}",
                              highlight=False)


def early_stops(console: Console, summaries: list[Summary]) -> None:
    """Under the table, each server variant whose traffic ended before its end, and why."""
    for s in summaries:
        if s.model is not None and s.model.stopped:
            console.print(f"{escape(s.label)}: stopped early: {escape(s.model.stopped)}",
                          highlight=False)


def interrupted(console: Console, summaries: list[Summary], planned: int) -> None:
    """The last line of a run cut short by Ctrl-C or SIGTERM: what it stopped, what it kept."""
    stopped = sum(s.status == "interrupted" for s in summaries)
    console.print(f"[red]interrupted[/red]: {stopped} variant(s) stopped, each report holding "
                  f"what was sampled until then; {len(summaries) - stopped} finished before; "
                  f"{planned - len(summaries)} not run", highlight=False)


def details(console: Console, summaries: list[Summary]) -> None:
    """What `kvmem show` prints under the table: findings, the model, store statistics, noise."""
    for s in summaries:
        label = escape(s.label)
        for f in s.findings:
            warning = " (warning)" if f.severity == "warning" else ""
            console.print(f"  {label}: [bold]{escape(f.kind)}[/bold]{warning} {escape(f.message)}")
            for holder in f.holders:
                console.print(f"    held by {escape(holder.describe(f.per))}", highlight=False)
        if s.holders is not None and s.holders.groups:
            top = s.holders.groups[0]
            held = s.holders
            console.print(f"  {label}: at rest (step {held.step}) the largest holder is "
                          f"{escape(top.describe())}; {mib(held.unreached, 2)} MiB of active "
                          "memory no Python path reaches"
                          + (" (approximate: this MLX cannot size buffers)"
                             if held.approximate else "")
                          + f"; {held.walks} walks, {held.seconds:g} s in all, "
                          f"{held.objects:,} objects the last", highlight=False)
            for waiting in held.pending[:1]:
                console.print(f"  {label}: the most pending arrays, whose graphs keep buffers "
                              f"MLX does not size: {escape(waiting.describe())}",
                              highlight=False)
        if s.model is not None and s.model.weights is not None:
            console.print(f"  {label}: model {escape(str(s.model.name))} "
                          f"({escape(str(s.model.engine))}, {escape(str(s.model.layers))} layers): "
                          f"weights {mib(s.model.weights, 1)} MiB, KV minimum "
                          f"{mib(s.metrics.get('minimum'), 1)} MiB")
        traffic = _traffic(s)
        if traffic:
            console.print(f"  {label}: {escape(traffic)}", highlight=False)
        if s.store_stats:
            console.print(f"  {label}: store "
                          + escape(", ".join(f"{k} {v}" for k, v in s.store_stats.items())))
        if s.noise_block is not None:
            console.print(noise([s]))


def _traffic(s: Summary) -> str | None:
    """A server's traffic in a line: requests, latency, and why it ended early, if it did."""
    model = s.model
    if model is None or model.requests is None:
        return None
    words = [f"{model.requests} requests"]
    latency = model.latency
    if latency is not None and latency.total_p50_s is not None:
        words.append(f"latency {latency.total_p50_s:g} s median, {latency.total_p95_s:g} s at "
                     f"the 95th percentile, {latency.total_max_s:g} s at most")
    if latency is not None and latency.ttft_p50_s is not None:
        words.append(f"first token {latency.ttft_p50_s:g} s median, {latency.ttft_p95_s:g} s "
                     "at the 95th percentile")
    if model.queued:
        words.append(f"{model.queued} arrivals waited for a free client")
    if model.stopped:
        words.append(f"ended early: {model.stopped}")
    return "; ".join(words)


def noise(summaries: list[Summary]) -> Table:
    """One row per variant: the median peak, the range and spread of peak and spike."""
    grid = Table(title="kvmem run-to-run noise")
    for column in ("scenario", "variant", "runs", "peak MiB", "peak min–max MiB", "peak spread",
                   "spike spread", "exact metrics", "result"):
        grid.add_column(column, no_wrap=column in ("scenario", "variant"),
                        justify="right" if column in ("runs", "peak MiB") else "left")
    for s in summaries:
        block = s.noise_block
        if block is None:
            grid.add_row(escape(s.scenario), escape(s.variant), "-", "-", "-", "-", "-", "-",
                         f"[red]{escape(s.status)}: {escape(s.first_error)}[/red]")
            continue
        peak, spike = block.spreads.get("peak"), block.spreads.get("largest_spike")
        low, high = block.ranges.get("peak", (None, None))
        differ = ", ".join(block.nondeterministic)
        exact = f"[bold red]DIFFER: {escape(differ)}[/bold red]" if differ else "[green]identical[/green]"
        result = ("[green]ok[/green]" if block.held == block.runs else
                  f"[red]expectations held in {block.held} of {block.runs}[/red]")
        grid.add_row(escape(s.scenario), escape(s.variant), str(block.runs),
                     mib(s.metrics.get("peak")), f"{mib(low)}–{mib(high)}",
                     format_bytes(peak.spread) if peak else "-",
                     format_bytes(spike.spread) if spike else "-", exact, result)
    return grid


def scenarios(folder: Path) -> Table:
    """The scenario files in `folder`: their variants and the first sentence of each description."""
    grid = Table(title=f"scenarios in {folder}/")
    for column in ("file", "variants", "description"):
        grid.add_column(column)
    for path in discover([folder]) if folder.is_dir() else []:
        try:
            variants = load_variants(path)
            first_sentence = variants[0].spec.description.split(". ")[0].rstrip(".")
            grid.add_row(escape(path.name), escape(", ".join(v.name for v in variants)),
                         escape(first_sentence))
        except ScenarioError as exc:
            grid.add_row(escape(path.name), "[red]invalid[/red]", escape(str(exc)))
    return grid


def _layers(g: Geometry) -> str:
    kinds = {k: sum(layer.kind == k for layer in g.layers) for k in KINDS}
    return " + ".join(f"{n} {k}" for k, n in kinds.items() if n)


def geometry_presets() -> Table:
    grid = Table(title="model presets")
    for column in ("name", "layers", "KV per token", "vocab"):
        grid.add_column(column)
    for name in presets.geometric():
        g = presets.geometry(name)
        grid.add_row(name, _layers(g), f"{g.token_bytes() / KiB:g} KiB", f"{g.vocab:,}")
    return grid


def model_presets() -> Table | Text:
    """The presets a real model is built from: layers, KV per token and vocabulary as the built model
    has them (read without evaluating it), and the weights' bytes in bfloat16; where mlx-lm,
    which builds them, is not installed, which extra brings it."""
    import importlib.util

    from ..models import loading as models

    if importlib.util.find_spec("mlx_lm") is None:
        return Text("real-model presets (engine: mlx_lm) are built by mlx-lm, which is not "
                    "installed: pip install 'kvmem[mlx]'")

    grid = Table(title="real-model presets (engine: mlx_lm, random weights)")
    for column in ("name", "layers", "KV per token", "vocab", "weights"):
        grid.add_column(column)
    for name in presets.buildable():
        choice = models.ModelChoice(preset=name, path=None, layers=None, vocab=None,
                                    dtype="bfloat16", bits=None, group_size=64)
        g, weights = models.describe(choice)
        grid.add_row(name, _layers(g), f"{g.token_bytes() / KiB:g} KiB", f"{g.vocab:,}",
                     f"{weights / GiB:.2f} GiB")
    return grid
