"""The gate's commands: `compare` two sets of summaries, `baseline update` and `baseline check`
against the committed baselines, and `gate pr`, the pull-request check. They read summaries
(or run the suite first) and write a comparison; exit 1 on a regression."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ..common.errors import BadInput
from ..gate import baseline
from ..gate.check import PullRequest, check
from ..gate.compare import Comparison, compare, head_failed
from ..gate.formats import RENDERERS
from ..gate.policy import ACCEPT_LABEL
from ..gate.render import render_text
from ..gate.tolerance import flags
from ..judge.summary import Summary, checked
from ..report import console as term
from ..run.environment import BACKENDS
from ..store.summaries import baselines_of, summaries_under
from . import options


def emit(comparison: Comparison, args: argparse.Namespace) -> int:
    """Render in the requested format to --out (the text rendering still goes to stdout), with
    the link to the run's plots from --artifact-url or KVMEM_ARTIFACT_URL."""
    comparison = replace(comparison, artifact_url=options.artifact_url(args))
    if args.out:
        options.write(Path(args.out), RENDERERS[args.format](comparison))
        sys.stdout.write(render_text(comparison))
    else:
        sys.stdout.write(RENDERERS[args.format](comparison))
    return comparison.exit_code


def _head_error(args: argparse.Namespace) -> str | None:
    """The head's first error known: --head-error, else the last line of --head-log that
    mentions an error."""
    if args.head_error or not args.head_log:
        return args.head_error
    try:
        text = Path(args.head_log).read_text(errors="replace")
    except OSError as exc:
        return f"(cannot read {args.head_log}: {exc.strerror or exc})"
    found = [line.strip() for line in text.splitlines() if "error" in line.lower()]
    return next((line for line in reversed(found) if line), None)


def compare_reports(args: argparse.Namespace, console: Console) -> int:
    """Compare; a head that produced no summaries (it crashed, or its input was refused) is a
    regression whose comment says so, with its first error line."""
    rel, abs_ = flags(args.rel, args.abs)
    base, head = summaries_under(args.base), summaries_under(args.head)
    if not head:
        return emit(head_failed(base, _head_error(args)), args)
    return emit(compare(base, head, rel, abs_), args)


def _suite(args: argparse.Namespace, console: Console) -> list[Summary]:
    """The summaries `baseline` works on: read `--from` a folder, or from running the suite
    (`--runs N` times each, recording the median run and the spread)."""
    runs = getattr(args, "runs", 1)
    if args.source:
        if runs > 1:
            raise BadInput(f"--runs {runs} measures by running the suite; it cannot be "
                           "combined with --from (record `kvmem noise` reports instead)")
        return options.summaries([args.source])
    variants = options.as_gated(options.variants(args.paths or [str(options.DEFAULT_SCENARIOS)],
                                              console=console))
    from ..pipeline import repeat
    from ..pipeline.suite import run_variants

    if runs > 1:
        results = repeat.run_repeated(variants, runs, Path(args.reports), console, args.jobs)
        term.warn(console, repeat.warnings(results))
    else:
        results = run_variants(variants, Path(args.reports), console, jobs=args.jobs)
    return [checked(r) for r in results]


def _show_update(console: Console, errors: Console, result: baseline.Update,
                 several: bool) -> None:
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


def update(args: argparse.Namespace, console: Console) -> int:
    """Record what changed; a failed run is listed and not recorded (exit 2)."""
    errors = options.errors()
    summaries = _suite(args, errors)
    result = baseline.store(summaries, Path(args.dir), args.reason, baseline.recorder())
    _show_update(console, errors, result, several=len({s.backend for s in summaries}) > 1)
    return 2 if result.refused else 0


def check_baselines(args: argparse.Namespace, console: Console) -> int:
    rel, abs_ = flags(args.rel, args.abs)
    head = _suite(args, options.errors())
    # Explicit paths run part of the suite: baselines of the other scenarios are not "removed".
    # Reports given with --from (the nightly's merged shards) stand for the whole suite.
    base = baselines_of(Path(args.dir), {s.backend for s in head},
                        {s.scenario for s in head} if args.paths else None)
    return emit(compare(base, head, rel, abs_), args)


