"""What every command shares: argument types that refuse a bad value in one line, the options
several commands take, and the reading and writing each does the same way.

Bounds on the numeric flags are far above any real use, and checked before anything is sized by
them (an unbounded --shard N once took gigabytes before a variant ran).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

from rich.console import Console

from ..common.echo import echo
from ..common.errors import BadInput, cannot_write, no_summaries
from ..common.files import atomic_text
from ..common.units import parse_duration
from ..gate.form import as_gated as as_gated  # the commands' own, as the gate measures
from ..gate.formats import RENDERERS
from ..gate.nightly import parse_date
from ..judge.summary import Summary
from ..pipeline.defaults import usable_cores
from ..pipeline.selection import variants as variants  # the commands' own, as the gate reads them
from ..scenario import Variant
from ..store.summaries import summaries_under

DEFAULT_SCENARIOS = Path("scenarios")
MAX_JOBS = 1024
MAX_RUNS = 1000
MAX_SHARDS = 1000
MAX_REASON = 500


def errors() -> Console:
    """Where a command writes what goes wrong: standard error, lines unbroken."""
    return Console(stderr=True, soft_wrap=True)


def soaked(variants: list[Variant], duration: float | None, fail_fast: bool) -> list[Variant]:
    """The variants with `run --duration` and `--fail-fast` set on each server variant's
    traffic (`workload.http.duration`, `fail_fast`); bad input where none serves HTTP."""
    if duration is None and not fail_fast:
        return variants
    served = [v for v in variants if v.spec.workload.http is not None]
    if not served:
        flag = "--duration" if duration is not None else "--fail-fast"
        raise BadInput(f"{flag}: applies to server variants (engine: server), and none of the "
                       f"{len(variants)} selected is one")
    changed = []
    for variant in variants:
        http = variant.spec.workload.http
        if http is not None:
            update: dict = {"fail_fast": http.fail_fast or fail_fast}
            if duration is not None:
                update["duration"] = duration
            workload = variant.spec.workload.model_copy(
                update={"http": http.model_copy(update=update)})
            variant = dataclasses.replace(
                variant, spec=variant.spec.model_copy(update={"workload": workload}))
        changed.append(variant)
    return changed


def duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {echo(text)}") from None


def summaries(paths: Sequence[str | Path]) -> list[Summary]:
    """Every summary under `paths` (files, report or baselines folders); none is bad input."""
    found = [s for path in paths for s in summaries_under(path)]
    if not found:
        raise no_summaries(paths)
    return found


def write(path: Path, text: str) -> None:
    """Write a file atomically; one that cannot be written is bad input naming it."""
    try:
        atomic_text(path, text)
    except OSError as exc:
        raise cannot_write(path, exc) from None


def tolerance_options(parser: argparse.ArgumentParser) -> None:
    """`--rel` and `--abs`: override a metric's tolerance."""
    parser.add_argument("--rel", action="append", default=[], metavar="METRIC=X",
                        help="relative threshold for a metric, e.g. peak=0.05")
    parser.add_argument("--abs", action="append", default=[], metavar="METRIC=SIZE",
                        help="absolute noise floor for a metric, e.g. 'peak=8 MiB'")


def artifact_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--artifact-url", metavar="URL",
                        help="where the run's plots are: linked from the comment (default: "
                             "$KVMEM_ARTIFACT_URL)")


def artifact_url(args: argparse.Namespace) -> str | None:
    """Where the run's plots are: --artifact-url, else $KVMEM_ARTIFACT_URL."""
    return args.artifact_url or os.environ.get("KVMEM_ARTIFACT_URL") or None


def output_options(parser: argparse.ArgumentParser) -> None:
    """A comparison's rendering and where it goes: `compare` and `baseline check`."""
    parser.add_argument("--format", choices=tuple(RENDERERS), default="text")
    parser.add_argument("--out", help="write the result to FILE instead of stdout")
    tolerance_options(parser)
    artifact_option(parser)


def jobs_option(parser: argparse.ArgumentParser, auto: bool = False) -> None:
    """`--jobs N|auto`. `auto` (one per usable core) is `run`'s default; the commands that
    record or judge figures default to 1, as variants sharing the cores move the step peak."""
    whole = number("jobs", 1, MAX_JOBS)
    default = f"auto, {usable_cores()} here" if auto else "1"
    parser.add_argument("--jobs", type=lambda text: usable_cores() if text == "auto" else whole(text),
                        default=usable_cores() if auto else 1, metavar="N|auto",
                        help="run up to N variants at once (auto: one per usable core), each "
                             "started only when its estimated footprint fits beside the running "
                             f"ones (default: {default})")


def number(what: str, least: int, most: int) -> Callable[[str], int]:
    """An argparse type: a whole number of `what` from `least` to `most`, in digits (`+2`,
    `2.0` and a 5,000-digit number are refused, not read)."""
    def parse(text: str) -> int:
        if text.isdecimal() and len(text) <= len(str(most)) and least <= int(text) <= most:
            return int(text)
        raise argparse.ArgumentTypeError(f"expected a whole number of {what} from {least} to "
                                         f"{most}, got {echo(text)}")
    return parse


def shard(text: str) -> tuple[int, int]:
    """`i/n` with whole numbers 1 <= i <= n <= MAX_SHARDS, as an argparse type."""
    index, sep, count = text.partition("/")
    digits = len(str(MAX_SHARDS))
    if (sep and all(part.isdecimal() and len(part) <= digits for part in (index, count))
            and 1 <= int(index) <= int(count) <= MAX_SHARDS):
        return int(index), int(count)
    raise argparse.ArgumentTypeError(f"expected I/N with whole numbers 1 <= I <= N <= "
                                     f"{MAX_SHARDS}, got {echo(text)}")


def reason(text: str) -> str:
    """A reason to record: some words, one line."""
    if not text.strip() or "\n" in text or len(text) > MAX_REASON:
        raise argparse.ArgumentTypeError(f"expected one line of up to {MAX_REASON} characters "
                                         f"saying why, got {echo(text)}")
    return text.strip()


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {echo(text)}")
    return value


def date(text: str) -> datetime:
    try:
        return parse_date(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an ISO 8601 date and time such as "
                                         f"2025-06-01T03:17:00Z, got {echo(text)}") from None
