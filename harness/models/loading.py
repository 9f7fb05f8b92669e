"""Real mlx-lm models for the `mlx_lm` and server engines: a preset's config with random weights,
or a local folder.

A preset's config (harness.models.presets) is built as `Model(ModelArgs.from_dict(config))`:
every weight is a lazy random array, so nothing is downloaded and the weights' bytes are known
before they are evaluated. `layers: N` keeps the first N layers (N = num_hidden_layers), `vocab`
resizes the vocabulary (a 150k-token output layer dominates a decode step on CPU), `quantize`
runs `mlx.nn.quantize` over the built model.

`model: {path: DIR}` loads a local model folder with mlx-lm's `load_model` (config.json and
safetensors): `mlx_lm.load` would also load a tokenizer, which the engine never uses (its token
ids are drawn, not encoded) and which a folder built offline may not have.

The geometry the detectors and the analytic minimum use comes from the built model itself, not
from the config: one token is run through the model lazily on fresh caches from the model's own
`make_cache`, and each cache's shapes are read without evaluating anything (MLX knows shapes
and dtypes of unevaluated arrays). KV caches give the layer's KV heads, head dim and dtype,
`RotatingKVCache` its window, `ArraysCache` (recurrent layers) its state bytes.

MLX and mlx-lm (and through it transformers) are imported where a model is built or its caches
read, never at import: the scenario schema imports this module, rejecting a bad file must not
wait seconds for mlx-lm, and the gate reads scenario files where MLX may not be installed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.echo import clip
from ..common.errors import KvmemError
from . import geometry as geo
from . import presets

if TYPE_CHECKING:
    import mlx.nn as nn


@dataclass(frozen=True)
class ModelChoice:
    """What a scenario's `model:` says to build on the mlx_lm engine (plain values: it pickles)."""

    preset: str | None
    path: str | None
    layers: int | None
    vocab: int | None
    dtype: str
    bits: int | None
    group_size: int

    @property
    def name(self) -> str:
        return self.preset or Path(self.path or "model").name


class ModelError(KvmemError, ValueError):
    """A model that cannot be built or loaded; the message says why."""


def build(choice: ModelChoice) -> nn.Module:
    """The model with lazy weights: random from a preset (seed them with `mx.random.seed`
    first), or a local folder's; cast to the dtype (presets only) and quantized if asked."""
    if choice.path is not None:
        from mlx_lm.utils import load_model

        try:
            model, _config = load_model(Path(choice.path), lazy=True)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelError(_load_failure(Path(choice.path), exc)) from None
    else:
        from mlx_lm.utils import _get_classes

        assert choice.preset is not None
        config = presets.config(choice.preset, choice.layers, choice.vocab)
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        model.set_dtype(geo.mlx_dtype(choice.dtype))
    if choice.bits is not None:
        import mlx.nn as nn

        try:
            nn.quantize(model, group_size=choice.group_size, bits=choice.bits)
        except ValueError as exc:  # a layer's input width is not a multiple of the group size
            raise ModelError(f"model {choice.name}: cannot quantize with group_size "
                             f"{choice.group_size}: {clip(_first_line(exc))}") from None
    return model


def _load_failure(folder: Path, exc: Exception) -> str:
    """Why a model folder did not load, naming the weight file MLX refuses if one is: MLX's own
    message for a truncated download ("invalid data offsets") names no file."""
    import mlx.core as mx

    for file in sorted(folder.glob("model*.safetensors")):  # what mlx-lm's load_model reads
        try:
            mx.load(str(file))
        except (OSError, ValueError, RuntimeError) as bad:
            return f"{file}: not a valid safetensors file ({clip(_first_line(bad))})"
    return f"cannot load a model from {folder}: {clip(_first_line(exc))}"


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def weights_bytes(model: nn.Module) -> int:
    """Bytes of every parameter (known before evaluation: shapes and dtypes are)."""
    from mlx.utils import tree_flatten

    arrays: Any = tree_flatten(model.parameters())
    return sum(v.nbytes for _, v in arrays)


def make_caches(model: nn.Module) -> list[Any]:
    """The model's own caches (`make_cache`, or one KVCache per layer without one)."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def geometry(model: nn.Module, name: str) -> geo.Geometry:
    """The model's cache geometry, read lazily from one token run on fresh caches."""
    import mlx.core as mx

    caches = make_caches(model)
    logits = model(mx.array([[0]]), cache=caches)
    layers = [_layer(index, cache) for index, cache in enumerate(caches)]
    return geo.Geometry(name=name, layers=tuple(layers), vocab=int(logits.shape[-1]))


def _layer(index: int, cache: Any) -> geo.LayerSpec:
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    if isinstance(cache, ArraysCache):
        arrays: list[Any] = [a for a in cache.cache if a is not None]
        state = sum(a.nbytes for a in arrays)
        return geo.LayerSpec(index, geo.KIND_RECURRENT, 0, 0, mx.float32, state_bytes=state)
    if isinstance(cache, (KVCache, RotatingKVCache)):
        keys: Any = cache.keys
        values: Any = cache.values
        _, kv_heads, _, head_dim = keys.shape
        if values.shape[3] != head_dim:
            raise ModelError(f"layer {index}: keys and values of different head dims "
                             f"({head_dim}, {values.shape[3]}) are not supported")
        if isinstance(cache, RotatingKVCache):
            return geo.LayerSpec(index, geo.KIND_SLIDING, kv_heads, head_dim, keys.dtype,
                                 window=cache.max_size)
        return geo.LayerSpec(index, geo.KIND_FULL, kv_heads, head_dim, keys.dtype)
    raise ModelError(f"layer {index}: the model's {type(cache).__name__} is not supported "
                     "(KVCache, RotatingKVCache and ArraysCache are)")


@functools.lru_cache(maxsize=32)
def describe(choice: ModelChoice) -> tuple[geo.Geometry, int]:
    """The geometry and weight bytes of a model choice, without evaluating it (validation and
    the size check call this; the engine builds its own model)."""
    import mlx.core as mx

    mx.random.seed(0)  # the bytes do not depend on the values
    model = build(choice)
    return geometry(model, choice.name), weights_bytes(model)
