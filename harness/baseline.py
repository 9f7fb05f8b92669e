"""Committed baselines: `baseline update` records the suite's summaries, `baseline check` runs the
suite again and compares with them.

Baselines live under `<dir>/<backend>/<scenario>/<variant>.json`, one summary each, because
figures from different backends never compare. Each file is written atomically, so an
interrupted update leaves every baseline either old or new, never half written. The three path
components come from the summary, which may be hand-written: each must be one plain name, so
an update never writes outside its folder.
"""

from __future__ import annotations

import argparse
import json
import sys
import unicodedata
from pathlib import Path, PurePosixPath, PureWindowsPath

from rich.console import Console
from rich.markup import escape

from harness.compare import (CompareError, Summary, add_options, checked, compare, emit, load,
                             thresholds)
from harness.noise import run_count, warnings

DEFAULT_PATHS = ["scenarios"]


def _unsafe(component: object) -> str | None:
    """Why a backend, scenario or variant name cannot be one path component, or None."""
    if not isinstance(component, str):
        return "is not a string"
    if not component:
        return "is empty"
    if component in (".", ".."):
        return "is a relative folder"
    if "/" in component or "\\" in component:
        return "contains a path separator"
    if PurePosixPath(component).is_absolute() or PureWindowsPath(component).anchor:
        return "is an absolute path"
    if any(unicodedata.category(c) == "Cc" for c in component):
        return "contains a control character"
    return None


def baseline_path(root: Path, summary: Summary) -> Path:
    """`root/<backend>/<scenario>/<variant>.json`; refuses names that would leave `root`."""
    parts = {"environment.backend": summary.backend, "scenario": summary.data["scenario"],
             "variant": summary.data["variant"]}
    for field, value in parts.items():
        reason = _unsafe(value)
        if reason:
            raise CompareError(f"{summary.path}: {field} {value!r} {reason}: it must be one "
                               "plain name to place a baseline")
    backend, scenario, variant = parts.values()
    return root / backend / scenario / f"{variant}.json"


def store(summaries: list[Summary], root: Path) -> tuple[list[Path], list[Summary]]:
    """Write the summaries of completed runs as baselines; return the paths and the runs left out.

    Every summary is checked before the first is written, so bad input records nothing.
    """
    from harness.report import atomic_text

    planned, skipped = [], []
    for summary in summaries:
        if not summary.ok:
            skipped.append(summary)
            continue
        planned.append((baseline_path(root, checked(summary)), summary))
    for path, summary in planned:
        try:
            atomic_text(path, json.dumps(summary.data, indent=2) + "\n")
        except OSError as exc:
            raise CompareError(f"{path}: cannot write: {exc.strerror or exc}") from None
    return [path for path, _ in planned], skipped


def run_suite(paths: list[str], reports: Path, runs: int = 1) -> list[Summary]:
    """Run every variant of the scenarios under `paths`, writing reports under `reports`.

    With `runs` > 1 each variant runs that many times and its report is the median run's, with
    the measured spread of peak and spike (see harness.noise).
    """
    from harness.scenario import ScenarioError, discover, load as load_scenarios
    from harness.suite import run_repeated, run_variants

    scenarios = [s for path in discover(paths) for s in load_scenarios(path)]
    if not scenarios:
        raise ScenarioError(f"{', '.join(map(str, paths))}: no scenario files (*.yaml) found")
    console = Console(stderr=True)
    if runs > 1:
        results = run_repeated(scenarios, runs, reports, console)
        for line in warnings(results):
            console.print(f"[bold red]warning:[/bold red] {escape(line)}", highlight=False)
    else:
        results = run_variants(scenarios, reports, console)
    return [checked(Summary(reports / r["scenario"] / r["variant"] / "summary.json", r))
            for r in results]


def _head(args: argparse.Namespace) -> list[Summary]:
    runs = getattr(args, "runs", 1)
    if args.source:
        if runs > 1:
            raise CompareError(f"--runs {runs} measures by running the suite; it cannot be "
                               "combined with --from (record `kvmem noise` reports instead)")
        summaries = load(args.source)
        if not summaries:
            raise CompareError(f"{args.source}: no summaries found")
        return summaries
    return run_suite(args.paths or DEFAULT_PATHS, Path(args.reports), runs)


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
    update.add_argument("--runs", type=run_count(1), default=1, metavar="N",
                        help="run each variant N times and record the median run with the "
                             "measured spread of peak and spike (default: 1)")
    add_options(check)
