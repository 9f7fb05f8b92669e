"""The typed summary: one variant's summary.json, built by the run and read by every later step.

The run builds a `Summary` from typed records (findings, expectations, figures, the model it
served) and writes it once; `show`, `compare`, `baseline`, `noise`, `export`, `history`,
`merge` and `gate pr` parse a file into the same model. A summary that cannot be trusted is bad
input naming its file and field, never a crash and never a silent "no change": values are
strict (a bool is no count, a string no number, NaN no figure).

A summary keeps what its writer gave: a key absent from a file stays absent when the summary is
written again, and a key kvmem does not know is kept, so a baseline records a report as it is.

Versions: `schema` is SCHEMA, the first layout summaries were written in; any other value is
bad input naming the number it has (a later layout adds the upgrade of its predecessor's files
where they are read, `_current`).

Nothing here imports MLX, mlx-lm, pandas or matplotlib: the gate reads summaries fast.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..common.errors import BadInput
from ..common.strict import Strict
from ..common.units import MAX_SIZE
from .detectors import AppliedDetect
from .expect import GatedName, ToleranceSpec
from .metrics import METRICS, noisy
from .provenance import Provenance
from .records import Expectation, Finding, HeldAtRest

SCHEMA = 1


class SummaryError(BadInput):
    """A summary that cannot be read or trusted; the message names the file. Exit status 2."""


def _brief(value: Any) -> str:
    """A JSON value as the file holds it, cut to fit an error line."""
    if isinstance(value, int) and abs(value) >= 10**40:
        return "a huge integer"  # json.dumps refuses more than 4,300 digits
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def finite(value: object) -> bool:
    """A JSON number a metric can hold: not a bool, not NaN or infinite, and within the sizes
    that floats hold exactly (a 400-digit integer would overflow every rendering)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) <= MAX_SIZE if isinstance(value, int) else math.isfinite(value)


def _figure(value: Any) -> Any:
    if value is None or finite(value):
        return value
    raise PydanticCustomError("figure", "expected a finite number, got {got}",
                              {"got": _brief(value)})


def _spread(value: Any) -> Any:
    if finite(value) and value >= 0:
        return value
    raise PydanticCustomError("figure", "expected a size of zero or more bytes, got {got}",
                              {"got": _brief(value)})


def _finite(value: Any) -> Any:
    if value is None:
        raise PydanticCustomError("figure", "expected a finite number, got null")
    return _figure(value)


Figure = Annotated[Any, AfterValidator(_figure)]  # a finite number or null
Finite = Annotated[Any, AfterValidator(_finite)]  # a finite number


