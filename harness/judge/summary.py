"""The typed summary: one variant's summary.json, read and checked in one place.

A summary is the one file every later step reads (`show`, `compare`, `baseline`, `noise`,
`export`, `history`, `merge`), so it is parsed here into typed fields and every reader uses
those. A summary that cannot be trusted is bad input naming its file and field, never a crash
and never a silent "no change".

The file keeps what the run wrote: `raw` is the JSON object as read or made, and `to_json`
writes it back byte for byte (a baseline records the report's own bytes); `replace` changes
fields by parsing a new object, so the typed fields and the file never disagree.

Versions: `schema` is SCHEMA (1) in every summary written so far. A summary of any other
schema is bad input naming the number it has; a later layout brings a reader for this one.

Nothing here imports MLX, mlx-lm, pandas or matplotlib: the gate reads summaries fast.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from ..common.units import MAX_SIZE
from .metrics import METRICS, NOISY, gated

SCHEMA = 1


class SummaryError(ValueError):
    """A summary that cannot be read or trusted; the message names the file. Exit status 2."""


def finite(value: object) -> TypeGuard[float]:
    """A JSON number a metric can hold: not a bool, not NaN or infinite, and within the sizes
    that floats hold exactly (a 400-digit integer would overflow every rendering)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) <= MAX_SIZE if isinstance(value, int) else math.isfinite(value)


@dataclass(frozen=True)
class Noise:
    """The run-to-run spread (max - min) of one metric over `runs` runs of a variant."""

    spread: float
    runs: int


@dataclass(frozen=True)
class NoiseBlock:
    """A repeated measurement's record (harness.gate.noise): runs, the spread of each step-peak
    metric, the exact metrics that differed, and in how many runs the expectations held."""

    runs: int
    spreads: dict[str, Noise]
    ranges: dict[str, tuple[float, float]]  # each step-peak metric's lowest and highest run
    nondeterministic: dict[str, dict]
    passed: int


@dataclass(frozen=True)
class FindingRecord:
    """A finding as a summary records it (harness.detect.Finding holds the run's own)."""

    kind: str
    message: str
    count: int | None
    severity: str  # "warning": shown, but no default expectation fails on it


@dataclass(frozen=True)
class Expectation:
    name: str
    expected: Any
    actual: Any
    ok: bool

    def describe(self) -> str:
        return f"{self.name}: expected {self.expected}, got {self.actual}"


@dataclass(frozen=True)
class Environment:
    """What produced the figures; summaries from different backends are never compared."""

    backend: str
    mlx: str
    mlx_lm: str
    git_revision: str | None


@dataclass(frozen=True)
class ModelFacts:
    """The real model a run served (engine: mlx_lm)."""

    name: str | None
    engine: str | None
    layers: int | None
    weights: float | None


@dataclass(frozen=True)
class Recorded:
    """Who recorded a baseline, when and why (`baseline update --reason`): the gate lists it
    beside each baseline a pull request changes."""

    by: str
    at: str
    reason: str


@dataclass(frozen=True)
class Summary:
    """One variant's summary, from `path` (where it was read, or where its report goes)."""

    path: Path
    raw: dict
    scenario: str
    variant: str
    status: str
    error: str | None
    exit_status: int | None
    recorded_passed: bool | None
    metrics: dict[str, Any]
    findings: tuple[FindingRecord, ...]
    expectations: tuple[Expectation, ...]
    compare: dict[str, Any]
    detect: dict[str, Any] | None  # each detector's thresholds as applied; None in older runs
    environment: Environment
    noise_block: NoiseBlock | None
    model: ModelFacts | None
    store_stats: dict[str, Any] | None
    series: tuple[float, ...]
    scenario_file: str | None
    recorded: Recorded | None

    @property
    def key(self) -> tuple[str, str]:
        return self.scenario, self.variant

    @property
    def label(self) -> str:
        return f"{self.scenario}/{self.variant}"

    @property
    def backend(self) -> str:
        return self.environment.backend

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def failed_expectations(self) -> list[Expectation]:
        return [e for e in self.expectations if not e.ok]

    @property
    def passed(self) -> bool:
        """Whether a run met its expectations (`passed`, else every expectation ok)."""
        if self.recorded_passed is not None:
            return self.recorded_passed
        return not self.failed_expectations

    @property
    def first_error(self) -> str:
        """The first line of the error, or the status where none was recorded."""
        lines = (self.error or "").strip().splitlines()
        return lines[0] if lines else self.status

    def metric(self, name: str) -> float | None:
        value = self.metrics.get(name)
        return value if finite(value) else None

    def noise(self, name: str) -> Noise | None:
        """The recorded run-to-run spread of a step-peak metric, from the `noise` block."""
        return self.noise_block.spreads.get(name) if self.noise_block else None

    @property
    def incomplete(self) -> str | None:
        """Why a run that says ok cannot be compared or recorded, or None.

        A run that says ok must carry every required metric as a finite number
        (overhead_ratio may be null: no analytic minimum): a child that stopped early once
        wrote `metrics: {}`, and comparing nothing with nothing read as "no change".
        """
        if not self.ok:
            return None
        required = [name for name, metric in METRICS.items() if metric.required]
        missing = [name for name in required if name not in self.metrics]
        if missing:
            return f"status ok but metrics lack {', '.join(missing)}"
        nulls = [name for name in required
                 if self.metrics[name] is None and name != "overhead_ratio"]
        return f"metrics.{nulls[0]}: expected a finite number, got null" if nulls else None

    def replace(self, **changes: Any) -> Summary:
        """This summary with top-level fields changed (new ones go last), parsed again."""
        return parse(self.path, {**self.raw, **changes})

    def to_json(self) -> str:
        return json.dumps(self.raw, indent=2) + "\n"