def pull_request(args: argparse.Namespace, console: Console) -> int:
    """`gate pr` (harness.gate.check): the comment, the JSON and the JUnit under --out, the
    text on stdout. Exit 0 pass, 1 a regression or a rejected change, 2 bad input or a run
    that did not complete (after writing the comment, which says which)."""
    request = PullRequest(args.base, tuple(args.paths or [str(options.DEFAULT_SCENARIOS)]),
                          args.dir, args.source, args.reports, args.jobs, args.backend,
                          args.event, args.accept, tuple(args.rel), tuple(args.abs),
                          options.artifact_url(args))
    comparison = check(request, options.errors())
    out = Path(args.out)
    for name, fmt in (("memory-delta.md", "markdown"), ("memory-delta.json", "json"),
                      ("memory-delta.xml", "junit")):
        options.write(out / name, RENDERERS[fmt](comparison))
    sys.stdout.write(render_text(comparison))
    console.print(f"comment, JSON and JUnit written under {out}/", highlight=False)
    return comparison.pr_status


def add(sub: argparse._SubParsersAction) -> None:
    """`compare`, `baseline update|check` and `gate pr`."""
    comparing = sub.add_parser(
        "compare", help="compare run summaries of a base and a head; exit 1 on regression")
    comparing.add_argument("base", help="report folder, summary.json or baselines folder")
    comparing.add_argument("head", help="report folder, summary.json or baselines folder")
    options.output_options(comparing)
    comparing.add_argument("--head-error", metavar="TEXT",
                           help="when the head produced no summaries: its error, for the comment")
    comparing.add_argument("--head-log", metavar="FILE",
                           help="when the head produced no summaries: its log; the last line "
                                "mentioning an error goes in the comment")
    comparing.set_defaults(handler=compare_reports)
    _add_baseline(sub)
    _add_gate(sub)


def _add_baseline(sub: argparse._SubParsersAction) -> None:
    baselines = sub.add_parser("baseline", help="record or check committed baselines")
    actions = baselines.add_subparsers(dest="action", required=True)
    updating = actions.add_parser("update", help="run the suite and record its summaries")
    checking = actions.add_parser("check", help="run the suite and compare with the baselines; "
                                                "exit 1 on regression")
    for action, handler in ((updating, update), (checking, check_baselines)):
        action.add_argument("paths", nargs="*",
                            help="scenario files or folders (default: scenarios)")
        action.add_argument("--dir", default="baselines", help="baselines folder")
        action.add_argument("--reports", default="reports",
                            help="where the suite's reports go (default: reports)")
        action.add_argument("--from", dest="source", metavar="REPORTS",
                            help="use the summaries under REPORTS instead of running the suite")
        options.jobs_option(action)
        action.set_defaults(handler=handler)
    updating.add_argument("--runs", type=options.number("runs", 1, options.MAX_RUNS), default=1,
                          metavar="N", help="run each variant N times and record the median "
                          "run with the measured spread of peak and spike (default: 1)")
    updating.add_argument("--reason", required=True, type=options.reason, metavar="TEXT",
                          help="why the baselines change: recorded in each file written and "
                               "shown beside the change by `gate pr`")
    options.output_options(checking)


def _add_gate(sub: argparse._SubParsersAction) -> None:
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
                      help="a local run: the maintainers accept the changes (CI gives --event)")
    pull.add_argument("--event", metavar="FILE",
                      help="the pull request as GitHub's API gives it (JSON, harness.gate.event): "
                           "who changed the baselines, who applied the "
                           f"`{ACCEPT_LABEL}` label and for which commit; decides the acceptance")
    pull.add_argument("--from", dest="source", metavar="REPORTS",
                      help="judge the summaries under REPORTS instead of running the scenarios")
    pull.add_argument("--dir", default="baselines", help="baselines folder (default: baselines)")
    pull.add_argument("--backend", choices=BACKENDS,
                      help="the backend whose baselines judge the head (default: the one this "
                           "machine runs MLX on); a head summary from another backend fails "
                           "the check")
    pull.add_argument("--reports", default="reports",
                      help="where the runs' reports go (default: reports)")
    pull.add_argument("--out", default="kvmem-gate",
                      help="folder for memory-delta.md, .json and .xml (default: kvmem-gate)")
    options.tolerance_options(pull)
    options.artifact_option(pull)
    options.jobs_option(pull)
    pull.set_defaults(handler=pull_request)