class _Given(Strict):
    """A record whose keys are those its writer gave: one absent stays absent when written."""

    # extra: a summary keeps the keys a later kvmem wrote; populate_by_name: read by alias too.
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @model_serializer(mode="wrap")
    def _given(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        fields = type(self).model_fields
        given = {key for name in self.model_fields_set
                 for key in (name, fields[name].alias if name in fields else None) if key}
        return {key: value for key, value in data.items() if key in given}


@dataclass(frozen=True)
class Noise:
    """The run-to-run spread (max - min) of one metric over `runs` runs of a variant."""

    spread: float
    runs: int


class Span(_Given):
    """One metric over a repeated measurement's runs: lowest, highest, spread, each run's."""

    min: Figure = None
    max: Figure = None
    spread: Annotated[Any, AfterValidator(_spread)]
    values: list[Finite] = Field(default_factory=list)


class NoiseBlock(_Given):
    """A repeated measurement's record (harness.pipeline.repeat): runs, the span of each step-peak
    metric under its name, the exact metrics that differed, and in how many runs the
    expectations held."""

    runs: Annotated[StrictInt, Field(ge=1)]
    nondeterministic: dict[str, Span] = Field(default_factory=dict)
    passed: StrictInt | None = None

    @model_validator(mode="after")
    def _spans(self) -> NoiseBlock:
        extra = self.__pydantic_extra__ or {}
        for name in [n for n in noisy() if n in extra]:
            try:
                extra[name] = Span.model_validate(extra[name])
            except ValidationError as exc:
                where, text = _problem(exc.errors()[0])
                raise PydanticCustomError("nested", "{text}", {"at": f"{name}.{where}",
                                                               "text": text}) from None
        return self

    @model_serializer(mode="wrap")
    def _ordered(self, handler: Any) -> dict[str, Any]:
        """runs, each span, nondeterministic, passed: the order `kvmem noise` writes."""
        data = _Given._given(self, handler)
        spans = [name for name in noisy() if name in data]
        first = {"runs": data.pop("runs"), **{name: data.pop(name) for name in spans}}
        return {**first, **data}

    def span(self, name: str) -> Span | None:
        found = (self.__pydantic_extra__ or {}).get(name)
        return found if isinstance(found, Span) else None

    @property
    def spreads(self) -> dict[str, Noise]:
        return {name: Noise(span.spread, self.runs) for name in noisy()
                if (span := self.span(name)) is not None}

    @property
    def ranges(self) -> dict[str, tuple[float, float]]:
        """Each step-peak metric's lowest and highest run, where the block says."""
        return {name: (span.min, span.max) for name in noisy()
                if (span := self.span(name)) is not None
                and span.min is not None and span.max is not None}

    @property
    def held(self) -> int:
        """In how many runs the expectations held (all of them, where the block does not say)."""
        return self.runs if self.passed is None else self.passed


class Environment(_Given, Provenance):  # runner, preloaded, model_folder
    """What produced the figures; summaries from different backends are never compared."""

    backend: Annotated[StrictStr, Field(min_length=1)]
    # How many live buffers the backend allows a process, where MLX says (Metal's).
    buffer_limit: StrictInt | None = None
    mlx: StrictStr = "?"
    mlx_lm: StrictStr = "?"
    python: StrictStr | None = None
    machine: StrictStr | None = None
    platform: StrictStr | None = None
    git_revision: StrictStr | None = None
    kvmem: dict[str, Any] | None = None
    packages: dict[str, StrictStr] = Field(default_factory=dict)


class Latency(_Given):
    """A server's per-request latency in seconds (requests.csv has each request's): the total
    of every request that got its whole reply, the time to first token of the streamed ones."""

    total_p50_s: Figure = None
    total_p95_s: Figure = None
    total_max_s: Figure = None
    ttft_p50_s: Figure = None
    ttft_p95_s: Figure = None
    ttft_max_s: Figure = None


class ModelFacts(_Given):
    """The real model a run served, as its engine reports it: every engine says what it is,
    the mlx_lm engine its quantization, the server engine its folder and its traffic, a
    recording the processes it sampled and what it could not see."""

    engine: StrictStr | None = None
    name: StrictStr | None = None
    layers: StrictInt | None = None
    weights: Figure = None
    quantize_bits: StrictInt | None = None
    folder: StrictStr | None = None
    ready_s: Figure = None
    requests: StrictInt | None = None
    disconnects: StrictInt | None = None
    rss_outside_gap: StrictInt | None = None
    # A server in an environment of its own: the versions there of MLX, mlx-lm and the packages
    # its scenario requires (what produced the figures, rather than kvmem's own).
    packages: dict[str, StrictStr] | None = None
    latency: Latency | None = None
    queued: StrictInt | None = None  # open loop: arrivals that waited for a free client
    ordered: StrictBool | None = None  # open loop replayed in order, arrival times ignored
    stopped: StrictStr | None = None  # why the traffic ended before its end (fail_fast)
    agent_s: Figure = None  # seconds kvmem's agent spent sampling inside the server, in all
    # A recording's: each process sampled (pid, parent, command, forked, samples, MLX active and
    # RSS at its last sample, the highest active, whether it exited), and what it could not see.
    processes: list[dict[str, Any]] | None = None
    notes: list[StrictStr] | None = None


class Recorded(Strict):
    """Who recorded a baseline, when and why (`baseline update --reason`): the gate lists it
    beside each baseline a pull request changes."""

    by: StrictStr
    at: StrictStr
    reason: StrictStr


class Series(_Given):
    """Active bytes above the baseline in 64 bins (the max of each), for sparklines."""

    active: list[Finite] = Field(default_factory=list)


class Summary(_Given):
    """One variant's summary; `path` is where it was read, or where its report goes."""

    schema_version: StrictInt = Field(SCHEMA, alias="schema")
    scenario: StrictStr
    variant: StrictStr
    scenario_file: StrictStr | None = None
    description: StrictStr = ""
    status: StrictStr
    error: StrictStr | None = None
    exit_status: StrictInt | None = None
    last_step: StrictInt | None = None
    peak_resets: StrictInt | None = None  # the measured code's resets of MLX's peak, if any
    metrics: dict[str, Figure]
    findings: list[Finding] = Field(default_factory=list)
    expectations: list[Expectation] = Field(default_factory=list)
    holders: HeldAtRest | None = None  # who held the arrays at the last point at rest
    recorded_passed: StrictBool | None = Field(None, alias="passed")
    compare: dict[GatedName, ToleranceSpec] = Field(default_factory=dict)
    detect: AppliedDetect | None = None  # each detector's thresholds as applied
    series: Series | None = None
    environment: Environment
    store_stats: dict[str, Figure] | None = None
    model: ModelFacts | None = None
    noise_block: NoiseBlock | None = Field(None, alias="noise")
    recorded: Recorded | None = None

    _path: Path = PrivateAttr(default_factory=Path)

    @property
    def path(self) -> Path:
        return self._path

    def at(self, path: Path) -> Summary:
        """This summary, its report going to `path`."""
        moved = self.model_copy()
        moved._path = Path(path)
        return moved

    def replace(self, **changes: Any) -> Summary:
        """This summary with fields changed (typed values, by their names in the file: `passed`,
        `noise`), at the same path."""
        names = {field.alias or name: name for name, field in type(self).model_fields.items()}
        return self.model_copy(update={names.get(key, key): value
                                       for key, value in changes.items()})

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

        A run that says ok must carry every required metric as a finite number (or null where
        the metric may have none, as overhead_ratio without an analytic minimum): a child that
        stopped early once wrote `metrics: {}`, and comparing nothing with nothing read as "no
        change".
        """
        if not self.ok:
            return None
        required = [name for name, metric in METRICS.items() if metric.required]
        missing = [name for name in required if name not in self.metrics]
        if missing:
            return f"status ok but metrics lack {', '.join(missing)}"
        nulls = [name for name in required
                 if self.metrics[name] is None and not METRICS[name].nullable]
        return f"metrics.{nulls[0]}: expected a finite number, got null" if nulls else None

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", by_alias=True), indent=2) + "\n"


def exit_status(summaries: list[Summary]) -> int:
    """0 every expectation held, 1 one failed, 2 a run could not complete."""
    if any(not s.ok for s in summaries):
        return 2
    return 0 if all(s.recorded_passed for s in summaries) else 1


# What a field holds where its type alone says too little, for an error naming it.
_EXPECTED = {
    "scenario": "the scenario's name",
    "variant": "the variant's name",
    "status": "the run's status (ok, failed, refused or interrupted)",
    "metrics": "an object of metrics",
    "environment": "an object of the run's backend and versions",
    "environment.backend": "the backend's name (cpu, metal or cuda)",
    "noise.runs": "a count of runs",
    "compare": "an object of metric tolerances",
    "detect": "an object of detector thresholds",
    "findings.*.kind": "text",
    "findings.*.message": "text",
    "expectations.*.name": "text",
    "expectations.*.ok": "true or false",
}
_TYPES = {"string_type": "text", "bool_type": "true or false", "int_type": "a whole number",
          "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
          "list_type": "a list", "dict_type": "an object", "model_type": "an object",
          "dataclass_type": "an object", "model_attributes_type": "an object",
          "dataclass_args_type": "an object", "string_too_short": "some text",
          "greater_than_equal": "a number of at least {ge}", "greater_than": "a number over {gt}",
          "literal_error": "one of {expected}"}


def _problem(error: Any) -> tuple[str, str]:
    """Where a pydantic error is (a dotted field path) and what is wrong there."""
    loc = [str(part) for part in error["loc"] if part != "[key]"]
    context = error.get("ctx") or {}
    if error["type"] == "nested":  # a check that names a field below its own
        return ".".join([*loc, context["at"]]), context["text"]
    where = ".".join(loc) or "(top level)"
    if error["type"] == "figure":
        return where, error["msg"]
    if error["type"] == "value_error":  # a check of its own, which says what it expected
        return where, error["msg"].removeprefix("Value error, ")
    generic = ".".join("*" if part.isdecimal() else part for part in loc)
    expected = _EXPECTED.get(generic) or _TYPES.get(error["type"])
    if expected is None:
        return where, "missing" if error["type"] == "missing" else error["msg"]
    got = "nothing" if error["type"] == "missing" else _brief(error["input"])
    return where, f"expected {expected.format(**context)}, got {got}"


def parse(path: Path, data: object) -> Summary:
    """A summary object of this schema as typed fields; bad input naming the file and the
    field. Checks types only: `checked` adds what the gate needs of a completed run."""
    if not isinstance(data, dict):
        raise SummaryError(f"{path}: not a valid summary (expected a JSON object)")
    try:
        summary = Summary.model_validate(data)
    except ValidationError as exc:
        where, text = _problem(exc.errors()[0])
        raise SummaryError(f"{path}: not a valid summary ({where}: {text})") from None
    return summary.at(path)


def checked(summary: Summary) -> Summary:
    """The summary, if it can be shown, compared and recorded; bad input naming its file."""
    problem = summary.incomplete
    if problem:
        raise SummaryError(f"{summary.path}: not a valid summary ({problem})")
    return summary


def _current(path: Path, data: dict) -> dict:
    """`data`, of schema SCHEMA; bad input for any other."""
    version = data.get("schema")
    if version != SCHEMA or isinstance(version, bool):
        raise SummaryError(f"{path}: unsupported summary schema {_brief(version)}, "
                           f"expected {SCHEMA}")
    return data


def summary_from_bytes(path: Path, content: bytes) -> Summary:
    """A summary from a file's bytes (read by harness.store from disk, or from git at a
    revision), checked; bad input names `path`."""
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
    return checked(parse(path, _current(path, data)))
