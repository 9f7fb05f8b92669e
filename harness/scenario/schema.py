"""The scenario schema: what a scenario file may say, as typed pydantic models.

A scenario says what to serve (model geometry, cache components, workload) and what must hold
(expectations). Counts are bounded and names are checked here, so a mistake fails naming its
field path; reading the file and merging variants is `harness.scenario.load`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from ..common.echo import echo
from ..common.names import MAX_NAME, Flaw, flaw
from ..common.strict import Number, Strict, tagged
from ..common.units import Size
from ..judge.detectors import DetectSpec
from ..judge.expect import ExpectSpec
from ..models import geometry as geo
from ..models import loading as models
from ..models import presets
from .engines import ENGINES, EngineName, named
from .server import HttpSpec, ServerSpec

# Counts are strict integers (a bool or 1.5 is a mistake, not 1) with a sane upper bound, so a
# typo such as 10**30 fails here, naming its field, rather than deep inside a run.
MAX_TOKENS = 2**31 - 1      # tokens, steps, repeats: an int32
MAX_LAYERS = 4096           # layers of one model, in all
MAX_DIM = 2**16             # KV heads, head dim
MAX_BATCH = 2**16
MAX_VOCAB = 2**24
MAX_SEED = 2**32 - 1        # numpy's seeding takes uint32 words
# Validation context key: a scenario read as data (harness.scenario.load.definitions), whose
# model folder is not looked for on this machine.
AS_DATA = "as_data"
Count = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKENS)]
Positive = Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS)]
Dim = Annotated[int, Field(strict=True, ge=0, le=MAX_DIM)]
Layers = Annotated[int, Field(strict=True, ge=1, le=MAX_LAYERS)]
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


class LayerGroup(Strict):
    """`count` layers of one kind: full attention, a sliding window, or a recurrent state."""

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
    """A preset of harness.models.presets; whether the engine can serve it (its layer groups,
    or its mlx-lm config) is checked with the engine (ScenarioSpec._check_engine)."""
    if name is not None and name not in presets.PRESETS:
        raise ValueError(f"unknown preset {echo(name)}: expected one of "
                         + ", ".join(presets.PRESETS))
    return name


if TYPE_CHECKING:  # what the tagged union validates to
    LayerCut = int | list[LayerGroup]
else:
    LayerCut = tagged(scalar=Layers, list=list[LayerGroup])


def _known_engine(name: Any) -> Any:
    """An engine of harness.scenario.engines, said in the words a misspelt name needs."""
    if not isinstance(name, str):
        raise PydanticCustomError("string_type", "Input should be a valid string")
    if name not in ENGINES:
        raise ValueError(f"unknown engine {echo(name)}: expected one of {', '.join(ENGINES)}")
    return name


Engine = Annotated[EngineName, BeforeValidator(_known_engine)]


class QuantizeSpec(Strict):
    """`model.quantize`: the weights through `mlx.nn.quantize` (mlx_lm engine)."""

    bits: Literal[2, 3, 4, 5, 6, 8]
    group_size: Literal[32, 64, 128] = 64


class ModelSpec(Strict):
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
    def _check(self, info: ValidationInfo) -> ModelSpec:
        if self.path is not None:
            if self.preset is not None:
                raise ValueError("expected either preset or path, not both")
            if self.layers is not None or self.vocab is not None or self.window is not None:
                raise ValueError("with a path, the folder's config.json gives the layers, vocab "
                                 "and window")
            if (info.context or {}).get(AS_DATA):  # the gate's reading: the folder may be gone
                return self
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
            available = presets.layer_count(self.preset)
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
            return presets.geometry(self.preset, layers=self.layers, dtype=self.dtype,
                                    vocab=self.vocab, window=self.window)
        assert isinstance(self.layers, list)  # no preset: _check required layer groups
        groups = [g.model_dump(exclude_none=True) for g in self.layers]
        return geo.build(groups, dtype=self.dtype, vocab=self.vocab or 32000)


class ComponentSpec(Strict):
    """A component by registry name (`mlx_lm.KVCache`, `reference.prefix_cache`) or import path
    (`package.module:factory`), and the options its factory takes."""

    component: Annotated[str, Field(strict=True, min_length=1)]
    options: dict[str, Any] = Field(default_factory=dict)


class CacheSpec(Strict):
    """The components by role: full-attention and sliding layers, recurrent layers, a store
    across requests, a chat session."""

    layer: ComponentSpec = ComponentSpec(component="mlx_lm.KVCache")
    sliding: ComponentSpec = ComponentSpec(component="mlx_lm.RotatingKVCache")
    # Recurrent layers: the synthetic engine's fixed state unless a component is named.
    recurrent: ComponentSpec | None = None
    store: ComponentSpec | None = None
    session: ComponentSpec | None = None


class PrefixSpec(Strict):
    """The head this request shares with an earlier one: that request's index and the tokens
    in common."""

    request: Count
    tokens: Positive


class RequestSpec(Strict):
    """One request: prompt tokens, then decode steps, `repeat` times."""

    prompt: Positive
    decode: Count = 0
    prefix: PrefixSpec | None = None
    repeat: Positive = 1


class ChatSpec(Strict):
    """A chat: `turns` turns of `user` tokens in and `model` tokens out."""

    turns: Positive
    user: Positive
    model: Positive


class WorkloadSpec(Strict):
    """What is served: a list of requests, a chat, or HTTP traffic (engine: server), with the
    prefill chunk and the batch."""

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


class SamplingSpec(Strict):
    """The seed of the synthetic K/V, and what kvmem looks for at each point at rest: cycle
    garbage (`find_cycles`) and who holds the live MLX arrays (`holders`)."""

    seed: Annotated[int, Field(strict=True, ge=0, le=MAX_SEED)] = 0
    # Python's automatic cycle collector runs when it will, as in a server. True: at each idle
    # point kvmem finds what unreachable reference cycles hold, without freeing it (the
    # gc_deferred finding; leak and retained leave those bytes to it). False: it does not look.
    find_cycles: Annotated[bool, Field(strict=True)] = True
    # At each idle point kvmem walks the objects that hold MLX arrays (docs/holders.md): the
    # `buffers` and `arrays` columns, holders.csv, and the holders findings name. False: it
    # does not (every other figure is the same either way).
    holders: Annotated[bool, Field(strict=True)] = True


# Registry caches BatchGenerator can batch on the mlx_lm engine: one a sequence, merged into
# BatchKVCache, BatchRotatingKVCache or PreallocatedBatchRotatingKVCache (a batch class named
# directly merges as its single-sequence class); and those it cannot (no `merge`).
_BATCHABLE = ("mlx_lm.KVCache", "mlx_lm.RotatingKVCache", "mlx_lm.BatchRotatingKVCache",
              "reference.rotating", "reference.batch_rotating")
_UNBATCHABLE = ("mlx_lm.QuantizedKVCache", "reference.turboquant")


class ScenarioSpec(Strict):
    """A scenario: what to serve (model geometry, cache components, workload) and what must
    hold (expectations)."""

    name: Name = Field(description="The scenario's name (a folder name); defaults to the file's.")
    description: Annotated[str, Field(strict=True)] = Field(default="", description=(
        "What the scenario shows, for people."))
    # What serves the workload (harness.scenario.engines): seeded K/V fed to the caches, a
    # real mlx-lm model with random weights, or a real server process under HTTP traffic.
    engine: Engine = Field(default="synthetic", description=(
        "What serves the workload: synthetic K/V fed to the caches, a real mlx-lm model "
        "(mlx_lm), or a server process under HTTP traffic (server)."))
    server: ServerSpec | None = Field(default=None, description=(
        "The server process kvmem starts (engine: server)."))
    model: Annotated[ModelSpec, BeforeValidator(
        lambda v: {"preset": v} if isinstance(v, str) else v,
        json_schema_input_type=str | ModelSpec)] = Field(description=(
            "A preset's name, or {preset, layers} for its first layers, or inline layer groups."))
    cache: CacheSpec = Field(default=CacheSpec(), description=(
        "The cache components by role, each a registry name or an import path."))
    workload: WorkloadSpec = Field(description=(
        "What is served: requests, a chat, or HTTP traffic (engine: server)."))
    sampling: SamplingSpec = Field(default=SamplingSpec(), description=(
        "What kvmem measures at each point at rest beside memory."))
    detect: DetectSpec = Field(default_factory=DetectSpec, description=(
        "Each detector's thresholds; its defaults where not stated."))
    expect: ExpectSpec = Field(default_factory=ExpectSpec, description=(
        "What must hold: each finding's presence, budgets and the gate's tolerances."))
    timeout: Annotated[Number, Field(gt=0)] | None = Field(default=None, description=(
        "Seconds a variant may run before its process is killed; --timeout overrides it."))

    @model_validator(mode="after")
    def _buffer_bound(self) -> ScenarioSpec:
        """`expect.buffers: N` is the limit the buffers detector projects to, where
        `detect.buffers.limit` states none."""
        bound, thresholds = self.expect.buffers, self.detect.buffers
        if isinstance(bound, int) and thresholds.limit is None:
            limited = thresholds.model_copy(update={"limit": max(bound, 1)})
            object.__setattr__(self, "detect", self.detect.model_copy(update={"buffers": limited}))
        return self

    @model_validator(mode="after")
    def _check_workload(self) -> ScenarioSpec:
        if self.workload.chat is not None and self.cache.store is not None:
            raise ValueError("cache.store: a prefix store serves requests, not a chat workload")
        return self

    @model_validator(mode="after")
    def _check_engine(self) -> ScenarioSpec:
        entry = ENGINES[self.engine]
        if entry.http != (self.workload.http is not None):
            raise ValueError(f"workload.http: HTTP traffic needs engine: {named('http')}"
                             if not entry.http else f"workload: engine {self.engine} sends "
                             "HTTP traffic: expected workload.http")
        if self.server is not None and not entry.http:
            raise ValueError(f"server: needs engine: {named('http')}")
        if entry.http:
            self._check_server()
        if entry.real_model:
            self._check_real_model()
        else:
            self._check_geometry()
        return self

    def _check_geometry(self) -> None:
        """An engine of synthetic K/V serves a geometry: a preset's layer groups or inline
        ones, no weights to load or quantize."""
        model = self.model
        if model.path is not None or model.quantize is not None:
            field = "path" if model.path is not None else "quantize"
            raise ValueError(f"model.{field}: needs engine: {named('real_model')} (a real model)")
        if model.preset is not None and model.preset not in presets.geometric():
            raise ValueError(f"model.preset: {model.preset!r} is an mlx_lm config preset: "
                             f"add engine: {named('real_model')}, or use a geometry preset ("
                             + ", ".join(presets.geometric()) + ")")

    def _check_real_model(self) -> None:
        """An engine of a real model builds a preset's mlx-lm config or loads a folder; the
        model says its window."""
        model = self.model
        if self.cache.recurrent is not None:
            raise ValueError(f"cache.recurrent: the {self.engine} engine keeps the model's own "
                             "recurrent state; cache.recurrent is the synthetic engine's")
        if model.preset is None and model.path is None:
            raise ValueError(f"model: engine {self.engine} builds a model from a preset ("
                             + ", ".join(presets.buildable()) + ") or loads one from a path, "
                             "not from layer groups")
        if model.preset is not None and model.preset not in presets.buildable():
            raise ValueError(f"model.preset: {model.preset!r} has no mlx_lm config: expected "
                             "one of " + ", ".join(presets.buildable()))
        if model.window is not None:
            raise ValueError(f"model.window: the {self.engine} engine takes the window from the "
                             "model")
        if self.workload.batch != 1:
            self._check_batch()

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
            raise ValueError(f"workload.batch: the {self.engine} engine serves a chat one "
                             "sequence at a time (batch: 1); batch > 1 serves requests")
        if self.cache.session is not None:
            raise ValueError(f"cache.session: the {self.engine} engine serves batch > 1 "
                             "through mlx-lm's BatchGenerator, without a session (use batch: 1)")
        for role in ("layer", "sliding"):
            name = getattr(self.cache, role).component
            if name in _UNBATCHABLE:
                raise ValueError(f"cache.{role}: {name} cannot be batched by mlx-lm's "
                                 "BatchGenerator (it has no merge); with batch > 1 use "
                                 + ", ".join(_BATCHABLE))

    def geometry(self) -> geo.Geometry:
        """Per layer, what the caches hold: on the mlx_lm engine read from the built model."""
        if ENGINES[self.engine].real_model:
            return models.describe(self.model.choice())[0].with_batch(self.workload.batch)
        return self.model.geometry().with_batch(self.workload.batch)

    def weights_bytes(self) -> int:
        """The model's weights on the mlx_lm engine (the synthetic engine has none)."""
        return models.describe(self.model.choice())[1] if ENGINES[self.engine].real_model else 0
