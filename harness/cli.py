"""Command line: `python -m harness` and the `kvmem` script are this one parser.

Exit status: 0 every expectation held, 1 an expectation (or comparison) failed, 2 bad input or a
run that could not complete. Bad input is one line naming the file and the field, never a
traceback.

The runner (MLX, pandas, matplotlib) is imported by the commands that run or merge, after their
input has been read: `kvmem --help` and the refusal of a bad file load neither.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

from . import adopt
from .common.echo import MAX_ECHO, clip, echo
from .common.files import atomic_text
from .components.registry import import_paths
from .gate import baseline
from .gate.compare import Comparison, compare, head_failed
from .gate.history import DEFAULT_METRICS, EXPORTERS, load_runs, write_history
from .gate.policy import ACCEPT_LABEL
from .gate.record import DEFAULT_KEEP, MAX_KEEP, Record, appended, parse_date, read_record, tonight
from .gate.render import RENDERERS, render_text
from .gate.site import write_site
from .gate.tolerance import CompareError, fraction, size
from .judge.metrics import gated
from .judge.summary import Summary, SummaryError, checked, exit_status, load_summaries
from .report import console as term
from .report.folder import ReportError
from .run.defaults import DEFAULT_OUT, DEFAULT_RUNS, DEFAULT_TIMEOUT, usable_cores
from .scenario import ScenarioError, Variant, check_unique, discover, load_variants, packaged

BAD_INPUT = (ScenarioError, ReportError, SummaryError, CompareError, adopt.AdoptError)
DEFAULT_SCENARIOS = Path("scenarios")
# Bounds on the numeric flags: far above any real use, and checked before anything is sized by
# them (an unbounded --shard N once took gigabytes before a variant ran).
MAX_JOBS = 1024
MAX_RUNS = 1000
MAX_SHARDS = 1000
MAX_REASON = 500


def _variants(paths: Sequence[str | Path], only: list[str] | None = None,
              console: Console | None = None) -> list[Variant]:
    """Every variant of the scenario files under `paths` (or those named), validated first;
    two that would write one report folder are bad input.

    With a console (the commands that run them), warns once about each version bound on mlx
    or mlx-lm that a component's package declares and the installed version violates.
    """
    paths, note = packaged.fallback(paths)
    if note and console is not None:
        console.print(note, highlight=False, soft_wrap=True)
    variants = [v for path in discover(paths) for v in load_variants(path, only)]
    if not variants:
        raise ScenarioError(f"{', '.join(map(str, paths))}: no scenario files (*.yaml) found")
    check_unique(variants)
    if console is not None:
        from .components.requirements import bound_warnings

        term.warn(console, bound_warnings((", ".join(_user_components(v)), v.packages)
                                          for v in variants if v.packages))
    return variants


def _user_components(variant: Variant) -> list[str]:
    cache = variant.spec.cache
    return import_paths(c for c in (cache.layer, cache.sliding, cache.store, cache.session)
                        if c is not None)


def _run(args: argparse.Namespace, console: Console) -> int:
    variants = _variants(args.paths, args.variant, console)
    from .run.schedule import shard
    from .run.suite import run_variants

    if args.shard:
        variants = shard(variants, *args.shard)
        console.print(f"shard {args.shard[0]}/{args.shard[1]}: {len(variants)} variant(s)",
                      highlight=False)
    summaries = run_variants(variants, Path(args.out), console, args.timeout, args.jobs)
    console.print(term.results(summaries))
    term.failures(console, summaries)
    console.print(f"reports written under {args.out}/")
    return exit_status(summaries)


def _merge(args: argparse.Namespace, console: Console) -> int:
    from .run.merge import merge

    summaries = merge([Path(p) for p in args.folders], Path(args.out), console)
    console.print(term.results(summaries))
    console.print(f"merged {len(summaries)} variant(s) from {len(args.folders)} folder(s) "
                  f"into {args.out}/", highlight=False)
    return exit_status(summaries)


def _list(args: argparse.Namespace, console: Console) -> int:
    (folder,), note = packaged.fallback([args.dir])
    if note:
        console.print(note, highlight=False, soft_wrap=True)
    console.print(term.scenarios(folder))
    console.print(term.geometry_presets())
    console.print(term.model_presets())
    return 0


def _show(args: argparse.Namespace, console: Console) -> int:
    """Print summaries; a file that is not one is bad input naming the file and the field."""
    summaries = load_summaries(args.report)
    if not summaries:
        raise SummaryError(f"{args.report}: no summary.json found")
    console.print(term.results(summaries))
    term.details(console, summaries)
    return exit_status(summaries)


def _tolerance_flags(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, float]]:
    """`--rel METRIC=X` and `--abs METRIC=SIZE`, each checked as the scenario's would be."""
    def values(pairs: list[str], flag: str, convert) -> dict[str, float]:
        parsed = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep or name not in gated():
                raise CompareError(f"{flag} {clip(pair, MAX_ECHO)}: expected METRIC=VALUE with "
                                   f"METRIC among {', '.join(gated())}")
            parsed[name] = convert(value)
        return parsed

    return values(args.rel, "--rel", fraction), values(args.abs, "--abs", size)


