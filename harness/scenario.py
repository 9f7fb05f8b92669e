"""Scenario files: YAML loaded with `safe_load` into a typed schema.

A scenario says what to serve (model geometry, cache components, workload) and what must hold
(expectations). Variants are named overrides deep-merged into the base, so one file carries a
"before" and an "after". Every error names the file, the field path and what was expected.
"""

from __future__ import annotations

import copy
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from . import geometry as geo
from .components import ComponentError, resolve

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9}
_SIZE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: Any) -> int:
    """Bytes from an integer or a string such as `512 MiB`; negative sizes are rejected."""
    if isinstance(value, bool):
        raise ValueError("expected a size in bytes, such as 4096 or '512 MiB'")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        unit = match.group(2).upper()
        if unit not in _UNITS:
            raise ValueError(f"unknown unit {match.group(2)!r}: expected B, KiB, MiB, GiB or TiB")
        number = int(float(match.group(1)) * _UNITS[unit])
    else:
        raise ValueError("expected a size in bytes, such as 4096 or '512 MiB'")
    if number < 0:
        raise ValueError("expected a size of zero or more bytes")
    return number


Size = Annotated[int, BeforeValidator(parse_size)]


def _tagged(**members: Any) -> Any:
    """A union that validates against one member, chosen by the input's shape.

    Plain unions report every member's errors; a user who wrote a mapping wants to hear what
    is wrong with the mapping, not that it is not a string.
    """
    def choose(value: Any) -> str:
        return "mapping" if isinstance(value, dict) else "list" if isinstance(value, list) else "scalar"

    choices = [Annotated[t, Tag(tag)] for tag, t in members.items()]
    return Annotated[Union[tuple(choices)], Discriminator(choose)]
