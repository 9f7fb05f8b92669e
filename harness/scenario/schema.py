"""The scenario schema: what a scenario file may say, as typed pydantic models.

A scenario says what to serve (model geometry, cache components, workload) and what must hold
(expectations). Counts are bounded and names are checked here, so a mistake fails naming its
field path; reading the file and merging variants is `harness.scenario.load`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    create_model,
    model_validator,
)

from ..common.echo import echo
from ..common.names import MAX_NAME, Flaw, flaw
from ..common.units import Size
from ..judge.detectors import DETECTORS, Detector, Presence
from ..judge.metrics import gated
from ..models import geometry as geo
from ..models import loading as models
from ..run.engines import ENGINES
from .server import HttpSpec, ServerSpec


def _tagged(**members: Any) -> Any:
    """A union that validates against one member, chosen by the input's shape.

    Plain unions report every member's errors; a user who wrote a mapping wants to hear what
    is wrong with the mapping, not that it is not a string.
    """
    def choose(value: Any) -> str:
        return "mapping" if isinstance(value, dict) else "list" if isinstance(value, list) else "scalar"

    choices = [Annotated[t, Tag(tag)] for tag, t in members.items()]
    # A union built at run time: only Union[...] takes its members as a tuple.
    return Annotated[Union[tuple(choices)], Discriminator(choose)]  # noqa: UP007


# Counts are strict integers (a bool or 1.5 is a mistake, not 1) with a sane upper bound, so a
# typo such as 10**30 fails here, naming its field, rather than deep inside a run.
MAX_TOKENS = 2**31 - 1      # tokens, steps, repeats: an int32
MAX_LAYERS = 4096           # layers of one model, in all
MAX_DIM = 2**16             # KV heads, head dim
MAX_BATCH = 2**16
MAX_VOCAB = 2**24
MAX_SEED = 2**32 - 1        # numpy's seeding takes uint32 words
Count = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKENS)]
Positive = Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS)]
Dim = Annotated[int, Field(strict=True, ge=0, le=MAX_DIM)]
Layers = Annotated[int, Field(strict=True, ge=1, le=MAX_LAYERS)]
# Finite numbers; an int is a number, a bool or a string is not.
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Dtype = Literal["float16", "bfloat16", "float32"]


# A scenario or variant name as its check says what is wrong with it ("expected ...").
_EXPECTED = {
    Flaw.NOT_TEXT: "a name (text)",
    Flaw.EMPTY: "a non-empty name",
    Flaw.CONTROL: "a name without control characters",
    Flaw.RELATIVE: "a name that does not start with '.' (it becomes a folder name)",
    Flaw.SEPARATOR: "a name without '/' or '\\' (it becomes a folder name)",
    Flaw.LEADING_DOT: "a name that does not start with '.' (it becomes a folder name)",
    Flaw.SPACES: "a name without leading or trailing spaces",
    Flaw.ABSOLUTE: "a name without a drive such as 'C:' (it becomes a folder name)",
}


def check_name(name: Any) -> str:
    """A scenario or variant name, safe as one path component (reports/<scenario>/<variant>/)."""
    found = flaw(name)
    if found is Flaw.TOO_LONG:
        raise ValueError(f"expected a name of at most {MAX_NAME} characters, got {len(name)}")
    if found is not None:
        raise ValueError(f"expected {_EXPECTED[found]}")
    return name


Name = Annotated[str, Field(strict=True), AfterValidator(check_name)]


class _Strict(BaseModel):
    # defer_build: validators are built on first use; a variant's process only unpickles
    # scenarios, and building them all at import was 0.17 s of its 0.85 s start.
    model_config = ConfigDict(extra="forbid", strict=False, frozen=True, defer_build=True)


class LayerGroup(_Strict):
    count: Layers = 1
    kind: Literal["full", "sliding", "recurrent"]
    kv_heads: Dim = 0
    head_dim: Dim = 0
    window: Positive | None = None
    state_bytes: Size = 0
    dtype: Dtype | None = None

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
    """A geometry preset (synthetic engine) or an mlx-lm config preset (mlx_lm engine); which
    engine may use which is checked with the engine (ScenarioSpec._check_engine)."""
    if name is not None and name not in geo.PRESETS and name not in models.PRESETS:
        raise ValueError(f"unknown preset {echo(name)}: expected one of "
                         + ", ".join(dict.fromkeys([*geo.PRESETS, *models.PRESETS])))
    return name


def _preset_layers(name: str) -> int:
    if name in geo.PRESETS:
        return sum(g.get("count", 1) for g in geo.PRESETS[name]["layers"])
    return models.preset_layers(name)


if TYPE_CHECKING:  # what the tagged unions validate to, for the type checker
    LayerCut = int | list[LayerGroup]
    MetricName = str
    EngineName = str
else:
    LayerCut = _tagged(scalar=Layers, list=list[LayerGroup])
    MetricName = Literal[tuple(gated())]  # one member per gated metric
    EngineName = Literal[tuple(ENGINES)]  # one member per registered engine


class QuantizeSpec(_Strict):
    """`model.quantize`: the weights through `mlx.nn.quantize` (mlx_lm engine)."""

    bits: Literal[2, 3, 4, 5, 6, 8]
    group_size: Literal[32, 64, 128] = 64


class ModelSpec(_Strict):
    """A preset (optionally cut to its first `layers` layers) or inline layer groups; on the
    mlx_lm engine also a local model folder (`path`) and quantized weights (`quantize`)."""

    preset: Annotated[str | None, Field(strict=True), AfterValidator(_known_preset)] = None
    path: Annotated[str, Field(strict=True, min_length=1)] | None = None
    layers: LayerCut | None = None
    dtype: Dtype = "bfloat16"
    vocab: Annotated[int, Field(strict=True, ge=1, le=MAX_VOCAB)] | None = None
    window: Positive | None = None
    quantize: QuantizeSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.path is not None:
            if self.preset is not None:
                raise ValueError("expected either preset or path, not both")
            if self.layers is not None or self.vocab is not None or self.window is not None:
                raise ValueError("with a path, the folder's config.json gives the layers, vocab "
                                 "and window")
            try:
                found = (Path(self.path) / "config.json").is_file()
            except (OSError, ValueError) as exc:  # a name too long, a NUL
                raise ValueError(f"path: cannot read {echo(self.path)}: "
                                 f"{getattr(exc, 'strerror', None) or exc}") from None
            if not found:
                raise ValueError(f"path: no config.json in {echo(self.path)} (expected a local "
                                 "model folder)")
        elif self.preset is None:
            if not isinstance(self.layers, list) or not self.layers:
                raise ValueError("expected a preset name or a list of layer groups under layers")
            total = sum(group.count for group in self.layers)
            if total > MAX_LAYERS:
                raise ValueError(f"layers: expected at most {MAX_LAYERS} layers in all, got {total}")
        elif isinstance(self.layers, list):
            raise ValueError("with a preset, layers is a count (keep the first N layers)")
        elif self.layers is not None:
            available = _preset_layers(self.preset)
            if self.layers > available:
                raise ValueError(f"layers: expected at most {available}, the layers of "
                                 f"{self.preset}; got {self.layers}")
        return self

    def choice(self) -> models.ModelChoice:
        """What the mlx_lm engine builds (ScenarioSpec._check_engine has checked it fits)."""
        assert not isinstance(self.layers, list)
        bits = self.quantize.bits if self.quantize else None
        group = self.quantize.group_size if self.quantize else 64
        return models.ModelChoice(self.preset, self.path, self.layers, self.vocab, self.dtype,
                                  bits, group)

    def geometry(self) -> geo.Geometry:
        """The synthetic engine's geometry (the mlx_lm engine's comes from the built model)."""
        if self.preset is not None:
            assert not isinstance(self.layers, list)  # with a preset, _check allows a count
            return geo.preset(self.preset, layers=self.layers, dtype=self.dtype,
                              vocab=self.vocab, window=self.window)
        assert isinstance(self.layers, list)  # no preset: _check required layer groups
        groups = [g.model_dump(exclude_none=True) for g in self.layers]
        return geo.build(groups, dtype=self.dtype, vocab=self.vocab or 32000)


class ComponentSpec(_Strict):
    component: Annotated[str, Field(strict=True, min_length=1)]
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
    batch: Annotated[int, Field(strict=True, ge=1, le=MAX_BATCH)] = 1
    requests: Annotated[list[RequestSpec], Field(min_length=1)] | None = None
    chat: ChatSpec | None = None
    http: HttpSpec | None = None  # a server's traffic (engine: server)

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        given = [self.requests, self.chat, self.http]
        if sum(part is not None for part in given) != 1:
            raise ValueError("expected exactly one of requests (a list), chat, or http (engine: "
                             "server)")
        requests = self.requests or []
        for i, request in enumerate(requests):
            if request.prefix is None:
                continue
            if request.prefix.request >= i:
                raise ValueError(f"requests.{i}.prefix.request must name an earlier request")
            source = requests[request.prefix.request]
            if request.prefix.tokens > min(source.prompt, request.prompt):
                raise ValueError(f"requests.{i}.prefix.tokens exceeds a prompt it shares")
        return self


class SamplingSpec(_Strict):
    seed: Annotated[int, Field(strict=True, ge=0, le=MAX_SEED)] = 0
    # Python's automatic cycle collector runs when it will, as in a server. True: at each idle
    # point kvmem finds what unreachable reference cycles hold, without freeing it (the
    # gc_deferred finding; leak and retained leave those bytes to it). False: it does not look.
    find_cycles: Annotated[bool, Field(strict=True)] = True


class DetectSpec(_Strict):
    """`detect:`: each registered detector's thresholds under its name (detect.DETECTORS).

    Validated against the registry as it stands when a scenario is validated (`_registered`),
    so a detector registered after import is known and a name not registered is unknown; the
    thresholds are held as extra fields, so a spec pickles (to a variant's child) by value.
    """

    model_config = ConfigDict(extra="allow", defer_build=True)

    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any: ...


class SpikeBound(_Strict):
    max_ratio: Annotated[Number, Field(ge=1.0)]


class Tolerance(_Strict):
    rel: Annotated[Number, Field(ge=0.0)] | None = None
    abs: Size | None = None


if TYPE_CHECKING:
    SpikeExpectation = Presence | SpikeBound
else:
    SpikeExpectation = _tagged(scalar=Presence, mapping=SpikeBound)


class ExpectSpec(_Strict):
    """`expect:`: the budgets, `kvmem compare`'s tolerances and spike's presence or bound.

    Every other registered detector adds its presence (`none` or `detected`), an extra field
    validated as DetectSpec's are, defaulting to its registry entry's `expected`.
    """

    model_config = ConfigDict(extra="allow", defer_build=True)

    spike: SpikeExpectation | None = None
    peak: Size | None = None
    steady: Size | None = None
    final: Size | None = None
    per_token: Size | None = None
    overhead: Annotated[Number, Field(gt=0.0)] | None = None
    # Keyed by the metrics `kvmem compare` knows: a typo would silently tolerate nothing.
    compare: dict[MetricName, Tolerance] = Field(default_factory=dict)


FieldOf = Callable[[Detector], tuple[Any, Any]]


def _thresholds_field(detector: Detector) -> tuple[Any, Any]:
    return detector.thresholds, detector.thresholds()


def _presence_field(detector: Detector) -> tuple[Any, Any]:
    return Presence | None, detector.expected


@functools.cache
def _schema(base: type[_Strict], field: FieldOf,
            detectors: tuple[tuple[str, Detector], ...]) -> type[_Strict]:
    """`base` closed to unknown keys, with a field, (type, default) from `field`, per detector
    it does not declare itself."""
    fields: dict[str, Any] = {name: field(d) for name, d in detectors
                              if name not in base.model_fields}
    return create_model(base.__name__, __base__=base, __cls_kwargs__={"extra": "forbid"},
                        **fields)


def _registered(base: type[_Strict], field: FieldOf) -> Callable[[Any], Any]:
    """Validates a `base` against detect.DETECTORS as it stands at validation time, not at
    import; the value is a plain `base`, the registered fields held as extras."""
    def validate(value: Any) -> _Strict:
        checked = _schema(base, field, tuple(DETECTORS.items())).model_validate(value)
        return base.model_construct(checked.model_fields_set, **dict(checked))  # validated now

    return validate


_detect = _registered(DetectSpec, _thresholds_field)
_expect = _registered(ExpectSpec, _presence_field)


# Registry caches BatchGenerator can batch on the mlx_lm engine: one a sequence, merged into
# BatchKVCache, BatchRotatingKVCache or PreallocatedBatchRotatingKVCache (a batch class named
# directly merges as its single-sequence class); and those it cannot (no `merge`).
_BATCHABLE = ("mlx_lm.KVCache", "mlx_lm.RotatingKVCache", "mlx_lm.BatchRotatingKVCache",
              "reference.rotating", "reference.batch_rotating")
_UNBATCHABLE = ("mlx_lm.QuantizedKVCache", "reference.turboquant")


class ScenarioSpec(_Strict):
    name: Name
    description: Annotated[str, Field(strict=True)] = ""
    # synthetic: seeded K/V fed to the caches (harness.run.engine); mlx_lm: a real mlx-lm model
    # with random weights, served through generate_step (harness.run.model_engine); server: a
    # real server process under HTTP traffic (harness.run.server_engine).
    engine: EngineName = "synthetic"
    server: ServerSpec | None = None
    model: Annotated[ModelSpec, BeforeValidator(
        lambda v: {"preset": v} if isinstance(v, str) else v)]
    cache: CacheSpec = CacheSpec()
    workload: WorkloadSpec
    sampling: SamplingSpec = SamplingSpec()
    detect: Annotated[DetectSpec, BeforeValidator(_detect)] = Field(default_factory=lambda: _detect({}))
    expect: Annotated[ExpectSpec, BeforeValidator(_expect)] = Field(default_factory=lambda: _expect({}))
    # Seconds a variant may run before its process is killed; `--timeout` overrides it.
    timeout: Annotated[Number, Field(gt=0)] | None = None

    @model_validator(mode="after")
    def _check_workload(self) -> ScenarioSpec:
        if self.workload.chat is not None and self.cache.store is not None:
            raise ValueError("cache.store: a prefix store serves requests, not a chat workload")
        return self

    @model_validator(mode="after")
    def _check_engine(self) -> ScenarioSpec:
        model = self.model
        serving = self.engine == "server"
        if serving != (self.workload.http is not None):
            raise ValueError("workload.http: HTTP traffic needs engine: server" if not serving
                             else "workload: engine server sends HTTP traffic: expected "
                             "workload.http")
        if self.server is not None and not serving:
            raise ValueError("server: needs engine: server")
        if serving:
            self._check_server()
        if self.engine == "synthetic":
            if model.path is not None or model.quantize is not None:
                field = "path" if model.path is not None else "quantize"
                raise ValueError(f"model.{field}: needs engine: mlx_lm (a real model)")
            if model.preset is not None and model.preset not in geo.PRESETS:
                raise ValueError(f"model.preset: {model.preset!r} is an mlx_lm config preset: "
                                 "add engine: mlx_lm, or use a geometry preset ("
                                 + ", ".join(geo.PRESETS) + ")")
            return self
        if model.preset is None and model.path is None:
            raise ValueError(f"model: engine {self.engine} builds a model from a preset ("
                             + ", ".join(models.PRESETS) + ") or loads one from a path, "
                             "not from layer groups")
        if model.preset is not None and model.preset not in models.PRESETS:
            raise ValueError(f"model.preset: {model.preset!r} has no mlx_lm config: expected "
                             "one of " + ", ".join(models.PRESETS))
        if model.window is not None:
            raise ValueError(f"model.window: the {self.engine} engine takes the window from the "
                             "model")
        if self.workload.batch != 1:
            self._check_batch()
        return self

    def _check_server(self) -> None:
        """A server serves its own caches: kvmem's cache components and batch do not apply."""
        if self.cache != CacheSpec():
            raise ValueError("cache: the server uses its own caches; engine server takes no "
                             "cache components")
        if self.workload.requests is not None or self.workload.chat is not None:
            raise ValueError("workload: engine server sends workload.http alone")
        if self.workload.batch != 1:
            raise ValueError("workload.batch: the server batches as it does; set "
                             "workload.http.clients for concurrent requests")

    def serving(self) -> ServerSpec:
        """The server section, its defaults where the scenario says nothing."""
        return self.server if self.server is not None else ServerSpec()

    def _check_batch(self) -> None:
        """batch > 1 on the mlx_lm engine runs through mlx-lm's BatchGenerator: requests only,
        no session, and layer caches it can batch (it merges one cache a sequence with the
        cache class's `merge`). A store serves and keeps the first sequence, as a server's
        prompt cache does each of its batch's sequences."""
        if self.workload.chat is not None:
            raise ValueError("workload.batch: the mlx_lm engine serves a chat one sequence at "
                             "a time (batch: 1); batch > 1 serves requests")
        if self.cache.session is not None:
            raise ValueError("cache.session: the mlx_lm engine serves batch > 1 through "
                             "mlx-lm's BatchGenerator, without a session (use batch: 1)")
        for role in ("layer", "sliding"):
            name = getattr(self.cache, role).component
            if name in _UNBATCHABLE:
                raise ValueError(f"cache.{role}: {name} cannot be batched by mlx-lm's "
                                 "BatchGenerator (it has no merge); with batch > 1 use "
                                 + ", ".join(_BATCHABLE))

    def geometry(self) -> geo.Geometry:
        """Per layer, what the caches hold: on the mlx_lm engine read from the built model."""
        if self.engine != "synthetic":
            return models.describe(self.model.choice())[0].with_batch(self.workload.batch)
        return self.model.geometry().with_batch(self.workload.batch)

    def weights_bytes(self) -> int:
        """The model's weights on the mlx_lm engine (the synthetic engine has none)."""
        return models.describe(self.model.choice())[1] if self.engine != "synthetic" else 0