def _emit(comparison: Comparison, args: argparse.Namespace, console: Console) -> int:
    """Render in the requested format to --out (the text rendering still goes to stdout), with
    the link to the run's plots from --artifact-url or KVMEM_ARTIFACT_URL."""
    comparison.artifact_url = args.artifact_url or os.environ.get("KVMEM_ARTIFACT_URL") or None
    if args.out:
        try:
            atomic_text(Path(args.out), RENDERERS[args.format](comparison))
        except OSError as exc:
            raise ReportError(f"{args.out}: cannot write: {exc.strerror or exc}") from None
        sys.stdout.write(render_text(comparison))
    else:
        sys.stdout.write(RENDERERS[args.format](comparison))
    return comparison.exit_code


def _compare(args: argparse.Namespace, console: Console) -> int:
    """Compare; a head that produced no summaries (it crashed, or its input was refused) is a
    regression whose comment says so, with the first error line known: --head-error, else the
    last line of --head-log that mentions an error."""
    def head_error() -> str | None:
        if args.head_error or not args.head_log:
            return args.head_error
        try:
            text = Path(args.head_log).read_text(errors="replace")
        except OSError as exc:
            return f"(cannot read {args.head_log}: {exc.strerror or exc})"
        found = [line.strip() for line in text.splitlines() if "error" in line.lower()]
        return next((line for line in reversed(found) if line), None)

    rel, abs_ = _tolerance_flags(args)
    base, head = load_summaries(args.base), load_summaries(args.head)
    if not head:
        return _emit(head_failed(base, head_error()), args, console)
    return _emit(compare(base, head, rel, abs_), args, console)


def _suite_summaries(args: argparse.Namespace, console: Console) -> list[Summary]:
    """The summaries `baseline` works on: read `--from` a folder, or from running the suite
    (`--runs N` times each, recording the median run and the spread)."""
    runs = getattr(args, "runs", 1)
    if args.source:
        if runs > 1:
            raise CompareError(f"--runs {runs} measures by running the suite; it cannot be "
                               "combined with --from (record `kvmem noise` reports instead)")
        summaries = load_summaries(args.source)
        if not summaries:
            raise CompareError(f"{args.source}: no summaries found")
        return summaries
    variants, reports = _variants(args.paths or ["scenarios"], console=console), Path(args.reports)
    from .run import repeat
    from .run.suite import run_variants

    if runs > 1:
        results = repeat.run_repeated(variants, runs, reports, console, args.jobs)
        term.warn(console, repeat.warnings(results))
    else:
        results = run_variants(variants, reports, console, jobs=args.jobs)
    return [checked(r) for r in results]


