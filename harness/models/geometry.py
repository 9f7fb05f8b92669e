"""Model geometry: the shapes a KV cache must hold, and the analytic bytes they need.

A geometry is all the harness needs to know about a model: per layer, whether it is full
attention, sliding window or recurrent, its KV heads, head dim and dtype. From it follow the
synthetic K/V shapes and the analytic minimum every measurement is compared against.
"""

from __future__ import annotations

import copyreg
import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

KIND_FULL = "full"
KIND_SLIDING = "sliding"
KIND_RECURRENT = "recurrent"
KINDS = (KIND_FULL, KIND_SLIDING, KIND_RECURRENT)

DTYPE_NAMES = ("float16", "bfloat16", "float32")


def mlx_dtype(name: str) -> mx.Dtype:
    """MLX's dtype of one of `DTYPE_NAMES`. MLX is imported here, not with the module: the gate
    reads scenarios, and with them presets and geometries, where MLX may not be installed."""
    import mlx.core as mx

    if name not in DTYPE_NAMES:
        raise KeyError(name)
    _pickle_dtypes_by_name()
    found: mx.Dtype = getattr(mx, name)
    return found


def dtype_name(dtype: mx.Dtype) -> str:
    """The name in `DTYPE_NAMES` of an MLX dtype."""
    return next(name for name in DTYPE_NAMES if mlx_dtype(name) == dtype)


@functools.cache
def _pickle_dtypes_by_name() -> None:
    """MLX dtypes do not pickle (nor deep-copy); geometries cross into spawned children (a
    variant's run, the check of a user's component), so their dtypes travel by name. Registered
    with the first dtype a geometry holds, MLX being imported by then."""
    import mlx.core as mx

    copyreg.pickle(mx.Dtype, lambda d: (mlx_dtype, (dtype_name(d),)))


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache shape; `batch` is the number of sequences served together."""

    index: int
    kind: str
    kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    window: int | None = None
    state_bytes: int = 0
    batch: int = 1

    def __post_init__(self) -> None:
        _pickle_dtypes_by_name()

    def token_bytes(self) -> int:
        """Bytes one token adds to this layer for one sequence (K and V)."""
        if self.kind == KIND_RECURRENT:
            return 0
        return 2 * self.kv_heads * self.head_dim * self.dtype.size

    def minimum_bytes(self, tokens: int) -> int:
        """Bytes this layer strictly needs to hold `tokens` tokens of every sequence."""
        if self.kind == KIND_RECURRENT:
            return self.state_bytes * self.batch if tokens > 0 else 0
        held = min(tokens, self.window) if self.kind == KIND_SLIDING and self.window else tokens
        return held * self.token_bytes() * self.batch


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: tuple[LayerSpec, ...]
    vocab: int

    @property
    def batch(self) -> int:
        return self.layers[0].batch

    def minimum_bytes(self, tokens: int) -> int:
        """Analytic bytes the caches of one live request need at `tokens` tokens."""
        return sum(layer.minimum_bytes(tokens) for layer in self.layers)

    def token_bytes(self) -> int:
        """Bytes one token adds across all layers while no window is full (one sequence)."""
        return sum(layer.token_bytes() for layer in self.layers)

    def with_batch(self, batch: int) -> Geometry:
        return replace(self, layers=tuple(replace(layer, batch=batch) for layer in self.layers))


def build(
    layers: list[dict], dtype: str = "bfloat16", vocab: int = 32000, name: str = "inline"
) -> Geometry:
    """Expand groups such as `{"count": 25, "kind": "sliding", ...}` into layers, in order."""
    specs: list[LayerSpec] = []
    for group in layers:
        group = dict(group)
        count = group.pop("count", 1)
        layer_dtype = mlx_dtype(group.pop("dtype", dtype))
        for _ in range(count):
            specs.append(LayerSpec(index=len(specs), dtype=layer_dtype, **group))
    return Geometry(name=name, layers=tuple(specs), vocab=vocab)
