"""Real mlx-lm models for the `mlx_lm` engine: config presets with random weights, or a local folder.

A preset is an mlx-lm config dict, built as `Model(ModelArgs.from_dict(config))`: every weight
is a lazy random array, so nothing is downloaded and the weights' bytes are known before they
are evaluated. The shapes follow the published configs of the models named (`-like`: a preset is
a geometry, not a checkpoint); where `harness.geometry.PRESETS` has the same model under the
same name (`qwen3-8b`), the config takes its layers, KV heads, head dim and vocabulary from that
geometry preset, so `model: qwen3-8b` means one geometry on either engine. `layers: N` keeps the
first N layers (N = num_hidden_layers), `vocab` resizes the vocabulary (a 150k-token output
layer dominates a decode step on CPU), `quantize` runs `mlx.nn.quantize` over the built model.

`model: {path: DIR}` loads a local model folder with mlx-lm's `load_model` (config.json and
safetensors): `mlx_lm.load` would also load a tokenizer, which the engine never uses (its token
ids are drawn, not encoded) and which a folder built offline may not have.

The geometry the detectors and the analytic minimum use comes from the built model itself, not
from the config: one token is run through the model lazily on fresh caches from the model's own
`make_cache`, and each cache's shapes are read without evaluating anything (MLX knows shapes
and dtypes of unevaluated arrays). KV caches give the layer's KV heads, head dim and dtype,
`RotatingKVCache` its window, `ArraysCache` (recurrent layers) its state bytes.

mlx-lm (and through it transformers) is imported where a model is built or its caches read,
never at import: the scenario schema reads the presets here, and rejecting a bad file must not
wait seconds for mlx-lm.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..common.echo import clip
from . import geometry as geo

if TYPE_CHECKING:
    import mlx.nn as nn


def _qwen3(hidden: int, heads: int, intermediate: int, tied: bool, layers: int, kv_heads: int,
           head_dim: int = 128, vocab: int = 151936) -> dict:
    return {"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
            "vocab_size": vocab, "max_position_embeddings": 40960, "rope_theta": 1_000_000.0,
            "tie_word_embeddings": tied}


def _dense(name: str) -> dict:
    """A geometry preset of full-attention layers alone, as the config's layers, KV heads, head
    dim and vocabulary: the mlx_lm preset of the same name takes them from there."""
    (group,) = geo.PRESETS[name]["layers"]
    assert group["kind"] == geo.KIND_FULL
    return {"layers": group["count"], "kv_heads": group["kv_heads"],
            "head_dim": group["head_dim"], "vocab": geo.PRESETS[name]["vocab"]}


# Qwen3.5's dense hybrid: three GatedDeltaNet layers (a fixed recurrent state each) then one
# full-attention layer, repeated.
_QWEN3_5 = {
    "model_type": "qwen3_5", "hidden_size": 1024, "num_hidden_layers": 24,
    "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 256, "vocab_size": 248320, "linear_num_value_heads": 16,
    "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
}

PRESETS: dict[str, dict] = {
    "qwen3-0.6b": _qwen3(1024, 16, 3072, tied=True, layers=28, kv_heads=8),
    "qwen3-8b": _qwen3(4096, 32, 12288, tied=False, **_dense("qwen3-8b")),
    # Five sliding-window layers (window 512) then one global layer; one KV head of 256.
    "gemma-3-1b": {
        "model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26,
        "intermediate_size": 6912, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "vocab_size": 262144, "sliding_window": 512,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "max_position_embeddings": 32768,
    },
    "qwen3.5-0.8b": _QWEN3_5,
    # Serve mode's dense model (`harness.models.folder` writes it as a folder `mlx_lm.server`
    # loads): 4 layers of 8 KV heads of 128, 16 KiB of KV a token in bfloat16, so one prompt-cache
    # entry of 300 tokens is ~5 MiB; hidden 64 and vocabulary 1024 keep the rest cheap on CPU.
    # Attention is the cost: a 300-token chat request takes ~1 s on two cores (`layers: 2`:
    # ~0.4 s), since MLX's Linux wheel multiplies matrices with reference BLAS.
    "qwen3-tiny": _qwen3(64, 8, 192, tied=True, layers=4, kv_heads=8, vocab=1024),
    # A stand-in for mlx-lm's own test model (Qwen1.5-0.5B-Chat: qwen2, tied embeddings, as
    # many KV heads as query heads, heads of 64) at the scale of a unit test: 2 layers of 2 heads.
    "qwen2-tiny": {
        "model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "vocab_size": 1024, "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
    },
    # qwen3.5-0.8b's hybrid at serve mode's scale: three GatedDeltaNet layers (four heads of
    # 128, a 256 KiB float32 state each) then one full-attention layer of 8 KV heads of 128.
    "qwen3.5-tiny": {
        **_QWEN3_5, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 192,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 1024,
        "linear_num_value_heads": 4, "linear_num_key_heads": 4, "max_position_embeddings": 40960,
    },
}


def preset_layers(name: str) -> int:
    return int(PRESETS[name]["num_hidden_layers"])


def preset_config(name: str, layers: int | None = None, vocab: int | None = None) -> dict:
    """A preset's config with its first `layers` layers and `vocab` tokens, where given."""
    config = copy.deepcopy(PRESETS[name])
    if layers is not None:
        config["num_hidden_layers"] = layers
    if vocab is not None:
        config["vocab_size"] = vocab
    return config


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


class ModelError(ValueError):
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
        config = preset_config(choice.preset, choice.layers, choice.vocab)
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        model.set_dtype(geo.DTYPES[choice.dtype])
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
    arrays: Any = tree_flatten(model.parameters())
    return sum(v.nbytes for _, v in arrays)


def make_caches(model: nn.Module) -> list[Any]:
    """The model's own caches (`make_cache`, or one KVCache per layer without one)."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def geometry(model: nn.Module, name: str) -> geo.Geometry:
    """The model's cache geometry, read lazily from one token run on fresh caches."""
    caches = make_caches(model)
    logits = model(mx.array([[0]]), cache=caches)
    layers = [_layer(index, cache) for index, cache in enumerate(caches)]
    return geo.Geometry(name=name, layers=tuple(layers), vocab=int(logits.shape[-1]))


def _layer(index: int, cache: Any) -> geo.LayerSpec:
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
    mx.random.seed(0)  # the bytes do not depend on the values
    model = build(choice)
    return geometry(model, choice.name), weights_bytes(model)