def _show_update(console: Console, errors: Console, result: baseline.Update, several: bool) -> None:
    """What `baseline update` did: `added s/v`, `updated s/v (peak +12 MiB, ...)`, `kept N
    unchanged`, and on `errors` each run refused (with `several` backends, each label says
    which)."""
    def label(summary: Summary) -> str:
        return escape(summary.label + (f" on {summary.backend}" if several else ""))

    for change in result.written:
        reasons = f" ({escape(', '.join(change.reasons))})" if change.reasons else ""
        console.print(f"{change.action} {label(change.summary)}{reasons}", highlight=False)
    if result.kept:
        console.print(f"kept {len(result.kept)} unchanged", highlight=False)
    for summary, why in result.refused:
        errors.print(f"error: {label(summary)}: {escape(why)}: no baseline written",
                     highlight=False)


def _baseline_update(args: argparse.Namespace, console: Console) -> int:
    """Record what changed: `added s/v`, `updated s/v (peak +12 MiB, ...)`, `kept N
    unchanged`; a failed run is listed and not recorded (exit 2)."""
    errors = Console(stderr=True, soft_wrap=True)
    summaries = _suite_summaries(args, errors)
    result = baseline.store(summaries, Path(args.dir), args.reason, baseline.recorder())
    _show_update(console, errors, result, several=len({s.backend for s in summaries}) > 1)
    return 2 if result.refused else 0


def _baseline_check(args: argparse.Namespace, console: Console) -> int:
    rel, abs_ = _tolerance_flags(args)
    head = _suite_summaries(args, Console(stderr=True, soft_wrap=True))
    # Explicit paths run part of the suite: baselines of the other scenarios are not "removed".
    # Reports given with --from (the nightly's merged shards) stand for the whole suite.
    base = baseline.load_baselines(Path(args.dir), head, partial=bool(args.paths))
    return _emit(compare(base, head, rel, abs_), args, console)


def _gate_pr(args: argparse.Namespace, console: Console) -> int:
    """The pull-request check: the head's runs (or `--from` reports) against the baselines
    committed at --base, with the changes the head makes to them. Exit 0 pass, 1 a regression
    or a rejected change, 2 bad input or a run that did not complete (after writing the
    comment, which says which)."""
    from .gate import git, pr

    errors = Console(stderr=True, soft_wrap=True)
    top = git.toplevel(Path.cwd())
    sha = git.commit(args.base, top)
    root = Path(args.dir).resolve()
    if top not in (root, *root.parents):
        raise CompareError(f"--dir {args.dir}: not inside the repository at {top}")
    folder = PurePosixPath(root.relative_to(top).as_posix())
    paths = args.paths or [str(DEFAULT_SCENARIOS)]
    if args.source:
        head = load_summaries(args.source)
        if not head:
            raise CompareError(f"{args.source}: no summaries found")
    else:
        variants = _variants(paths, console=errors)
        from .run.suite import run_variants

        head = run_variants(variants, Path(args.reports), errors, jobs=args.jobs)
        errors.print(term.results(head))
        term.failures(errors, head)
    covered = [PurePosixPath(os.path.normpath(os.path.relpath(p))) for p in paths]
    backends = {s.backend for s in head}
    keep = lambda found: {path: s for path, s in found.items()
                          if pr.selected([s], covered, backends)}
    old = keep(pr.parse_baselines(git.read_folder(sha, top, folder), f"{args.base}:{folder}"))
    new = keep(pr.parse_baselines(pr.read_tree(root), args.dir))
    rel, abs_ = _tolerance_flags(args)
    comparison = pr.judge(compare(list(old.values()), head, rel, abs_), old, new, args.accept)
    comparison.artifact_url = args.artifact_url or os.environ.get("KVMEM_ARTIFACT_URL") or None
    out = Path(args.out)
    for name, fmt in (("memory-delta.md", "markdown"), ("memory-delta.json", "json"),
                      ("memory-delta.xml", "junit")):
        try:
            atomic_text(out / name, RENDERERS[fmt](comparison))
        except OSError as exc:
            raise ReportError(f"{out / name}: cannot write: {exc.strerror or exc}") from None
    sys.stdout.write(render_text(comparison))
    console.print(f"comment, JSON and JUnit written under {out}/", highlight=False)
    return 2 if any(not s.ok for s in head) else comparison.exit_code


