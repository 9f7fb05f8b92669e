"""The commands that keep the gate's figures across runs: `export` (a benchmark feed),
`history` (one PNG per scenario over a sequence of runs) and `publish` (a night appended to the
history record, and the static site drawn from it)."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console

from ..common.errors import cannot_write, no_summaries
from ..gate.history import DEFAULT_METRICS, FEED, points, render_benchmark, write_history
from ..gate.nightly import DEFAULT_KEEP, MAX_KEEP, Record, appended, parse_record, tonight
from ..gate.site import write_site
from ..judge.metrics import gated
from ..report import console as term
from ..store.nightly import read_nightly
from . import options


def export(args: argparse.Namespace, console: Console) -> int:
    """The summaries' gated metrics as a benchmark feed (github-action-benchmark, Bencher)."""
    summaries = options.summaries(args.reports)
    text = render_benchmark(summaries)
    left_out = [s.label for s in summaries if not s.ok]
    if left_out:
        term.warn(options.errors(), [f"left out {len(left_out)} runs that did not complete: "
                                     f"{', '.join(left_out)}"])
    if not args.out:
        sys.stdout.write(text)
        return 0
    options.write(Path(args.out), text)
    console.print(f"wrote {args.out}", highlight=False)
    return 0


def history(args: argparse.Namespace, console: Console) -> int:
    """One PNG per scenario: the metrics across the runs, in the order given."""
    runs = points(args.dirs)
    if not any(run.summaries for run in runs):
        raise no_summaries(args.dirs)
    try:
        written = write_history(runs, Path(args.out), args.metric or DEFAULT_METRICS)
    except OSError as exc:
        raise cannot_write(args.out, exc) from None
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    return 0


def publish(args: argparse.Namespace, console: Console) -> int:
    """Append the night's summaries to the history record and write the site from it."""
    summaries = options.summaries(args.reports)
    site = Path(args.site)
    previous = Path(args.previous) if args.previous else site / "history.json"
    content = read_nightly(previous)
    before = None if content is None else parse_record(previous, content)
    run = tonight(summaries, args.date or datetime.now(timezone.utc), args.commit)
    record = appended(before or Record(), run, args.keep)
    try:
        written = write_site(record, summaries, site)
    except OSError as exc:
        raise cannot_write(site, exc) from None
    if before is None:
        console.print(f"no history at {previous}: started a new one", highlight=False)
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    failed = [s.label for s in summaries if not s.ok]
    if failed:
        term.warn(options.errors(), [f"{len(failed)} runs did not complete: recorded as such, "
                                     f"left out of benchmark.json: {', '.join(failed)}"])
    console.print(f"history: {len(record.runs)} runs, from {record.runs[0].date:%Y-%m-%d} to "
                  f"{record.runs[-1].date:%Y-%m-%d}; this one {run.date:%Y-%m-%d %H:%M} UTC, "
                  f"commit {run.commit}", highlight=False)
    return 0


def add(sub: argparse._SubParsersAction) -> None:
    """`export`, `history` and `publish`."""
    exporting = sub.add_parser(
        "export", help="write the summaries' gated metrics as a benchmark feed (JSON)")
    exporting.add_argument("reports", nargs="+", metavar="REPORTS",
                           help="report folders, summary files or baselines folders")
    exporting.add_argument("--format", choices=(FEED,), default=FEED,
                           help="the feed's format (default: github-action-benchmark's "
                                "customSmallerIsBetter list)")
    exporting.add_argument("--out", help="write the JSON to FILE instead of stdout")
    exporting.set_defaults(handler=export)
    plotting = sub.add_parser(
        "history", help="plot metrics across a sequence of runs: one PNG per scenario")
    plotting.add_argument("dirs", nargs="+", metavar="DIR",
                          help="report or baselines folders, oldest first")
    plotting.add_argument("--out", required=True, help="folder for the PNGs")
    plotting.add_argument("--metric", action="append", choices=gated(),
                          help="a metric to plot (repeatable; default: "
                               f"{', '.join(DEFAULT_METRICS)})")
    plotting.set_defaults(handler=history)
    _add_publish(sub)


def _add_publish(sub: argparse._SubParsersAction) -> None:
    publishing = sub.add_parser(
        "publish", help="append a night's summaries to the history record and write a static "
                        "site: index.html, history.json, benchmark.json",
        description="Read the summaries under REPORTS as one run (one backend, one summary per "
                    "variant), append it to the history record (--previous), keep the last "
                    "--keep runs, and write the site into --site: index.html (charts of every "
                    "metric over the runs' dates, from zero), history.json (the record, for the "
                    "next night) and benchmark.json (this run as github-action-benchmark's "
                    "feed). A missing previous record starts a new history; one that cannot be "
                    "read is bad input (exit 2).")
    publishing.add_argument("reports", nargs="+", metavar="REPORTS",
                            help="the night's report folders or summary files")
    publishing.add_argument("--site", required=True, metavar="DIR", help="folder for the site")
    publishing.add_argument("--previous", metavar="FILE",
                            help="the history record to append to, as the last published site "
                                 "holds it (default: DIR/history.json)")
    publishing.add_argument("--commit", metavar="SHA",
                            help="the commit the night ran (default: the git revision its "
                                 "summaries share)")
    publishing.add_argument("--date", type=options.date, metavar="ISO",
                            help="when the night ran, ISO 8601 (default: now); without an offset "
                                 "it is read as UTC")
    publishing.add_argument("--keep", type=options.number("runs", 1, MAX_KEEP),
                            default=DEFAULT_KEEP, metavar="N",
                            help=f"keep the last N runs (default: {DEFAULT_KEEP})")
    publishing.set_defaults(handler=publish)
