"""Command line: `python -m harness` and the `kvmem` script are this one parser.

Exit status: 0 every expectation held, 1 an expectation (or comparison) failed, 2 bad input or a
run that could not complete. Bad input is one line naming the file and the field, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import baseline, compare, geometry
from . import noise
from .isolation import DEFAULT_TIMEOUT
from .report import ReportError
from .scenario import ScenarioError, discover, load
from .suite import exit_status, run_variants, table

DEFAULT_SCENARIOS = Path("scenarios")


def _run(args: argparse.Namespace, console: Console) -> int:
    scenarios = []
    for path in discover(args.paths):
        scenarios.extend(load(path, args.variant))
    if not scenarios:
        raise ScenarioError(f"{', '.join(args.paths)}: no scenario files (*.yaml) found")
    summaries = run_variants(scenarios, Path(args.out), console, args.timeout)
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
    """Print summaries; a file that is not one is bad input naming the file and the field."""
    path = Path(args.report)
    try:
        files = [path] if path.is_file() else sorted(path.rglob("summary.json"))
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not files:
        raise ScenarioError(f"{path}: no summary.json found")

    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def checked(file: Path) -> dict:
        """The summary in `file`, its text escaped for rich markup, with defaults filled in."""
        def bad(where: str, expected: str) -> ScenarioError:
            return ScenarioError(f"{file}: not a valid summary: {where}: expected {expected}")

        try:
            data = json.loads(file.read_bytes().decode("utf-8"))
        except OSError as exc:
            raise ScenarioError(f"{file}: cannot read: {exc.strerror or exc}") from None
        except UnicodeDecodeError:
            raise ScenarioError(f"{file}: not a valid summary: not UTF-8 text") from None
        except ValueError as exc:  # JSONDecodeError is a ValueError
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ScenarioError(f"{file}: not a valid summary: corrupt JSON: {reason}") from None
        except RecursionError:
            raise ScenarioError(f"{file}: not a valid summary: JSON nested too deeply") from None
        if not isinstance(data, dict):
            raise bad("(top level)", "a JSON object")
        for key in ("scenario", "variant", "status"):
            if not isinstance(data.get(key), str):
                raise bad(key, "text" if key in data else "text (missing)")
        metrics = data.get("metrics")
        if not isinstance(metrics, dict):
            raise bad("metrics", "an object" if "metrics" in data else "an object (missing)")
        for key in ("peak", "steady"):
            if metrics.get(key) is not None and not number(metrics[key]):
                raise bad(f"metrics.{key}", "a number of bytes")
        findings = data.get("findings", [])
        if not isinstance(findings, list):
            raise bad("findings", "a list")
        for i, finding in enumerate(findings):
            if not isinstance(finding, dict):
                raise bad(f"findings.{i}", "an object")
            for key in ("kind", "message"):
                if not isinstance(finding.get(key), str):
                    raise bad(f"findings.{i}.{key}", "text")
        expectations = data.get("expectations", [])
        if not isinstance(expectations, list):
            raise bad("expectations", "a list")
        for i, item in enumerate(expectations):
            if not isinstance(item, dict):
                raise bad(f"expectations.{i}", "an object")
            if not isinstance(item.get("ok"), bool):
                raise bad(f"expectations.{i}.ok", "true or false")
        passed = data.get("passed", data["status"] == "ok" and all(e["ok"] for e in expectations))
        if not isinstance(passed, bool):
            raise bad("passed", "true or false")
        error = data.get("error")
        if data["status"] != "ok" and not isinstance(error, (str, type(None))):
            raise bad("error", "text")
        def text(value: object) -> str:
            return escape(str(value))  # a field may hold [markup] that rich would interpret

        return {
            "scenario": text(data["scenario"]), "variant": text(data["variant"]),
            "status": text(data["status"]),
            "error": text((error or "").strip() or f"run {data['status']} (no error recorded)"),
            "metrics": {k: metrics.get(k) for k in ("peak", "steady")},
            "findings": [{"kind": text(f["kind"]), "count": text(f.get("count", "?")),
                          "message": text(f["message"])} for f in findings],
            "expectations": [{"ok": e["ok"], "name": text(e.get("name", "?")),
                              "expected": text(e.get("expected", "?")),
                              "actual": text(e.get("actual", "?"))} for e in expectations],
            "passed": passed,
        }

    summaries = [checked(file) for file in files]
    console.print(table(summaries))
    for s in summaries:
        for f in s["findings"]:
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
    run.add_argument("--timeout", type=_seconds, metavar="SECONDS",
                     help="kill a variant that runs longer (default: the scenario's timeout, "
                          f"else {DEFAULT_TIMEOUT:g} s)")
    run.set_defaults(handler=_run)
    listing = sub.add_parser("list", help="list bundled scenarios and model presets")
    listing.add_argument("--dir", default=str(DEFAULT_SCENARIOS), help="scenario folder")
    listing.set_defaults(handler=_list)
    show = sub.add_parser("show", help="print a report's summary")
    show.add_argument("report", help="a summary.json, a variant folder or a report folder")
    show.set_defaults(handler=_show)
    compare.add_parser(sub)
    baseline.add_parser(sub)
    noise.add_parser(sub)
    return top


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM ends a run as Ctrl-C does: the running child is killed, written reports stay."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # Logs in CI are wide; a terminal keeps its own width.
    console = Console(width=None if sys.stdout.isatty() else 160)
    errors = Console(stderr=True, soft_wrap=True)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        return args.handler(args, console)
    except (ScenarioError, ReportError) as exc:
        errors.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False)
        return 2
    except KeyboardInterrupt:
        errors.print("[red]interrupted[/red]: the running variant was stopped; reports already "
                     "written are kept", highlight=False)
        return 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
