"""A recurrent layer's state in mlx-lm's own `ArraysCache`, advanced as batched decode advances
it (mlx-lm PR #1642, issues #1505 and #1672).

mlx-lm's hybrid models call `cache.advance(n)` after every forward of a recurrent layer, and a
cache merged by BatchGenerator (`ArraysCache.merge`) carries a `left_padding` array. mlx-lm
0.32's `advance` does `self.left_padding -= n` and never evaluates it; a layer that never reads
that metadata (a decode step needs no mask) lets the graph grow by one node a forward, each
holding `n` as a 4-byte scalar buffer. A few bytes a token, under every byte threshold, until
Metal refuses the next buffer: "[metal::malloc] Resource limit (499000) exceeded".

`lazy_advance: true` calls mlx-lm's `advance` as it is (the bug); `lazy_advance: false` keeps
the decrement as a Python int and folds it in where the metadata is read, the cache's `state`
(the fix). The state update stands in for the layer's recurrence, as the synthetic engine's
`RecurrentState` does: a new fixed-size state from the old one, every step.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from harness.models.geometry import LayerSpec


class ArraysState:
    """A recurrent layer's cache: mlx-lm's `ArraysCache` as BatchGenerator merges it (one
    sequence a row, `left_padding` zeros), advanced once a forward by the tokens it took."""

    def __init__(self, spec: LayerSpec, lazy_advance: bool = True):
        self.cache = ArraysCache.merge([ArraysCache(1) for _ in range(spec.batch)])
        self.lazy_advance = lazy_advance
        self.offset = 0
        self._pending = 0  # tokens advanced and not yet folded into left_padding (the fix)
        self._shape = (spec.batch, spec.state_bytes // 4)

    def advance(self, tokens: int) -> None:
        """What a hybrid model's recurrent layer calls after its forward."""
        if self.lazy_advance:
            self.cache.advance(tokens)
        else:
            self._pending += tokens

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        old = self.cache[0]
        state = (old if old is not None else mx.zeros(self._shape, dtype=mx.float32)) * 0.5
        self.cache[0] = state + mx.mean(keys)
        self.offset += keys.shape[2]
        self.advance(keys.shape[2])
        return self.cache[0], self.cache[0]

    @property
    def state(self) -> Any:
        """mlx-lm's state (arrays, left_padding, lengths), with the decrement folded in."""
        if self._pending and self.cache.left_padding is not None:
            self.cache.left_padding = self.cache.left_padding - self._pending
            self._pending = 0
        return self.cache.state

    @state.setter
    def state(self, v: Any) -> None:
        self.cache.state = v
        self._pending = 0

    def empty(self) -> bool:
        return self.cache.empty()

    @property
    def nbytes(self) -> int:
        """The state and the metadata arrays the cache holds (evaluated ones count)."""
        metadata = [a for a in (self.cache.left_padding, self.cache.lengths) if a is not None]
        return self.cache.nbytes + sum(a.nbytes for a in metadata)


def arrays_state(spec: LayerSpec, lazy_advance: bool = True) -> ArraysState:
    """Factory for `reference.arrays_state`."""
    return ArraysState(spec, lazy_advance)
