"""`kvmem record [options] -- COMMAND...`: profile a command kvmem did not configure
(harness.record.recording), or send a scenario's traffic to it (`--traffic`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from ..common.echo import echo
from ..common.errors import BadInput
from ..common.units import parse_size
from ..judge.summary import exit_status
from ..report import console as term
from . import options

# What `--traffic` takes from the command line into the server's section where given.
_SERVER_OPTIONS = {"period": "period", "logical": "logical", "cap": "cap",
                   "ready_timeout": "ready_timeout"}
_NOT_WITH_TRAFFIC = ("name", "budget", "max_growth")


def size(text: str) -> int:
    """Bytes from `512 MiB`, as an argparse type."""
    try:
        return parse_size(text)
    except (ValueError, OverflowError) as exc:
        raise argparse.ArgumentTypeError(f"{echo(text)}: {exc}") from None


def rate(text: str) -> int:
    """Bytes per second from `5MiB/s` (the `/s` may be left out), as an argparse type."""
    return size(text.rstrip().removesuffix("/s"))


def period(text: str) -> float:
    """The agent's period: as serve mode's `server.period`, 0.01 to 60 seconds."""
    value = options.seconds(text)
    if not 0.01 <= value <= 60.0:
        raise argparse.ArgumentTypeError(f"expected 0.01 to 60 seconds, got {echo(text)}")
    return value


def record(args: argparse.Namespace, console: Console) -> int:
    if not args.words:
        raise BadInput("record: no command given: kvmem record [options] -- COMMAND...")
    if args.traffic is not None:
        return _traffic(args, console)
    if args.variant:
        raise BadInput("--variant: names a variant of --traffic's scenario; no --traffic given")
    from ..record import recording as recorder  # MLX, pandas and matplotlib: once the input is read

    settings = recorder.Settings(
        command=list(args.words), out=Path(args.out),
        name=recorder.checked_name(args.name) if args.name is not None
        else recorder.default_name(args.words),
        period=args.period or 0.1, duration=args.duration, logical=args.logical, cap=args.cap,
        budget=args.budget, rate=args.max_growth, ready_timeout=args.ready_timeout or 120.0,
        holders=not args.no_holders)
    recorder.check_agent_paths(args.logical, args.cap)
    done = recorder.record(settings, console)
    console.print(term.results([done.summary]))
    term.details(console, [done.summary])
    term.failures(console, [done.summary])
    for line in recorder.seen(done.summary):
        console.print(line, highlight=False)
    if done.trend and not any(f.kind == "drift" for f in done.summary.findings):
        console.print(done.trend, highlight=False)  # a drift finding says it already
    log = settings.folder / "command.log"
    where = log if log.is_file() else settings.log  # moved into the report once it is written
    console.print(f"{done.ending.note}; report written to {settings.folder}/ (the command's "
                  f"output: {where})", highlight=False)
    return exit_status([done.summary])


def _traffic(args: argparse.Namespace, console: Console) -> int:
    """The scenario's server variants, each serving the command under its traffic."""
    given = [f"--{name.replace('_', '-')}" for name in _NOT_WITH_TRAFFIC
             if getattr(args, name) is not None]
    if given:
        raise BadInput(f"{given[0]}: not with --traffic (the reports are the scenario's "
                       "variants', judged by its detect: and expect:)")
    if args.no_holders:
        raise BadInput("--no-holders: not with --traffic (the scenario's sampling.holders says "
                       "whether its variants walk their holders)")
    from ..record import recording as recorder

    changes: dict[str, Any] = {field: getattr(args, name) for name, field in _SERVER_OPTIONS.items()
                               if getattr(args, name) is not None}
    recorder.with_command([], list(args.words), changes)  # the command's own check, first
    # --duration is `run --duration`'s soak there: the traffic starts over until it passes.
    variants = options.soaked(options.variants([args.traffic], args.variant, console),
                              args.duration, False)
    from ..pipeline.suite import run_variants

    summaries = run_variants(recorder.with_command(variants, list(args.words), changes),
                             Path(args.out), console)
    console.print(term.results(summaries))
    term.failures(console, summaries)
    console.print(f"reports written under {args.out}/")
    return exit_status(summaries)


def add(sub: argparse._SubParsersAction) -> None:
    """`record`."""
    recording = sub.add_parser(
        "record", help="profile a command kvmem did not start: sample its MLX memory and RSS "
                       "until it exits, --duration passes or Ctrl-C, and write a report",
        description="Start COMMAND with kvmem's agent injected and sample it on the agent's "
                    "period: {port} in any word is replaced by a free port. The report goes "
                    "to OUT/record/NAME/ (samples.csv, summary.json, memory.png, and the "
                    "command's output in command.log). Exit status: 0 every expectation held, "
                    "1 a budget was breached, 2 bad input or a command that failed, 130 on "
                    "Ctrl-C (the report is written first).")
    recording.add_argument("words", nargs="*", metavar="-- COMMAND", help="the command to "
                           "record, after --")
    recording.add_argument("--out", default="reports", help="report folder (default: reports)")
    recording.add_argument("--name", help="the report's name (default: from the command: the "
                                          "module of `python -m`, the script, the program)")
    recording.add_argument("--period", type=period, metavar="S",
                           help="seconds between two samples (default: 0.1)")
    recording.add_argument("--duration", type=options.duration, metavar="D",
                           help="stop the command after D: 20, 90s, 30m, 2h (default: when it "
                                "exits, or Ctrl-C); with --traffic, a soak as `run --duration`")
    recording.add_argument("--logical", metavar="module:Class.attr",
                           help="the byte count the command holds by design, as serve mode's "
                                "server.logical (default: none)")
    recording.add_argument("--cap", metavar="PATH",
                           help="the bytes that count allows itself, as server.cap (default: "
                                "none)")
    recording.add_argument("--budget", type=size, metavar="SIZE",
                           help="the most MLX active memory, and the most RSS, above the first "
                                "sample, on the fitted trend and at the last sample, e.g. "
                                "'512 MiB'")
    recording.add_argument("--max-growth", type=rate, metavar="RATE",
                           help="the most either fitted trend (MLX's, RSS's) may climb, e.g. "
                                "5MiB/s")
    recording.add_argument("--no-holders", action="store_true",
                           help="do not walk the holders of the command's MLX arrays (by "
                                "default its first process is walked at 1, 2, 4, 8… s and at "
                                "the end, a pause of the command each time; holders.csv)")
    recording.add_argument("--ready-timeout", type=options.seconds, metavar="S",
                           help="seconds the agent has to connect (default: 120)")
    recording.add_argument("--traffic", metavar="FILE",
                           help="send this scenario's HTTP traffic to the command (its engine: "
                                "server variants, each through serve mode; the command must "
                                "hold {port})")
    recording.add_argument("--variant", action="append",
                           help="with --traffic: run only this variant (repeatable)")
    recording.set_defaults(handler=record)
