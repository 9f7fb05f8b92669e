"""The nightly record: every night's gated metrics, kept across nights in one JSON file.

A comparison sees two runs; a slow drift (a few MiB a week as mlx moves) shows only across many.
`kvmem publish` turns a night's summaries into one `Night` (its date, commit, backend, versions and
each variant's gated metrics), appends it to the record the previous night published, keeps the
last N runs and writes the record back as the site's `history.json`:

    {"schema": 1,
     "units": {"peak": "bytes", ..., "leak_rate": "bytes/req", "overhead_ratio": "ratio"},
     "runs": [{"date": "2025-06-01T03:17:00Z", "commit": "317a29b", "backend": "cpu",
               "mlx": "0.32.4", "mlx_lm": "0.32.2",
               "scenarios": {"qwen3_8b_growth": {"kvcache": {
                   "status": "ok", "error": null, "metrics": {"peak": 675328040, ...}}}}}]}

Runs are in date order, oldest first, dates in UTC. A variant that did not complete keeps its
status and its error's first line, and no metrics. A record that cannot be read is bad input
naming the file and the field, never a fresh start: the next night would publish a history
without it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

from pydantic import (
    AfterValidator,
    AwareDatetime,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
)

from ..common.echo import MAX_ECHO, clip, echo
from ..common.strict import Strict
from ..judge.metrics import METRICS, gated
from ..judge.summary import Summary
from .compare import index_summaries
from .tolerance import CompareError

SCHEMA = 1
DEFAULT_KEEP = 365  # a year of nights
MAX_KEEP = 100_000
COMMIT = re.compile(r"[0-9a-f]{4,64}")  # a git commit's SHA-1 or SHA-256, whole or abbreviated

Date = Annotated[AwareDatetime, AfterValidator(lambda d: d.astimezone(timezone.utc))]
# A whole number stays one in the file (675328040, not 675328040.0).
Figure = Annotated[float, Field(allow_inf_nan=False),
                   PlainSerializer(lambda v: int(v) if v.is_integer() else v)]


class _Read(Strict):
    # strict: the record is read back from a file anyone may have edited; nothing is coerced.
    model_config = ConfigDict(strict=True)


class VariantNight(_Read):
    """One variant on one night: its gated metrics, or why it did not complete."""

    status: str
    error: str | None = None
    metrics: dict[str, Figure] = Field(default_factory=dict)

    def value(self, metric: str) -> float | None:
        return self.metrics.get(metric) if self.status == "ok" else None


class Night(_Read):
    """One night: where its figures came from, and each scenario's variants."""

    date: Date
    commit: Annotated[str, Field(pattern=COMMIT.pattern)]
    backend: Annotated[str, Field(min_length=1)]
    mlx: str
    mlx_lm: str
    scenarios: dict[str, dict[str, VariantNight]]

    def variant(self, scenario: str, variant: str) -> VariantNight | None:
        return self.scenarios.get(scenario, {}).get(variant)


class Record(_Read):
    """The nights (`runs`), oldest first; `units` says what each metric is measured in."""

    model_config = ConfigDict(populate_by_name=True)  # `schema` is read by its alias too
    schema_: int = Field(default=SCHEMA, alias="schema")
    units: dict[str, str] = Field(default_factory=lambda: {
        m: METRICS[m].suffixed(METRICS[m].unit) for m in gated()})
    runs: tuple[Night, ...] = ()

    def to_json(self) -> str:
        """Compact (a year of nights is a few MiB), without the errors of completed runs."""
        data = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return json.dumps(data, separators=(",", ":")) + "\n"


def parse_date(text: str) -> datetime:
    """An ISO 8601 date and time in UTC (`2025-06-01T03:17:00Z`); one without an offset is
    read as UTC. ValueError for anything else."""
    text = text.strip()
    if text[-1:] in ("Z", "z"):  # Python 3.10's fromisoformat does not read the Z
        text = text[:-1] + "+00:00"
    value = datetime.fromisoformat(text)
    return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)


def tonight(summaries: Sequence[Summary], date: datetime, commit: str | None) -> Night:
    """The night's summaries as one run: of one backend, one summary per variant, and one
    commit (`commit`, else the git revision every summary records)."""
    index_summaries(summaries)
    backends = sorted({s.backend for s in summaries})
    if len(backends) > 1:
        raise CompareError(f"summaries of several backends ({', '.join(map(echo, backends))}): "
                           "publish one backend's history at a time")
    if commit is None:
        revisions = {s.environment.git_revision for s in summaries}
        commit = revisions.pop() if len(revisions) == 1 else None
        if commit is None:
            raise CompareError("the summaries do not share one git revision: pass --commit SHA")
    if not COMMIT.fullmatch(commit):
        raise CompareError(f"commit {echo(commit)}: expected a git commit SHA (4 to 64 hex digits)")
    scenarios: dict[str, dict[str, VariantNight]] = {}
    for s in sorted(summaries, key=lambda s: s.key):
        metrics = {m: v for m in gated() if (v := s.metric(m)) is not None} if s.ok else {}
        scenarios.setdefault(s.scenario, {})[s.variant] = VariantNight(
            status=s.status, error=None if s.ok else clip(s.first_error), metrics=metrics)
    versions = lambda name: ", ".join(sorted({getattr(s.environment, name) for s in summaries}))
    return Night(date=date, commit=commit, backend=backends[0], mlx=versions("mlx"),
               mlx_lm=versions("mlx_lm"), scenarios=scenarios)


def appended(record: Record, run: Night, keep: int) -> Record:
    """`record` with `run` added in date order, its oldest runs dropped beyond `keep`. One
    record holds one backend: the site's charts join its runs into lines."""
    held = {r.backend for r in record.runs} - {run.backend}
    if held:
        raise CompareError(f"the history holds runs of backend {echo(held.pop())}, these summaries "
                           f"are of {echo(run.backend)}: publish each backend to its own site")
    runs = sorted([*record.runs, run], key=lambda r: r.date)
    return Record(runs=tuple(runs[-keep:]))


def parse_record(path: Path, content: bytes) -> Record:
    """The record in `content` (read from `path` by harness.store.nightly); anything that is not
    a record is bad input naming the file and the field."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise CompareError(f"{path}: not a kvmem history (not UTF-8 text)") from None
    try:
        data = json.loads(text)
    except RecursionError:
        raise CompareError(f"{path}: not a kvmem history (JSON nested too deeply)") from None
    except ValueError as exc:
        raise CompareError(f"{path}: not a kvmem history (corrupt JSON: "
                           f"{clip(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)})"
                           ) from None
    if not isinstance(data, dict):
        raise CompareError(f"{path}: not a kvmem history (expected a JSON object)")
    if data.get("schema") != SCHEMA:
        raise CompareError(f"{path}: unsupported history schema {echo(data.get('schema'))}, "
                           f"expected {SCHEMA}")
    try:
        return Record.model_validate_json(text)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(clip(str(part), MAX_ECHO) for part in error["loc"]) or "(top level)"
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
        raise CompareError(f"{path}: not a kvmem history ({where}: {message})") from None
