"""Committed baselines: `baseline update` records the suite's summaries, `baseline check` runs the
suite again and compares with them.

Baselines live under `<dir>/<backend>/<scenario>/<variant>.json`, one summary each, because
figures from different backends never compare. Each file is written atomically, so an
interrupted update leaves every baseline either old or new, never half written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from harness.compare import (CompareError, Summary, add_options, compare, emit, load,
                             thresholds)

DEFAULT_PATHS = ["scenarios"]


def baseline_path(root: Path, summary: Summary) -> Path:
    return root / summary.backend / summary.data["scenario"] / f"{summary.data['variant']}.json"


def store(summaries: list[Summary], root: Path) -> tuple[list[Path], list[Summary]]:
    """Write the summaries of completed runs as baselines; return the paths and the runs left out."""
    from harness.report import atomic_text

    written, skipped = [], []
    for summary in summaries:
        if not summary.ok:
            skipped.append(summary)
            continue
        path = baseline_path(root, summary)
        try:
            atomic_text(path, json.dumps(summary.data, indent=2) + "\n")
        except OSError as exc:
            raise CompareError(f"{path}: cannot write: {exc.strerror or exc}") from None
        written.append(path)
    return written, skipped


def run_suite(paths: list[str], reports: Path) -> list[Summary]:
    """Run every variant of the scenarios under `paths`, writing reports under `reports`."""
    from harness.scenario import ScenarioError, discover, load as load_scenarios
    from harness.suite import run_variants

    scenarios = [s for path in discover(paths) for s in load_scenarios(path)]
    if not scenarios:
        raise ScenarioError(f"{', '.join(map(str, paths))}: no scenario files (*.yaml) found")
    results = run_variants(scenarios, reports, Console(stderr=True))
    return [Summary(reports / r["scenario"] / r["variant"] / "summary.json", r) for r in results]


def _head(args: argparse.Namespace) -> list[Summary]:
    if args.source:
        summaries = load(args.source)
        if not summaries:
            raise CompareError(f"{args.source}: no summaries found")
        return summaries
    return run_suite(args.paths or DEFAULT_PATHS, Path(args.reports))


def run_update(args: argparse.Namespace, console=None) -> int:
    try:
        written, skipped = store(_head(args), Path(args.dir))
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    for summary in skipped:
        print(f"error: {summary.label}: {summary.data['status']} ({summary.data.get('error')}): "
              "no baseline written", file=sys.stderr)
    return 2 if skipped else 0


def run_check(args: argparse.Namespace, console=None) -> int:
    try:
        rel, abs_ = thresholds(args)
        head = _head(args)
        backends = sorted({s.backend for s in head})
        base = []
        for backend in backends:
            root = Path(args.dir) / backend
            if not root.is_dir():
                raise CompareError(f"{root}: no baselines for backend {backend} (record them "
                                   "with `python -m harness baseline update`)")
            base += load(root)
        if args.paths or args.source:
            # A partial run: baselines of scenarios it did not run are not "removed".
            ran = {s.data["scenario"] for s in head}
            base = [s for s in base if s.data["scenario"] in ran]
        comparison = compare(base, head, rel, abs_)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return emit(comparison, args)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("baseline", help="record or check committed baselines")
    actions = parser.add_subparsers(dest="action", required=True)
    update = actions.add_parser("update", help="run the suite and record its summaries")
    check = actions.add_parser("check", help="run the suite and compare with the baselines; "
                                             "exit 1 on regression")
    for action, handler in ((update, run_update), (check, run_check)):
        action.add_argument("paths", nargs="*",
                            help="scenario files or folders (default: scenarios)")
        action.add_argument("--dir", default="baselines", help="baselines folder")
        action.add_argument("--reports", default="reports",
                            help="where the suite's reports go (default: reports)")
        action.add_argument("--from", dest="source", metavar="REPORTS",
                            help="use the summaries under REPORTS instead of running the suite")
        action.set_defaults(handler=handler)
    add_options(check)
