"""The commands that run scenarios or read what runs wrote: `run`, `merge`, `noise`, `list`
and `show`. The runner (MLX, pandas, matplotlib) is imported once their input has been read."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from ..judge.summary import exit_status
from ..pipeline.defaults import DEFAULT_OUT, DEFAULT_RUNS, DEFAULT_TIMEOUT
from ..report import console as term
from ..scenario import packaged
from . import options


def run(args: argparse.Namespace, console: Console) -> int:
    variants = options.soaked(options.variants(args.paths, args.variant, console),
                              args.duration, args.fail_fast)
    if args.gated:
        variants = options.as_gated(variants)
    from ..pipeline.schedule import shard
    from ..pipeline.suite import Interrupted, run_variants

    if args.shard:
        variants = shard(variants, *args.shard)
        console.print(f"shard {args.shard[0]}/{args.shard[1]}: {len(variants)} variant(s)",
                      highlight=False)
    interrupted = False
    try:
        summaries = run_variants(variants, Path(args.out), console, args.timeout, args.jobs)
    except Interrupted as stopped:
        summaries, interrupted = stopped.summaries, True
    console.print(term.results(summaries))
    term.failures(console, summaries)
    term.holders(console, summaries)
    term.early_stops(console, summaries)
    console.print(f"reports written under {args.out}/")
    if interrupted:
        term.interrupted(options.errors(), summaries, len(variants))
        return 130
    return exit_status(summaries)


def merge(args: argparse.Namespace, console: Console) -> int:
    from ..pipeline.merge import merge

    summaries = merge([Path(p) for p in args.folders], Path(args.out), console)
    console.print(term.results(summaries))
    console.print(f"merged {len(summaries)} variant(s) from {len(args.folders)} folder(s) "
                  f"into {args.out}/", highlight=False)
    return exit_status(summaries)


def noise(args: argparse.Namespace, console: Console) -> int:
    """Exit 2 when a run did not complete, 1 when exact metrics differed or an expectation
    failed in some run, else 0."""
    variants = options.variants(args.paths, args.variant, console)
    if args.gated:
        variants = options.as_gated(variants)
    from ..pipeline import repeat

    summaries = repeat.run_repeated(variants, args.runs, Path(args.out), console, args.jobs)
    console.print(term.noise(summaries))
    found = repeat.warnings(summaries)
    term.warn(console, found)
    console.print(f"reports written under {args.out}/ (the median run of each variant); record "
                  f"them with `kvmem baseline update --from {args.out}`", highlight=False)
    return max(exit_status(summaries), 1 if found else 0)


def listing(args: argparse.Namespace, console: Console) -> int:
    (folder,), note = packaged.fallback([args.dir])
    if note:
        console.print(note, highlight=False, soft_wrap=True)
    console.print(term.scenarios(folder))
    console.print(term.geometry_presets())
    console.print(term.model_presets())
    return 0


def show(args: argparse.Namespace, console: Console) -> int:
    """Print summaries; a file that is not one is bad input naming the file and the field."""
    summaries = options.summaries([args.report])
    console.print(term.results(summaries))
    term.details(console, summaries)
    return exit_status(summaries)


def add(sub: argparse._SubParsersAction) -> None:
    """`run`, `merge`, `list`, `show` and `noise`."""
    running = sub.add_parser("run", help="run scenario files or folders and write reports")
    running.add_argument("paths", nargs="+", help="scenario YAML files or folders of them")
    running.add_argument("--variant", action="append", help="run only this variant (repeatable)")
    running.add_argument("--out", default="reports", help="report folder (default: reports)")
    running.add_argument("--timeout", type=options.seconds, metavar="SECONDS",
                         help="kill a variant that runs longer (default: the scenario's "
                              f"timeout, else {DEFAULT_TIMEOUT:g} s)")
    running.add_argument("--duration", type=options.duration, metavar="TIME",
                         help="a soak: each server variant's traffic starts over until TIME "
                              "has passed (90s, 30m, 2h; workload.http.duration); the timeout "
                              "grows to fit")
    running.add_argument("--fail-fast", action="store_true",
                         help="end a server variant's traffic at its first sample at rest over "
                              "its budget (detect.unbounded.budget, else the cache's own cap), "
                              "its report written")
    _gated_option(running)
    options.jobs_option(running, auto=True)
    running.add_argument("--shard", type=options.shard, metavar="I/N",
                         help="run only the I-th of N deterministic parts of the suite's "
                              "variants, balanced by planned steps (join the parts with "
                              "`kvmem merge`)")
    running.set_defaults(handler=run)
    merging = sub.add_parser("merge", help="join the report folders of sharded runs into one")
    merging.add_argument("folders", nargs="+", metavar="DIR", help="report folders to join")
    merging.add_argument("--out", required=True, help="the joined report folder")
    merging.set_defaults(handler=merge)
    listed = sub.add_parser("list", help="list bundled scenarios and model presets")
    listed.add_argument("--dir", default=str(options.DEFAULT_SCENARIOS), help="scenario folder")
    listed.set_defaults(handler=listing)
    shown = sub.add_parser("show", help="print a report's summary")
    shown.add_argument("report", help="a summary.json, a variant folder or a report folder")
    shown.set_defaults(handler=show)
    noisy = sub.add_parser(
        "noise", help="run each variant N times and report the spread of peak and spike")
    noisy.add_argument("paths", nargs="+", help="scenario YAML files or folders of them")
    noisy.add_argument("--variant", action="append", help="run only this variant (repeatable)")
    noisy.add_argument("--runs", type=options.number("runs", 2, options.MAX_RUNS),
                       default=DEFAULT_RUNS, metavar="N",
                       help=f"runs per variant (default: {DEFAULT_RUNS})")
    noisy.add_argument("--out", default=DEFAULT_OUT,
                       help=f"report folder for the median runs (default: {DEFAULT_OUT})")
    _gated_option(noisy)
    options.jobs_option(noisy)
    noisy.set_defaults(handler=noise)


def _gated_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gated", action="store_true",
                        help="run open-loop traffic as the gate measures it: replayed in order, "
                             "arrival times ignored (workload.http.gate), for reports that "
                             "`gate pr --from` and `baseline` read")
