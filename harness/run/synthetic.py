"""Synthetic K/V: what a model's projections would feed the caches, without a model.

The engine needs fresh K/V arrays every step in the geometry's shapes and dtype, as a model's
projections would produce them, without drawing gigabytes of random numbers per run. A small
seeded pool per layer shape is drawn once; each step copies from it into new arrays: token t of
a step starting at cursor c is pool token (c + t) mod POOL_TOKENS, written as one concatenation
of slices of the pool (a gather over that repeating index is about five times slower on MLX's
CPU backend, and was most of a large prefill chunk's time).
"""

from __future__ import annotations

import mlx.core as mx

from ..models.geometry import KIND_RECURRENT, LayerSpec

POOL_TOKENS = 64


class SyntheticKV:
    """Fresh, seeded K/V arrays for any number of tokens, gathered from a small pool."""

    def __init__(self, seed: int, layers: tuple[LayerSpec, ...]):
        self._key = mx.random.key(seed)
        self._batch = layers[0].batch
        self._pools: dict[tuple, mx.array] = {}
        self._cursor = 0
        for layer in layers:  # drawn up front, so the run's baseline already holds them
            if layer.kind != KIND_RECURRENT:
                self._pool(layer)

    def _pool(self, layer: LayerSpec) -> mx.array:
        shape = (self._batch, layer.kv_heads, 2 * POOL_TOKENS, layer.head_dim)
        key = (shape, layer.dtype)
        if key not in self._pools:
            self._key, sub = mx.random.split(self._key)
            pool = mx.random.normal(shape, key=sub).astype(layer.dtype)
            mx.eval(pool)
            self._pools[key] = pool
        return self._pools[key]

    def make(self, layer: LayerSpec, tokens: int) -> tuple[mx.array, mx.array]:
        """New K and V of shape (batch, kv_heads, tokens, head_dim) for one layer."""
        if layer.kind == KIND_RECURRENT:
            x = mx.full((self._batch, 1, tokens, 1), self._cursor % 7, dtype=mx.float32)
            return x, x
        pool, start = self._pool(layer), self._cursor
        self._cursor = (self._cursor + 1) % POOL_TOKENS
        return (_repeated(pool[:, :, :POOL_TOKENS], start, tokens),
                _repeated(pool[:, :, POOL_TOKENS:], start, tokens))

    def logits(self, vocab: int) -> mx.array:
        """New float32 logits of shape (batch, vocab) for one decode step."""
        self._cursor = (self._cursor + 1) % POOL_TOKENS
        return mx.arange(vocab, dtype=mx.float32)[None] * 1e-3 + mx.full(
            (self._batch, 1), float(self._cursor), dtype=mx.float32
        )

    @staticmethod
    def input_bytes(layer: LayerSpec, tokens: int) -> int:
        """Bytes of the K and V that `make` returns for `tokens` tokens."""
        if layer.kind == KIND_RECURRENT:
            return 4 * layer.batch * tokens
        return layer.token_bytes() * layer.batch * tokens


def _repeated(pool: mx.array, start: int, tokens: int) -> mx.array:
    """Tokens start, start + 1, ... of `pool` along axis 2, wrapping around it, as one new array
    of exactly `tokens` tokens (the pieces are views: nothing else is allocated)."""
    pieces, at = [], start
    while tokens:
        count = min(POOL_TOKENS - at, tokens)
        pieces.append(pool[:, :, at:at + count])
        tokens, at = tokens - count, 0
    return mx.contiguous(pieces[0]) if len(pieces) == 1 else mx.concatenate(pieces, axis=2)
