"""Sliding-window KV caches that allocate their whole window once (seed 002).

mlx-lm's `RotatingKVCache` grows its buffer 256 slots at a time by concatenation and keeps a
prefill chunk of S tokens as a `max_size + S - 1` slot buffer until the next decode step trims
it: active memory steps up and down and every resize briefly holds two buffers. These caches
allocate `max_size` slots on the first update and only ever write into them.

Layout: the first `keep` slots hold the first `keep` tokens for good; every later token `t` goes
to slot `keep + (t - keep) % (max_size - keep)`, so the next slot to overwrite always holds the
oldest token. What `update_and_fetch` returns equals mlx-lm's output up to slot order: a prefill
chunk gets the last `max_size - 1` tokens (plus the kept ones) before it in time order, then the
chunk; a decode step gets the whole window in slot order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from harness.geometry import LayerSpec
from harness.protocols import with_estimate


class PreallocatedRotatingKVCache(_BaseCache):
    """Single-sequence sliding-window cache: one `max_size` buffer, written in place."""

    def __init__(self, max_size: int, keep: int = 0):
        if not 0 <= keep < max_size:
            raise ValueError(f"keep must be in [0, max_size), got keep={keep}, max_size={max_size}")
        self.max_size = max_size
        self.keep = keep
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset: int | mx.array = 0  # an array of per-row counts in the batch variant
        self._seen = 0  # tokens written so far, padding included

    def _slot(self, t: int) -> int:
        if t < self.keep:
            return t
        return self.keep + (t - self.keep) % (self.max_size - self.keep)

    def _runs(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(slot, token, count) runs holding tokens [start, stop): all kept or all in the ring,
        at most one ring's worth, so a run wraps at most once. No run covers the whole buffer:
        MLX makes such an update the update itself, a view that would pin the chunk's larger
        buffer, where a partial one writes in place."""
        slot, n = self._slot(start), stop - start
        head = min(n, self.max_size - slot, max(1, self.max_size - 1))
        yield slot, start, head
        if n > head:
            yield self._slot(start + head), start + head, n - head

    def _spans(self, start: int, stop: int, ring: int) -> list[tuple[int, int]]:
        """The kept tokens of [start, stop) and its last `ring` unkept ones, as token ranges."""
        kept = (start, min(self.keep, stop))
        recent = (max(start, self.keep, stop - ring), stop)
        return [(lo, hi) for lo, hi in (kept, recent) if hi > lo]

    def _write(self, keys: mx.array, values: mx.array) -> None:
        """Write a chunk in place; tokens the chunk itself pushes out of the window are skipped."""
        buffer_keys, buffer_values = self._buffers()
        start, stop = self._seen, self._seen + keys.shape[2]
        for lo, hi in self._spans(start, stop, self.max_size - self.keep):
            for slot, t, count in self._runs(lo, hi):
                src = slice(t - start, t - start + count)
                buffer_keys[..., slot : slot + count, :] = keys[..., src, :]
                buffer_values[..., slot : slot + count, :] = values[..., src, :]

    def _buffers(self) -> tuple[mx.array, mx.array]:
        """The key and value buffers, which exist from the first update on."""
        assert self.keys is not None and self.values is not None, "no update yet"
        return self.keys, self.values

    def _with_history(self, v: mx.array, new: mx.array) -> mx.array:
        """What a prefill chunk attends to: as in mlx-lm, the kept tokens and the last
        `max_size - 1 - keep` others before it, in time order, then the chunk."""
        spans = self._spans(0, self._seen, self.max_size - 1 - self.keep)
        pieces = [v[..., s : s + n, :] for lo, hi in spans for s, _, n in self._runs(lo, hi)]
        return mx.concatenate([*pieces, new], axis=2)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            B, H, _, Dk = keys.shape
            self.keys = mx.zeros((B, H, self.max_size, Dk), keys.dtype)
            self.values = mx.zeros((B, H, self.max_size, values.shape[3]), values.dtype)
        buffer_keys, buffer_values = self._buffers()
        S = keys.shape[2]
        out = (keys, values)
        if S > 1 and self._seen > 0:
            out = (self._with_history(buffer_keys, keys), self._with_history(buffer_values, values))
            # Materialise it before writing so the buffer has no other reader and the writes
            # below reuse it rather than copy it.
            mx.eval(out)
        self._write(keys, values)
        self._seen += S
        self.offset = self.offset + S
        if S > 1:
            # The caller evaluates only what is returned, which need not read the buffer.
            mx.eval(buffer_keys, buffer_values)
            return out
        held = min(self._seen, self.max_size)
        if held < self.max_size:
            return buffer_keys[..., :held, :], buffer_values[..., :held, :]
        return buffer_keys, buffer_values

    def size(self) -> int:
        return min(self._seen, self.max_size)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self) -> tuple[Any, ...]:
        """As mlx-lm's RotatingKVCache: the buffers, then the counters and the window."""
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._seen

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        self.keys, self.values, self.offset, self.keep, self.max_size, self._seen = v

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


class PreallocatedBatchRotatingKVCache(PreallocatedRotatingKVCache):
    """Batch variant: rows are left-padded as in mlx-lm's `BatchRotatingKVCache`, so `offset`
    is an array of each row's real token count; padding slots rotate out like any token."""

    def __init__(self, max_size: int, left_padding: list[int]):
        super().__init__(max_size)
        self.offset = mx.array([-pad for pad in left_padding])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out = super().update_and_fetch(keys, values)
        offset = self.offset
        assert isinstance(offset, mx.array), "a batch cache counts tokens per row"
        # Evaluating the output evaluates the offsets too, so no lazy chain of them builds up.
        return tuple(mx.depends(list(out), [offset]))


def _window(spec: LayerSpec, max_size: int | None) -> int:
    size = max_size or spec.window
    if size is None:
        raise ValueError(f"layer {spec.index} has no window: give the option max_size")
    return size


def _estimate_bytes(spec: LayerSpec, tokens: int, max_size: int | None = None, **options: Any) -> int:
    """For the size check: the whole window is allocated on the first update, whatever `tokens`."""
    return _window(spec, max_size) * spec.token_bytes() * spec.batch


@with_estimate(_estimate_bytes)
def rotating(spec: LayerSpec, max_size: int | None = None, keep: int = 0) -> PreallocatedRotatingKVCache:
    """Factory for `reference.rotating`: `max_size` defaults to the layer's window."""
    return PreallocatedRotatingKVCache(_window(spec, max_size), keep)


@with_estimate(_estimate_bytes)
def batch_rotating(
    spec: LayerSpec, max_size: int | None = None, left_padding: list[int] | None = None
) -> PreallocatedBatchRotatingKVCache:
    """Factory for `reference.batch_rotating`: rows unpadded unless `left_padding` says."""
    return PreallocatedBatchRotatingKVCache(_window(spec, max_size), left_padding or [0] * spec.batch)

