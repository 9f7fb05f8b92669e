"""The fixed-size state of a recurrent layer (GatedDeltaNet-like), as the engine's stand-in cache.

Recurrent layers hold no per-token K/V: their memory does not grow with the context, but every
step computes a new state from the old one, so two states are alive for a moment.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..models.geometry import LayerSpec


class RecurrentState(_BaseCache):
    """A recurrent layer's fixed-size state (GatedDeltaNet-like), replaced by every step.

    Each update computes a new state from the old one, so a step holds two states for a moment,
    as a real recurrent layer does; the bytes held never depend on the number of tokens.
    """

    def __init__(self, spec: LayerSpec):
        self.value: mx.array | None = None
        self.offset = 0
        self._shape = (spec.batch, spec.state_bytes // 4)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.value is None:
            self.value = mx.zeros(self._shape, dtype=mx.float32)
        self.value = self.value * 0.5 + mx.mean(keys)
        self.offset += keys.shape[2]
        return self.value, self.value

    @property
    def state(self) -> tuple:
        """The state (None before the first update), the tokens seen, and its shape."""
        return (self.value, self.offset, *self._shape)

    @state.setter
    def state(self, v: tuple) -> None:
        self.value, self.offset, *shape = v
        self._shape = tuple(shape)

    def empty(self) -> bool:
        return self.value is None

    @property
    def nbytes(self) -> int:
        return 0 if self.value is None else self.value.nbytes
