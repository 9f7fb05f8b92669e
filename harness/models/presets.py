"""Model presets, in one table: each name stands for a model's shapes, as layer groups the
synthetic engine feeds seeded K/V through, as an mlx-lm config the mlx_lm and server engines
build with random weights, or as both.

Shapes follow the published configs of the models named (a preset is a geometry, not a
checkpoint). Where a preset has both (`qwen3-8b`), the config takes its layers, KV heads, head
dim and vocabulary from the layer groups, so `model: qwen3-8b` means one geometry on every
engine; a real model's geometry is then read from the built model (harness.models.loading).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .geometry import KIND_FULL, KIND_RECURRENT, KIND_SLIDING, Geometry, build


@dataclass(frozen=True)
class Preset:
    """`layers`: groups such as `{"count": 5, "kind": "sliding", ...}` (the synthetic engine's
    geometry), or None; `vocab`: the vocabulary; `config`: an mlx-lm config dict, or None."""

    vocab: int
    layers: list[dict] | None = None
    config: dict | None = field(default=None, hash=False)


def _qwen3(hidden: int, heads: int, intermediate: int, tied: bool, layers: int, kv_heads: int,
           head_dim: int = 128, vocab: int = 151936) -> dict:
    return {"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": intermediate, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
            "vocab_size": vocab, "max_position_embeddings": 40960, "rope_theta": 1_000_000.0,
            "tie_word_embeddings": tied}


def _dense(count: int, kv_heads: int, head_dim: int, vocab: int,
           built_as: Callable[..., dict] | None = None) -> Preset:
    """A model of full-attention layers alone; `built_as` (a config maker given these layers,
    KV heads, head dim and vocabulary) builds it on the mlx_lm engine too, with these shapes."""
    layers = [{"count": count, "kind": KIND_FULL, "kv_heads": kv_heads, "head_dim": head_dim}]
    config = (built_as(layers=count, kv_heads=kv_heads, head_dim=head_dim, vocab=vocab)
              if built_as else None)
    return Preset(vocab, layers, config)


# Five sliding-window layers then one global layer, five times. The global layers keep K and V
# as separate arrays even though the model shares them, as mlx-lm does.
_GEMMA_4_26B = [{"count": 5, "kind": KIND_SLIDING, "kv_heads": 8, "head_dim": 256,
                 "window": 1024},
                {"count": 1, "kind": KIND_FULL, "kv_heads": 2, "head_dim": 512}] * 5
# Three GatedDeltaNet layers then one full-attention layer, twelve times. Each recurrent layer
# holds a 32x128x128 float32 state plus a bf16 convolution state of 3x8192.
_QWEN3_NEXT = [{"count": 3, "kind": KIND_RECURRENT, "kv_heads": 0, "head_dim": 0,
                "state_bytes": 32 * 128 * 128 * 4 + 3 * 8192 * 2},
               {"count": 1, "kind": KIND_FULL, "kv_heads": 2, "head_dim": 256}] * 12
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


def _config(config: dict) -> Preset:
    """A preset built from an mlx-lm config alone (its geometry is read from the built model)."""
    return Preset(int(config["vocab_size"]), config=config)


PRESETS: dict[str, Preset] = {
    "gemma-4-26b-a4b": Preset(262144, _GEMMA_4_26B),
    "qwen3-8b": _dense(36, 8, 128, 151936, functools.partial(_qwen3, 4096, 32, 12288, tied=False)),
    "llama-3.1-8b": _dense(32, 8, 128, 128256),
    "qwen3-30b-a3b": _dense(48, 4, 128, 151936),
    "qwen3-next-80b-a3b": Preset(151936, _QWEN3_NEXT),
    "qwen3-0.6b": _config(_qwen3(1024, 16, 3072, tied=True, layers=28, kv_heads=8)),
    # Five sliding-window layers (window 512) then one global layer; one KV head of 256.
    "gemma-3-1b": _config({
        "model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 26,
        "intermediate_size": 6912, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "vocab_size": 262144, "sliding_window": 512,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "max_position_embeddings": 32768,
    }),
    "qwen3.5-0.8b": _config(_QWEN3_5),
    # Serve mode's dense model (`harness.models.folder` writes it as a folder `mlx_lm.server`
    # loads): 4 layers of 8 KV heads of 128, 16 KiB of KV a token in bfloat16, so one prompt-cache
    # entry of 300 tokens is ~5 MiB; hidden 64 and vocabulary 1024 keep the rest cheap on CPU.
    # Attention is the cost: a 300-token chat request takes ~1 s on two cores (`layers: 2`:
    # ~0.4 s), since MLX's Linux wheel multiplies matrices with reference BLAS.
    "qwen3-tiny": _config(_qwen3(64, 8, 192, tied=True, layers=4, kv_heads=8, vocab=1024)),
    # A stand-in for mlx-lm's own test model (Qwen1.5-0.5B-Chat: qwen2, tied embeddings, as
    # many KV heads as query heads, heads of 64) at the scale of a unit test: 2 layers of 2 heads.
    "qwen2-tiny": _config({
        "model_type": "qwen2", "hidden_size": 128, "num_hidden_layers": 2,
        "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "vocab_size": 1024, "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
    }),
    # qwen3.5-0.8b's hybrid at serve mode's scale: three GatedDeltaNet layers (four heads of
    # 128, a 256 KiB float32 state each) then one full-attention layer of 8 KV heads of 128.
    "qwen3.5-tiny": _config({
        **_QWEN3_5, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 192,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 1024,
        "linear_num_value_heads": 4, "linear_num_key_heads": 4, "max_position_embeddings": 40960,
    }),
}


def geometric() -> list[str]:
    """The presets with layer groups: what the synthetic engine serves."""
    return [name for name, p in PRESETS.items() if p.layers is not None]


def buildable() -> list[str]:
    """The presets with an mlx-lm config: what the mlx_lm and server engines build."""
    return [name for name, p in PRESETS.items() if p.config is not None]


def layer_count(name: str) -> int:
    """How many layers a preset has (its groups', else its config's)."""
    preset = PRESETS[name]
    if preset.layers is not None:
        return sum(group.get("count", 1) for group in preset.layers)
    assert preset.config is not None
    return int(preset.config["num_hidden_layers"])


def geometry(name: str, layers: int | None = None, dtype: str = "bfloat16",
             vocab: int | None = None, window: int | None = None) -> Geometry:
    """A preset's geometry from its groups; `layers` keeps the first N layers, `window` resizes
    sliding layers."""
    preset = PRESETS[name]
    assert preset.layers is not None, f"{name} has no layer groups"
    built = build(preset.layers, dtype=dtype, vocab=vocab or preset.vocab, name=name)
    specs = built.layers[:layers] if layers else built.layers
    if window is not None:
        specs = tuple(replace(layer, window=window) if layer.kind == KIND_SLIDING else layer
                      for layer in specs)
    return replace(built, layers=tuple(specs))


def config(name: str, layers: int | None = None, vocab: int | None = None) -> dict:
    """A preset's mlx-lm config with its first `layers` layers and `vocab` tokens, where given."""
    made = PRESETS[name].config
    assert made is not None, f"{name} has no mlx-lm config"
    result = copy.deepcopy(made)
    if layers is not None:
        result["num_hidden_layers"] = layers
    if vocab is not None:
        result["vocab_size"] = vocab
    return result