Count = Annotated[int, Field(ge=0)]
Positive = Annotated[int, Field(ge=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True)


class LayerGroup(_Strict):
    count: Positive = 1
    kind: Literal["full", "sliding", "recurrent"]
    kv_heads: Count = 0
    head_dim: Count = 0
    window: Positive | None = None
    state_bytes: Size = 0
    dtype: Literal["float16", "bfloat16", "float32"] | None = None

    @model_validator(mode="after")
    def _check_kind(self) -> LayerGroup:
        if self.kind == "sliding" and self.window is None:
            raise ValueError("a sliding layer needs a window (tokens)")
        if self.kind != "recurrent" and (self.kv_heads < 1 or self.head_dim < 1):
            raise ValueError(f"a {self.kind} layer needs kv_heads >= 1 and head_dim >= 1")
        if self.kind == "recurrent" and (self.state_bytes < 1 or self.state_bytes % 4):
            raise ValueError("a recurrent layer needs state_bytes, a positive multiple of 4")
        return self


def _known_preset(name: str | None) -> str | None:
    if name is not None and name not in geo.PRESETS:
        raise ValueError(f"unknown preset {name!r}: expected one of " + ", ".join(geo.PRESETS))
    return name


class ModelSpec(_Strict):
    """A preset (optionally cut to its first `layers` layers) or inline layer groups."""

    preset: Annotated[str | None, AfterValidator(_known_preset)] = None
    layers: _tagged(scalar=Positive, list=list[LayerGroup]) | None = None
    dtype: Literal["float16", "bfloat16", "float32"] = "bfloat16"
    vocab: Positive | None = None
    window: Positive | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.preset is None:
            if not isinstance(self.layers, list) or not self.layers:
                raise ValueError("expected a preset name or a list of layer groups under layers")
        elif isinstance(self.layers, list):
            raise ValueError("with a preset, layers is a count (keep the first N layers)")
        return self

    def geometry(self) -> geo.Geometry:
        if self.preset is not None:
            return geo.preset(self.preset, layers=self.layers, dtype=self.dtype,
                              vocab=self.vocab, window=self.window)
        groups = [g.model_dump(exclude_none=True) for g in self.layers]
        return geo.build(groups, dtype=self.dtype, vocab=self.vocab or 32000)


class ComponentSpec(_Strict):
    component: str
    options: dict[str, Any] = Field(default_factory=dict)


class CacheSpec(_Strict):
    layer: ComponentSpec = ComponentSpec(component="mlx_lm.KVCache")
    sliding: ComponentSpec = ComponentSpec(component="mlx_lm.RotatingKVCache")
    store: ComponentSpec | None = None
    session: ComponentSpec | None = None


class PrefixSpec(_Strict):
    request: Count
    tokens: Positive


class RequestSpec(_Strict):
    prompt: Positive
    decode: Count = 0
    prefix: PrefixSpec | None = None
    repeat: Positive = 1


class ChatSpec(_Strict):
    turns: Positive
    user: Positive
    model: Positive


class WorkloadSpec(_Strict):
    prefill_chunk: Positive = 512
    batch: Positive = 1
    requests: list[RequestSpec] | None = None
    chat: ChatSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        if (self.requests is None) == (self.chat is None):
            raise ValueError("expected exactly one of requests (a list) or chat")
        for i, request in enumerate(self.requests or []):
            if request.prefix is None:
                continue
            if request.prefix.request >= i:
                raise ValueError(f"requests.{i}.prefix.request must name an earlier request")
            source = self.requests[request.prefix.request]
            if request.prefix.tokens > min(source.prompt, request.prompt):
                raise ValueError(f"requests.{i}.prefix.tokens exceeds a prompt it shares")
        return self


class SamplingSpec(_Strict):
    seed: Count = 0


class SpikeThresholds(_Strict):
    min_bytes: Size = 4 * 2**20
    min_ratio: Annotated[float, Field(ge=1.0)] = 1.05


class GrowthThresholds(_Strict):
    min_bytes: Size = 512 * 2**10


class LeakThresholds(_Strict):
    warmup: Count = 1
    min_bytes: Size = 64 * 2**10
    r2: Annotated[float, Field(ge=0.0, le=1.0)] = 0.9


class RetainedThresholds(_Strict):
    min_bytes: Size = 2**20
    ratio: Annotated[float, Field(ge=0.0)] = 0.25


class HostThresholds(_Strict):
    min_bytes: Size = 32 * 2**20


class DetectSpec(_Strict):
    spike: SpikeThresholds = SpikeThresholds()
    growth: GrowthThresholds = GrowthThresholds()
    leak: LeakThresholds = LeakThresholds()
    retained: RetainedThresholds = RetainedThresholds()
    host_memory: HostThresholds = HostThresholds()


Presence = Literal["none", "detected"]


class SpikeBound(_Strict):
    max_ratio: Annotated[float, Field(ge=1.0)]


class Tolerance(_Strict):
    rel: Annotated[float, Field(ge=0.0)] | None = None
    abs: Size | None = None


class ExpectSpec(_Strict):
    leak: Presence | None = "none"
    retained: Presence | None = "none"
    host_memory: Presence | None = "none"
    spike: _tagged(scalar=Presence, mapping=SpikeBound) | None = None
    growth: Presence | None = None
    peak: Size | None = None
    steady: Size | None = None
    final: Size | None = None
    per_token: Size | None = None
    overhead: Annotated[float, Field(gt=0.0)] | None = None
    compare: dict[str, Tolerance] = Field(default_factory=dict)


class ScenarioSpec(_Strict):
    name: str
    description: str = ""
    model: Annotated[ModelSpec, BeforeValidator(
        lambda v: {"preset": v} if isinstance(v, str) else v)]
    cache: CacheSpec = CacheSpec()
    workload: WorkloadSpec
    sampling: SamplingSpec = SamplingSpec()
    detect: DetectSpec = DetectSpec()
    expect: ExpectSpec = ExpectSpec()

    @model_validator(mode="after")
    def _check_workload(self) -> ScenarioSpec:
        if self.workload.chat is not None and self.cache.store is not None:
            raise ValueError("cache.store: a prefix store serves requests, not a chat workload")
        return self

    def geometry(self) -> geo.Geometry:
        return self.model.geometry().with_batch(self.workload.batch)


@dataclass(frozen=True)
class Scenario:
    """One runnable variant of a scenario file."""

    path: Path
    variant: str
    spec: ScenarioSpec

    @property
    def name(self) -> str:
        return self.spec.name


class ScenarioError(ValueError):
    """Bad scenario input; the message names the file and the field."""


def _merge(base: dict, override: dict) -> dict:
    """Deep-merge a variant into the base; naming another component replaces its options too."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        switches = (isinstance(value, dict) and isinstance(merged.get(key), dict)
                    and value.get("component", merged[key].get("component"))
                    != merged[key].get("component"))
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and not switches:
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


_UNION_TAGS = ("scalar", "mapping", "list")


def _field_path(loc: tuple) -> str:
    # pydantic adds the union member's tag to the location; the user never wrote it.
    parts = [str(p) for p in loc if p not in _UNION_TAGS]
    return ".".join(parts) or "(top level)"


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"{_field_path(item['loc'])}: {message}")
    return "; ".join(dict.fromkeys(lines))


def _check_components(spec: ScenarioSpec) -> None:
    """Resolve every component and bind its options, so a typo fails before any run."""
    geometry = spec.geometry()
    roles = {"layer": geometry.layers[0], "sliding": geometry.layers[0],
             "store": geometry, "session": geometry}
    for role, first_arg in roles.items():
        component: ComponentSpec | None = getattr(spec.cache, role)
        if component is None:
            continue
        field = f"cache.{role}"
        try:
            factory = resolve(component.component)
        except ComponentError as exc:
            raise ScenarioError(f"{field}.component: {exc}") from None
        try:
            inspect.signature(factory).bind(first_arg, **component.options)
        except TypeError as exc:
            raise ScenarioError(f"{field}.options: {exc} (for {component.component})") from None
        except ValueError:
            pass  # builtins without a signature: the run will tell


def _validate(raw: dict, variant: str) -> ScenarioSpec:
    try:
        spec = ScenarioSpec.model_validate(raw)
    except ValidationError as exc:
        raise ScenarioError(_describe(exc)) from None
    _check_components(spec)
    return spec


def load(path: str | Path, variants: list[str] | None = None) -> list[Scenario]:
    """Every variant of a scenario file (or those named), validated."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ScenarioError(f"{path}: invalid YAML{where}: {problem}") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: (top level): expected a mapping of scenario fields")
    raw.setdefault("name", path.stem)
    overrides = raw.pop("variants", None) or {"default": {}}
    if not isinstance(overrides, dict) or not all(
        isinstance(k, str) and isinstance(v, (dict, type(None))) for k, v in overrides.items()
    ):
        raise ScenarioError(f"{path}: variants: expected a mapping of name to overrides")
    unknown = sorted(set(variants or []) - set(overrides))
    if unknown:
        raise ScenarioError(f"{path}: variants: no variant {', '.join(unknown)} "
                            f"(expected one of {', '.join(overrides)})")
    scenarios = []
    for name, override in overrides.items():
        if variants and name not in variants:
            continue
        try:
            spec = _validate(_merge(raw, override or {}), name)
        except ScenarioError as exc:
            where = f"variant {name!r}: " if override else ""
            raise ScenarioError(f"{path}: {where}{exc}") from None
        scenarios.append(Scenario(path=path, variant=name, spec=spec))
    return scenarios


def discover(paths: list[str | Path]) -> list[Path]:
    """Scenario files from files and folders (folders: every *.yaml / *.yml, sorted)."""
    found: list[Path] = []
    for entry in map(Path, paths):
        if entry.is_dir():
            found.extend(sorted(p for p in entry.iterdir() if p.suffix in (".yaml", ".yml")))
        elif entry.exists():
            found.append(entry)
        else:
            raise ScenarioError(f"{entry}: no such file or folder")
    return found