def _noise(args: argparse.Namespace, console: Console) -> int:
    """Exit 2 when a run did not complete, 1 when exact metrics differed or an expectation
    failed in some run, else 0."""
    variants = _variants(args.paths, args.variant, console)
    from .run import repeat

    summaries = repeat.run_repeated(variants, args.runs, Path(args.out), console, args.jobs)
    console.print(term.noise(summaries))
    found = repeat.warnings(summaries)
    term.warn(console, found)
    console.print(f"reports written under {args.out}/ (the median run of each variant); record "
                  f"them with `kvmem baseline update --from {args.out}`", highlight=False)
    return max(exit_status(summaries), 1 if found else 0)


def _export(args: argparse.Namespace, console: Console) -> int:
    """The summaries' gated metrics as a benchmark feed (github-action-benchmark, Bencher)."""
    summaries = [s for report in args.reports for s in load_summaries(report)]
    if not summaries:
        raise SummaryError(f"{', '.join(args.reports)}: no summaries found")
    text = EXPORTERS[args.format](summaries)
    left_out = [s.label for s in summaries if not s.ok]
    if left_out:
        term.warn(Console(stderr=True, soft_wrap=True),
              [f"left out {len(left_out)} runs that did not complete: {', '.join(left_out)}"])
    if not args.out:
        sys.stdout.write(text)
        return 0
    try:
        atomic_text(Path(args.out), text)
    except OSError as exc:
        raise ReportError(f"{args.out}: cannot write: {exc.strerror or exc}") from None
    console.print(f"wrote {args.out}", highlight=False)
    return 0


def _history(args: argparse.Namespace, console: Console) -> int:
    """One PNG per scenario: the metrics across the runs, in the order given."""
    runs = load_runs(args.dirs)
    if not any(run.summaries for run in runs):
        raise SummaryError(f"{', '.join(args.dirs)}: no summaries found")
    try:
        written = write_history(runs, Path(args.out), args.metric or DEFAULT_METRICS)
    except OSError as exc:
        raise ReportError(f"{args.out}: cannot write: {exc.strerror or exc}") from None
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    return 0


def _publish(args: argparse.Namespace, console: Console) -> int:
    """Append the night's summaries to the history record and write the site from it."""
    summaries = [s for report in args.reports for s in load_summaries(report)]
    if not summaries:
        raise SummaryError(f"{', '.join(args.reports)}: no summaries found")
    site = Path(args.site)
    previous = Path(args.previous) if args.previous else site / "history.json"
    before = read_record(previous)
    run = tonight(summaries, args.date or datetime.now(timezone.utc), args.commit)
    record = appended(before or Record(), run, args.keep)
    try:
        written = write_site(record, summaries, site)
    except OSError as exc:
        raise ReportError(f"{site}: cannot write: {exc.strerror or exc}") from None
    if before is None:
        console.print(f"no history at {previous}: started a new one", highlight=False)
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    failed = [s.label for s in summaries if not s.ok]
    if failed:
        term.warn(Console(stderr=True, soft_wrap=True),
                  [f"{len(failed)} runs did not complete: recorded as such, left out of "
                   f"benchmark.json: {', '.join(failed)}"])
    console.print(f"history: {len(record.runs)} runs, from {record.runs[0].date:%Y-%m-%d} to "
                  f"{record.runs[-1].date:%Y-%m-%d}; this one {run.date:%Y-%m-%d %H:%M} UTC, "
                  f"commit {run.commit}", highlight=False)
    return 0


def _date(text: str) -> datetime:
    try:
        return parse_date(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an ISO 8601 date and time such as "
                                         f"2025-06-01T03:17:00Z, got {echo(text)}") from None


