"""Synthetic K/V: what a model's projections would feed the caches, without a model.

The engine needs fresh K/V arrays every step in the geometry's shapes and dtype, as a model's
projections would produce them, without drawing gigabytes of random numbers per run. A small
seeded pool per layer shape is drawn once; each step gathers from it into new arrays.
"""

from __future__ import annotations

import mlx.core as mx

from ..geometry import KIND_RECURRENT, LayerSpec

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
        pool = self._pool(layer)
        idx = (mx.arange(tokens) + self._cursor) % POOL_TOKENS
        self._cursor = (self._cursor + 1) % POOL_TOKENS
        return mx.take(pool, idx, axis=2), mx.take(pool, idx + POOL_TOKENS, axis=2)

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
