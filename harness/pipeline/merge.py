"""`kvmem merge`: join the report folders of sharded runs (`kvmem run --shard i/n`) into one.

Each variant folder (scenario/variant/ with samples.csv, summary.json, memory.png, holders.csv)
is copied as it is, so the merged reports are the shards' own bytes; only each scenario's overlay plot is
drawn again, from the merged samples, since each shard drew it from its own variants alone.
A variant found in two inputs is bad input: which copy is right cannot be guessed.

Every input is read and checked (each summary, each samples.csv as UTF-8 with the columns the
overlay draws) before anything is written, so bad input leaves `--out` as it was.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml
from rich.console import Console

from ..common.errors import cannot_write, no_summaries
from ..judge.summary import Summary, SummaryError
from ..report import writing as report
from ..store.rows import plotted_samples
from ..store.summaries import summaries_under
from .suite import overlays


def collect(inputs: Sequence[Path], out: Path) -> list[Summary]:
    """Every variant of the input report folders; a variant in two of them is bad input."""
    found: dict[tuple[str, str], Summary] = {}
    for folder in inputs:
        if not folder.is_dir():
            raise SummaryError(f"{folder}: not a report folder")
        if folder.resolve() == out.resolve():
            raise SummaryError(f"{folder}: is also --out; merge into a new folder")
        for summary in summaries_under(folder):  # an empty shard's folder holds none
            _check_layout(folder, summary)
            if summary.key in found:
                raise SummaryError(f"{summary.label} is in both {found[summary.key].path.parent} "
                                   f"and {summary.path.parent}: each variant must come from "
                                   "one shard")
            found[summary.key] = summary
    if not found:
        raise no_summaries(inputs)
    return _ordered(list(found.values()))


def _check_layout(folder: Path, summary: Summary) -> None:
    """A summary must sit at folder/scenario/variant/, named as it says (so never elsewhere)."""
    if summary.path.parent.relative_to(folder).parts != summary.key:
        raise SummaryError(f"{summary.path}: expected at {folder}/{summary.label}/summary.json "
                           "(a report folder written by `kvmem run`)")


def _ordered(summaries: list[Summary]) -> list[Summary]:
    """Scenarios as first found; within one, its file's variant order where the file can be
    read (the order an unsharded run gives), else as found."""
    scenarios = list(dict.fromkeys(s.key[0] for s in summaries))
    orders: dict[str, list[str]] = {}
    for s in summaries:
        orders.setdefault(s.key[0], _file_order(s))

    def rank(s: Summary) -> tuple[int, int]:
        names = orders[s.key[0]]
        return scenarios.index(s.key[0]), names.index(s.key[1]) if s.key[1] in names else len(names)

    return sorted(summaries, key=rank)  # stable: ties keep the order found


def _file_order(summary: Summary) -> list[str]:
    """The variant names of the summary's scenario file, or none when it cannot be read."""
    if summary.scenario_file is None:
        return []
    try:
        raw = yaml.safe_load(Path(summary.scenario_file).read_text(encoding="utf-8"))
        return [str(name) for name in raw["variants"]]
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError, RecursionError):
        return []


def merge(inputs: Sequence[Path], out: Path, console: Console) -> list[Summary]:
    """Copy every input's variant folders into `out` (reserved as `run` reserves it), one
    folder at a time into place, then redraw the overlays; the merged summaries, in order."""
    summaries = collect(inputs, out)
    frames = [plotted_samples(s.path.parent) for s in summaries]
    with report.reserve(out):
        for summary in summaries:
            _copy(summary.path.parent, out.joinpath(*summary.key))
        overlays(((s.key[0], s.key[1], frame) for s, frame in zip(summaries, frames, strict=True)
                  if not frame.empty), out, console)
    return summaries


def _copy(source: Path, target: Path) -> None:
    """Copy a variant folder into a fresh folder beside `target` that then takes its place."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.new."))
    except OSError as exc:
        raise cannot_write(target, exc) from None
    try:
        shutil.copytree(source, staging, ignore=shutil.ignore_patterns(".*"),
                        dirs_exist_ok=True)
        report.swap_into_place(staging, target)
    except OSError as exc:
        raise cannot_write(target, exc) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