def _history_parsers(sub: argparse._SubParsersAction) -> None:
    """`export`, `history` and `publish`: the gate's figures for charts kept across runs."""
    export = sub.add_parser(
        "export", help="write the summaries' gated metrics as a benchmark feed (JSON)")
    export.add_argument("reports", nargs="+", metavar="REPORTS",
                        help="report folders, summary files or baselines folders")
    export.add_argument("--format", choices=tuple(EXPORTERS), default=next(iter(EXPORTERS)),
                        help="the feed's format (default: github-action-benchmark's "
                             "customSmallerIsBetter list)")
    export.add_argument("--out", help="write the JSON to FILE instead of stdout")
    export.set_defaults(handler=_export)
    history = sub.add_parser(
        "history", help="plot metrics across a sequence of runs: one PNG per scenario")
    history.add_argument("dirs", nargs="+", metavar="DIR",
                         help="report or baselines folders, oldest first")
    history.add_argument("--out", required=True, help="folder for the PNGs")
    history.add_argument("--metric", action="append", choices=gated(),
                         help=f"a metric to plot (repeatable; default: {', '.join(DEFAULT_METRICS)})")
    history.set_defaults(handler=_history)
    publish = sub.add_parser(
        "publish", help="append a night's summaries to the history record and write a static "
                        "site: index.html, history.json, benchmark.json",
        description="Read the summaries under REPORTS as one run (one backend, one summary per "
                    "variant), append it to the history record (--previous), keep the last "
                    "--keep runs, and write the site into --site: index.html (charts of every "
                    "metric over the runs' dates, from zero), history.json (the record, for the "
                    "next night) and benchmark.json (this run as github-action-benchmark's "
                    "feed). A missing previous record starts a new history; one that cannot be "
                    "read is bad input (exit 2).")
    publish.add_argument("reports", nargs="+", metavar="REPORTS",
                         help="the night's report folders or summary files")
    publish.add_argument("--site", required=True, metavar="DIR", help="folder for the site")
    publish.add_argument("--previous", metavar="FILE",
                         help="the history record to append to, as the last published site holds "
                              "it (default: DIR/history.json)")
    publish.add_argument("--commit", metavar="SHA",
                         help="the commit the night ran (default: the git revision its summaries "
                              "share)")
    publish.add_argument("--date", type=_date, metavar="ISO",
                         help="when the night ran, ISO 8601 (default: now); without an offset "
                              "it is read as UTC")
    publish.add_argument("--keep", type=_whole("runs", 1, MAX_KEEP), default=DEFAULT_KEEP,
                         metavar="N", help=f"keep the last N runs (default: {DEFAULT_KEEP})")
    publish.set_defaults(handler=_publish)


