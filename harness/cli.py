"""Command line: `python -m harness` and the `kvmem` script are this one parser.

Exit status: 0 every expectation held, 1 an expectation (or comparison) failed, 2 bad input or a
run that could not complete. Bad input is one line naming the file and the field, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import baseline, compare, geometry
from .scenario import ScenarioError, discover, load
from .suite import exit_status, run_variants, table

DEFAULT_SCENARIOS = Path("scenarios")


def _run(args: argparse.Namespace, console: Console) -> int:
    scenarios = []
    for path in discover(args.paths):
        scenarios.extend(load(path, args.variant))
    if not scenarios:
        raise ScenarioError(f"{', '.join(args.paths)}: no scenario files (*.yaml) found")
    summaries = run_variants(scenarios, Path(args.out), console)
    console.print(table(summaries))
    console.print(f"reports written under {args.out}/")
    return exit_status(summaries)


def _list(args: argparse.Namespace, console: Console) -> int:
    scenarios = Table(title=f"scenarios in {args.dir}/")
    for column in ("file", "variants", "description"):
        scenarios.add_column(column)
    folder = Path(args.dir)
    for path in discover([folder]) if folder.is_dir() else []:
        try:
            variants = load(path)
            first_sentence = variants[0].spec.description.split(". ")[0].rstrip(".")
            scenarios.add_row(path.name, ", ".join(v.variant for v in variants), first_sentence)
        except ScenarioError as exc:
            scenarios.add_row(path.name, "[red]invalid[/red]", str(exc))
    console.print(scenarios)
    presets = Table(title="model presets")
    for column in ("name", "layers", "KV per token", "vocab"):
        presets.add_column(column)
    for name in geometry.PRESETS:
        g = geometry.preset(name)
        kinds = {k: sum(l.kind == k for l in g.layers) for k in geometry.KINDS}
        layers = " + ".join(f"{n} {k}" for k, n in kinds.items() if n)
        presets.add_row(name, layers, f"{g.token_bytes() / 1024:g} KiB", f"{g.vocab:,}")
    console.print(presets)
    return 0


def _show(args: argparse.Namespace, console: Console) -> int:
    path = Path(args.report)
    files = [path] if path.is_file() else sorted(path.rglob("summary.json"))
    if not files:
        raise ScenarioError(f"{path}: no summary.json found")
    summaries = []
    for file in files:
        try:
            summaries.append(json.loads(file.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ScenarioError(f"{file}: not a readable summary: {exc}") from None
    console.print(table(summaries))
    for s in summaries:
        for f in s.get("findings", []):
            console.print(f"  {s['scenario']}/{s['variant']}: [bold]{f['kind']}[/bold] {f['message']}")
    return exit_status(summaries)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="kvmem",
        description="Memory profiling and regression gate for KV-cache strategies on MLX.",
    )
    sub = top.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run scenario files or folders and write reports")
    run.add_argument("paths", nargs="+", help="scenario YAML files or folders of them")
    run.add_argument("--variant", action="append", help="run only this variant (repeatable)")
    run.add_argument("--out", default="reports", help="report folder (default: reports)")
    run.set_defaults(handler=_run)
    listing = sub.add_parser("list", help="list bundled scenarios and model presets")
    listing.add_argument("--dir", default=str(DEFAULT_SCENARIOS), help="scenario folder")
    listing.set_defaults(handler=_list)
    show = sub.add_parser("show", help="print a report's summary")
    show.add_argument("report", help="a summary.json, a variant folder or a report folder")
    show.set_defaults(handler=_show)
    compare.add_parser(sub)
    baseline.add_parser(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # Logs in CI are wide; a terminal keeps its own width.
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        return args.handler(args, console)
    except ScenarioError as exc:
        Console(stderr=True, soft_wrap=True).print(
            f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