def exit_status(summaries: list[Summary]) -> int:
    """0 every expectation held, 1 one failed, 2 a run could not complete."""
    if any(not s.ok for s in summaries):
        return 2
    return 0 if all(s.recorded_passed for s in summaries) else 1


def parse(path: Path, data: object) -> Summary:
    """A summary object as typed fields; bad input naming the file and the field.

    Checks types only: a run's own summary is parsed this way whatever its state; `checked`
    adds what the gate needs of a completed run.
    """
    if not isinstance(data, dict):
        raise SummaryError(f"{path}: not a valid summary (expected a JSON object)")
    try:
        return _typed(Path(path), data)
    except _Invalid as exc:
        raise SummaryError(f"{path}: not a valid summary ({exc})") from None


def checked(summary: Summary) -> Summary:
    """The summary, if it can be shown, compared and recorded; bad input naming its file."""
    problem = summary.incomplete
    if problem:
        raise SummaryError(f"{summary.path}: not a valid summary ({problem})")
    return summary


class _Invalid(ValueError):
    """Why a summary object is malformed: a field path and what was expected."""


def _typed(path: Path, data: dict) -> Summary:
    for name in ("scenario", "variant", "status"):
        if not isinstance(data.get(name), str):
            raise _Invalid(f"missing or non-string '{name}'")
    error = _optional(data, "error", str, "text")
    recorded = _optional(data, "passed", bool, "true or false")
    findings = tuple(FindingRecord(item["kind"], item["message"], _count(item.get("count")),
                                   "warning" if item.get("severity") == "warning" else "error")
                     for item in _items(data, "findings", {"kind": str, "message": str}))
    expectations = tuple(
        Expectation(item["name"], item.get("expected"), item.get("actual"), item["ok"])
        for item in _items(data, "expectations", {"ok": bool, "name": str}))
    metrics = data.get("metrics")
    if not isinstance(metrics, dict):
        raise _Invalid("no 'metrics' object")
    for name in gated():
        value = metrics.get(name)
        if not (value is None or finite(value)):
            raise _Invalid(f"metrics.{name}: expected a finite number, got {_brief(value)}")
    compare = data.get("compare") or {}
    if not isinstance(compare, dict):
        raise _Invalid(f"compare: expected an object of metric tolerances, got {_brief(compare)}")
    detect = data.get("detect")
    if not isinstance(detect, (dict, type(None))) or not all(
            isinstance(v, dict) for v in (detect or {}).values()):
        raise _Invalid(f"detect: expected an object of detector thresholds, got {_brief(detect)}")
    environment = _environment(data.get("environment"))
    series = (data.get("series") or {}).get("active") if isinstance(data.get("series"), dict) else None
    stats = data.get("store_stats")
    return Summary(
        path=path, raw=data, scenario=data["scenario"], variant=data["variant"],
        status=data["status"], error=error, exit_status=_count(data.get("exit_status")),
        recorded_passed=recorded, metrics=metrics, findings=findings, expectations=expectations,
        compare=compare, detect=detect, environment=environment, noise_block=_noise(data.get("noise")),
        model=_model(data.get("model")), store_stats=stats if isinstance(stats, dict) else None,
        series=tuple(v for v in series if finite(v)) if isinstance(series, list) else (),
        scenario_file=data.get("scenario_file") if isinstance(data.get("scenario_file"), str) else None,
        recorded=_recorded(data.get("recorded")))


def _recorded(block: object) -> Recorded | None:
    """The `recorded` block a baseline carries, or None; malformed is bad input."""
    if block is None:
        return None
    if not isinstance(block, dict) or not all(isinstance(block.get(k), str)
                                              for k in ("by", "at", "reason")):
        raise _Invalid(f"recorded: expected {{by, at, reason}} as text, got {_brief(block)}")
    return Recorded(block["by"], block["at"], block["reason"])


def _optional(data: dict, name: str, kind: type, what: str) -> Any:
    value = data.get(name)
    if not isinstance(value, (kind, type(None))):
        raise _Invalid(f"{name}: expected {what}, got {_brief(value)}")
    return value


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _environment(block: object) -> Environment:
    """The `environment` block: required, as the backend decides what a summary is compared
    with (a head whose summaries lost it once compared nothing and passed the gate)."""
    if block is None:
        raise _Invalid("no 'environment' object (expected the run's backend and versions)")
    if not isinstance(block, dict):
        raise _Invalid("'environment' is not an object")
    backend = block.get("backend")
    if not isinstance(backend, str) or not backend:
        raise _Invalid(f"environment.backend: expected the backend's name (cpu, metal or "
                       f"cuda), got {_brief(backend)}")
    for name in ("mlx", "mlx_lm"):
        if not isinstance(block.get(name, "?"), str):
            raise _Invalid(f"'environment.{name}' is not a string")
    revision = block.get("git_revision")
    return Environment(backend, block.get("mlx", "?"), block.get("mlx_lm", "?"),
                       revision if isinstance(revision, str) else None)