class _Parser(argparse.ArgumentParser):
    """argparse, reporting a mistake in the arguments as all bad input is reported: one line,
    the values it echoes cut to fit, exit 2 (`--help` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {clip(message, 300)}\n")


def parser() -> argparse.ArgumentParser:
    top = _Parser(
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
    _jobs_option(run, auto=True)
    run.add_argument("--shard", type=_shard, metavar="I/N",
                     help="run only the I-th of N deterministic parts of the suite's variants, "
                          "balanced by planned steps (join the parts with `kvmem merge`)")
    run.set_defaults(handler=_run)
    merging = sub.add_parser("merge", help="join the report folders of sharded runs into one")
    merging.add_argument("folders", nargs="+", metavar="DIR", help="report folders to join")
    merging.add_argument("--out", required=True, help="the joined report folder")
    merging.set_defaults(handler=_merge)
    listing = sub.add_parser("list", help="list bundled scenarios and model presets")
    listing.add_argument("--dir", default=str(DEFAULT_SCENARIOS), help="scenario folder")
    listing.set_defaults(handler=_list)
    show = sub.add_parser("show", help="print a report's summary")
    show.add_argument("report", help="a summary.json, a variant folder or a report folder")
    show.set_defaults(handler=_show)
    comparing = sub.add_parser(
        "compare", help="compare run summaries of a base and a head; exit 1 on regression")
    comparing.add_argument("base", help="report folder, summary.json or baselines folder")
    comparing.add_argument("head", help="report folder, summary.json or baselines folder")
    _gate_options(comparing)
    comparing.add_argument("--head-error", metavar="TEXT",
                           help="when the head produced no summaries: its error, for the comment")
    comparing.add_argument("--head-log", metavar="FILE",
                           help="when the head produced no summaries: its log; the last line "
                                "mentioning an error goes in the comment")
    comparing.set_defaults(handler=_compare)

    baselines = sub.add_parser("baseline", help="record or check committed baselines")
    actions = baselines.add_subparsers(dest="action", required=True)
    update = actions.add_parser("update", help="run the suite and record its summaries")
    check = actions.add_parser("check", help="run the suite and compare with the baselines; "
                                             "exit 1 on regression")
    for action, handler in ((update, _baseline_update), (check, _baseline_check)):
        action.add_argument("paths", nargs="*",
                            help="scenario files or folders (default: scenarios)")
        action.add_argument("--dir", default="baselines", help="baselines folder")
        action.add_argument("--reports", default="reports",
                            help="where the suite's reports go (default: reports)")
        action.add_argument("--from", dest="source", metavar="REPORTS",
                            help="use the summaries under REPORTS instead of running the suite")
        _jobs_option(action)
        action.set_defaults(handler=handler)
    update.add_argument("--runs", type=_whole("runs", 1, MAX_RUNS), default=1, metavar="N",
                        help="run each variant N times and record the median run with the "
                             "measured spread of peak and spike (default: 1)")
    update.add_argument("--reason", required=True, type=_reason, metavar="TEXT",
                        help="why the baselines change: recorded in each file written and "
                             "shown beside the change by `gate pr`")
    _gate_options(check)

    gate = sub.add_parser("gate", help="the pull-request check")
    checks = gate.add_subparsers(dest="check", required=True)
    pull = checks.add_parser(
        "pr", help="run the head's scenarios and judge them against the baselines committed "
                   "at --base; exit 1 on a regression or an unaccepted change",
        description="What CI says of a pull request, run in a checkout of its branch. The "
                    "baselines are read from git at --base, never from the working tree; every "
                    "change the branch makes to baselines, tolerances, expectations, detector "
                    "thresholds or the set of variants is listed, and one that loosens them "
                    f"fails unless --accept (the pull request's `{ACCEPT_LABEL}` label) is given.")
    pull.add_argument("paths", nargs="*", metavar="PATH",
                      help="scenario files or folders (default: scenarios)")
    pull.add_argument("--base", required=True, metavar="REF",
                      help="the target branch's revision, e.g. origin/main")
    pull.add_argument("--accept", action="store_true",
                      help=f"the maintainers accept the changes (the `{ACCEPT_LABEL}` label)")
    pull.add_argument("--from", dest="source", metavar="REPORTS",
                      help="judge the summaries under REPORTS instead of running the scenarios")
    pull.add_argument("--dir", default="baselines", help="baselines folder (default: baselines)")
    pull.add_argument("--reports", default="reports",
                      help="where the runs' reports go (default: reports)")
    pull.add_argument("--out", default="kvmem-gate",
                      help="folder for memory-delta.md, .json and .xml (default: kvmem-gate)")
    for flag, example in (("--rel", "METRIC=X"), ("--abs", "METRIC=SIZE")):
        pull.add_argument(flag, action="append", default=[], metavar=example,
                          help=f"override a tolerance, as in `compare` ({flag} peak=...)")
    pull.add_argument("--artifact-url", metavar="URL",
                      help="where the run's plots are: linked from the comment (default: "
                           "$KVMEM_ARTIFACT_URL)")
    _jobs_option(pull)
    pull.set_defaults(handler=_gate_pr)

    noisy = sub.add_parser(
        "noise", help="run each variant N times and report the spread of peak and spike")
    noisy.add_argument("paths", nargs="+", help="scenario YAML files or folders of them")
    noisy.add_argument("--variant", action="append", help="run only this variant (repeatable)")
    noisy.add_argument("--runs", type=_whole("runs", 2, MAX_RUNS), default=DEFAULT_RUNS,
                       metavar="N",
                       help=f"runs per variant (default: {DEFAULT_RUNS})")
    noisy.add_argument("--out", default=DEFAULT_OUT,
                       help=f"report folder for the median runs (default: {DEFAULT_OUT})")
    _jobs_option(noisy)
    noisy.set_defaults(handler=_noise)
    _history_parsers(sub)
    adopt.add_parser(sub)
    return top


def _gate_options(parser: argparse.ArgumentParser) -> None:
    """Output and tolerance options shared by `compare` and `baseline check`."""
    parser.add_argument("--format", choices=tuple(RENDERERS), default="text")
    parser.add_argument("--out", help="write the result to FILE instead of stdout")
    parser.add_argument("--rel", action="append", default=[], metavar="METRIC=X",
                        help="relative threshold for a metric, e.g. peak=0.05")
    parser.add_argument("--abs", action="append", default=[], metavar="METRIC=SIZE",
                        help="absolute noise floor for a metric, e.g. 'peak=8 MiB'")
    parser.add_argument("--artifact-url", metavar="URL",
                        help="where the run's plots are: linked from the comment (default: "
                             "$KVMEM_ARTIFACT_URL)")


def _jobs_option(parser: argparse.ArgumentParser, auto: bool = False) -> None:
    """`--jobs N|auto`. `auto` (one per usable core) is `run`'s default; the commands that
    record or judge figures default to 1, as variants sharing the cores move the step peak."""
    whole = _whole("jobs", 1, MAX_JOBS)
    default = f"auto, {usable_cores()} here" if auto else "1"
    parser.add_argument("--jobs", type=lambda text: usable_cores() if text == "auto" else whole(text),
                        default=usable_cores() if auto else 1, metavar="N|auto",
                        help="run up to N variants at once (auto: one per usable core), each "
                             "started only when its estimated footprint fits beside the running "
                             f"ones (default: {default})")


def _whole(what: str, least: int, most: int):
    """An argparse type: a whole number of `what` from `least` to `most`, in digits (`+2`,
    `2.0` and a 5,000-digit number are refused, not read)."""
    def parse(text: str) -> int:
        if text.isdecimal() and len(text) <= len(str(most)) and least <= int(text) <= most:
            return int(text)
        raise argparse.ArgumentTypeError(f"expected a whole number of {what} from {least} to "
                                         f"{most}, got {echo(text)}")
    return parse


def _shard(text: str) -> tuple[int, int]:
    """`i/n` with whole numbers 1 <= i <= n <= MAX_SHARDS, as an argparse type."""
    index, sep, count = text.partition("/")
    digits = len(str(MAX_SHARDS))
    if (sep and all(part.isdecimal() and len(part) <= digits for part in (index, count))
            and 1 <= int(index) <= int(count) <= MAX_SHARDS):
        return int(index), int(count)
    raise argparse.ArgumentTypeError(f"expected I/N with whole numbers 1 <= I <= N <= "
                                     f"{MAX_SHARDS}, got {echo(text)}")


def _reason(text: str) -> str:
    """A reason to record: some words, one line."""
    if not text.strip() or "\n" in text or len(text) > MAX_REASON:
        raise argparse.ArgumentTypeError(f"expected one line of up to {MAX_REASON} characters "
                                         f"saying why, got {echo(text)}")
    return text.strip()


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {echo(text)}")
    return value


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM ends a run as Ctrl-C does: the running child is killed, written reports stay."""
    raise KeyboardInterrupt


def _import_from_cwd() -> None:
    """Resolve import-path components from the current folder, as `python -m harness` does.

    `python -m` puts the current folder first on sys.path and a console script does not, so
    without this `kvmem run scenarios` could not find `examples.leaky_store` where
    `python -m harness run scenarios` does. Spawned children inherit the path.
    """
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _import_from_cwd()
    # Logs in CI are wide; a terminal keeps its own width.
    console = Console(width=None if sys.stdout.isatty() else 160)
    errors = Console(stderr=True, soft_wrap=True)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main else None
    try:
        return args.handler(args, console)
    except BAD_INPUT as exc:
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