def _items(data: dict, name: str, fields: dict[str, type]) -> list[dict]:
    """`data[name]`, a list of objects each holding `fields` of their types."""
    items = data.get(name, [])
    if not isinstance(items, list):
        raise _Invalid(f"{name}: expected a list, got {_brief(items)}")
    words = {str: "text", bool: "true or false"}
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _Invalid(f"{name}.{i}: expected an object, got {_brief(item)}")
        for key, kind in fields.items():
            if not isinstance(item.get(key), kind):
                raise _Invalid(f"{name}.{i}.{key}: expected {words[kind]}, "
                               f"got {_brief(item.get(key))}")
    return items


def _model(block: object) -> ModelFacts | None:
    if not isinstance(block, dict):
        return None
    text = lambda key: block[key] if isinstance(block.get(key), str) else None
    weights = block.get("weights")
    return ModelFacts(text("name"), text("engine"), _count(block.get("layers")),
                      weights if finite(weights) else None)


def _noise(block: object) -> NoiseBlock | None:
    """A `noise` block (see harness.gate.noise), or None when absent; malformed is bad input."""
    if block is None:
        return None
    if not isinstance(block, dict):
        raise _Invalid("'noise' is not an object")
    runs = _count(block.get("runs"))
    if runs is None or runs < 1:
        raise _Invalid(f"noise.runs: expected a count of runs, got {_brief(block.get('runs'))}")
    spreads, ranges = {}, {}
    for name in NOISY:
        entry = block.get(name)
        if entry is None:
            continue
        spread = entry.get("spread") if isinstance(entry, dict) else None
        if not finite(spread) or spread < 0:
            raise _Invalid(f"noise.{name}.spread: expected a size of zero or more bytes")
        spreads[name] = Noise(spread, runs)
        low, high = entry.get("min"), entry.get("max")
        if finite(low) and finite(high):
            ranges[name] = (low, high)
    differed = block.get("nondeterministic")
    passed = _count(block.get("passed"))
    return NoiseBlock(runs, spreads, ranges, differed if isinstance(differed, dict) else {},
                      runs if passed is None else passed)


def _brief(value: Any) -> str:
    """A JSON value as the file holds it, cut to fit an error line."""
    if isinstance(value, int) and abs(value) >= 10**40:
        return "a huge integer"  # json.dumps refuses more than 4,300 digits
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def read_summary(path: Path) -> Summary:
    """Load and check one summary, naming the file in every error."""
    try:
        content = Path(path).read_bytes()
    except OSError as exc:
        raise SummaryError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return summary_from_bytes(path, content)


def summary_from_bytes(path: Path, content: bytes) -> Summary:
    """A summary from a file's bytes (read from disk, or from git at a revision), checked; bad
    input names `path`."""
    try:
        data = json.loads(content.decode("utf-8"))
    except UnicodeDecodeError:
        raise SummaryError(f"{path}: not a valid summary (not UTF-8 text)") from None
    except RecursionError:
        raise SummaryError(f"{path}: not a valid summary (JSON nested too deeply)") from None
    except ValueError as exc:  # corrupt JSON, or an integer of more than 4,300 digits
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SummaryError(f"{path}: not a valid summary (corrupt JSON: {reason})") from None
    if not isinstance(data, dict):
        raise SummaryError(f"{path}: not a valid summary (expected a JSON object)")
    if data.get("schema") != SCHEMA:
        raise SummaryError(f"{path}: unsupported summary schema {_brief(data.get('schema'))}, "
                           f"expected {SCHEMA}")
    return checked(parse(path, data))


def load_summaries(path: str | Path) -> list[Summary]:
    """Summaries under `path`: a summary file, a report folder, or a baselines folder.

    Folders are walked for `summary.json` files (report layout); a folder holding none is read
    as a baselines folder, where every `*.json` is a summary.
    """
    path = Path(path)
    if path.is_file():
        return [read_summary(path)]
    if not path.is_dir():
        raise SummaryError(f"{path}: no such file or folder")
    try:
        files = _visible(path, "summary.json") or _visible(path, "*.json")
    except OSError as exc:
        raise SummaryError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return [read_summary(f) for f in files]


def _visible(root: Path, pattern: str) -> list[Path]:
    """Files under `root` matching `pattern`, leaving out hidden names at any depth.

    Atomic writes leave `.summary.json.<random>.json` files, and report folders are staged as
    `.<variant>.new.<random>/`, when interrupted: half-written data, never a summary.
    """
    return sorted(f for f in root.rglob(pattern)
                  if not any(part.startswith(".") for part in f.relative_to(root).parts))
