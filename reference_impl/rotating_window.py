"""The sliding-window cache that allocates its whole window once (seed 002): the single-sequence
class, which `reference_impl.rotating` gives users and the batch variant in
`reference_impl.rotating_batch` derives from, with the window both factories size.

mlx-lm's `RotatingKVCache` grows its buffer 256 slots at a time by concatenation and keeps a
prefill chunk of S tokens as a `max_size + S - 1` slot buffer until the next decode step trims
it: active memory steps up and down and every resize briefly holds two buffers. These caches
allocate `max_size` slots on the first update and only ever write into them.

They are drop-ins for mlx-lm's classes (docs/reference_caches.md): same constructor, same
`update_and_fetch` results in the same slot order, same `make_mask`, `state`, trimming and batch
protocol. To get there they keep mlx-lm's bookkeeping (`_idx`, the write index of mlx-lm's
buffer, and in the batch cache `_offset`, `left_padding` and `rotated`) and hold the slots that
mlx-lm's buffer would hold after its next trim:
- after a prefill chunk, the window in time order from slot 0: the first `keep` tokens, then the
  newest `max_size - keep` (mlx-lm holds a longer buffer there, `_idx >= max_size`, whose last
  slots these are);
- a decode step writes one slot, `_idx`, or `keep` once the buffer is full, as mlx-lm does.
A prefill chunk attends to the kept tokens and the last `max_size - 1 - keep` others in time
order, then the chunk; a decode step to the buffer in slot order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache

from harness.models.geometry import LayerSpec


def _pieces(slots: list[tuple[int, int]], v: mx.array) -> list[mx.array]:
    return [v[..., lo:hi, :] for lo, hi in slots if hi > lo]


class PreallocatedRotatingKVCache(_BaseCache):
    """Single-sequence sliding-window cache: one `max_size` buffer, written in place."""

    # What `merge` makes: the batch class whose `single` this class is, a subclass that sets
    # this when its module (reference_impl.rotating_batch) runs (see its __init_subclass__).
    batch: ClassVar[type[PreallocatedRotatingKVCache]]

    def __init__(self, max_size: int, keep: int = 0):
        if not 0 <= keep < max_size:
            raise ValueError(f"keep must be in [0, max_size), got keep={keep}, max_size={max_size}")
        self.max_size = max_size
        self.keep = keep
        self._keys: mx.array | None = None  # the buffers, `max_size` slots from the first update
        self._values: mx.array | None = None
        self.offset: Any = 0  # an int here, a (batch,) array of real tokens in the batch cache
        self._idx = 0  # mlx-lm's write index: past max_size after a prefill chunk longer than it

    # What the two classes count differently.

    def _total(self) -> int:
        """Tokens written, padding included."""
        return int(self.offset)

    def _set_total(self, n: int) -> None:
        self.offset = n

    def _wrapped(self) -> bool:
        """Whether decode steps have overwritten slots, so slot order is not time order."""
        return self._idx < self._total()

    # Layout.

    def _kept_slots(self) -> tuple[int, int]:
        """Slots of the first `keep` tokens, which are never overwritten."""
        return 0, min(self.keep, self._idx, self.max_size)

    def _ring_slots(self) -> list[tuple[int, int]]:
        """Slot ranges holding the other tokens, oldest first."""
        if self._idx >= self.max_size:
            return [(self.keep, self.max_size)]
        if self._wrapped():
            return [(self._idx, self.max_size), (self.keep, self._idx)]
        return [(self.keep, self._idx)]

    def _time_order(self, v: mx.array) -> mx.array:
        """The tokens held, oldest first (mlx-lm's `_temporal_order`, trimmed to the window)."""
        pieces = _pieces([self._kept_slots(), *self._ring_slots()], v)
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)

    def _history(self, v: mx.array) -> list[mx.array]:
        """What a prefill chunk sees before itself, as mlx-lm trims it: the kept tokens and the
        last `max_size - 1 - keep` others, oldest first."""
        room = self.max_size - 1 - self.keep
        last: list[tuple[int, int]] = []
        for lo, hi in reversed(self._ring_slots()):
            take = min(room, max(hi - lo, 0))
            room -= take
            last.insert(0, (hi - take, hi))
        return _pieces([self._kept_slots(), *last], v)

    # Writes.

    def _allocate(self, keys: mx.array, values: mx.array) -> None:
        B, H, _, Dk = keys.shape
        self._keys = mx.zeros((B, H, self.max_size, Dk), keys.dtype)
        self._values = mx.zeros((B, H, self.max_size, values.shape[3]), values.dtype)

    def _fill(self, keys: mx.array, values: mx.array) -> None:
        """New buffers holding `keys`/`values` from slot 0."""
        self._allocate(keys, values)
        self._write(0, keys, values)

    def _buffers(self) -> tuple[mx.array, mx.array]:
        """The key and value buffers, which exist from the first update on."""
        assert self._keys is not None and self._values is not None, "no update yet"
        return self._keys, self._values

    def _write(self, slot: int, keys: mx.array, values: mx.array) -> None:
        """Write tokens to consecutive slots from `slot`, in place. A write covering the whole
        buffer goes in two parts: MLX makes such an update the update itself, a view that would
        pin the (larger) array it was cut from, where a partial one writes in place."""
        buffer_keys, buffer_values = self._buffers()
        n = keys.shape[2]
        if n == 0:
            return
        parts = [(0, n - 1), (n - 1, n)] if n == self.max_size else [(0, n)]
        for lo, hi in parts:
            buffer_keys[..., slot + lo : slot + hi, :] = keys[..., lo:hi, :]
            buffer_values[..., slot + lo : slot + hi, :] = values[..., lo:hi, :]

    def _store_window(self, keys: mx.array, values: mx.array) -> None:
        """After a prefill chunk, `keys`/`values` being what it attended to, oldest first: the
        kept tokens go to slots [0, keep), the newest others from slot `keep` on."""
        length = keys.shape[2]
        kept = min(self.keep, length)
        if kept:
            self._write(0, keys[..., :kept, :], values[..., :kept, :])
        ring = min(length, self.max_size) - kept
        if ring:
            self._write(kept, keys[..., length - ring :, :], values[..., length - ring :, :])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._keys is None:
            self._allocate(keys, values)
        if keys.shape[2] == 1:
            return self._decode(keys, values)
        return self._prefill(keys, values)

    def _decode(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._idx >= self.max_size:
            self._idx = self.keep
        self._write(self._idx, keys, values)
        self._idx += 1
        self._set_total(self._total() + 1)
        return self.keys_and_values()

    def _prefill(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        buffer_keys, buffer_values = self._buffers()
        out_keys, out_values = keys, values  # the first chunk sees only itself, as in mlx-lm
        if self._total() > 0:
            out_keys = mx.concatenate([*self._history(buffer_keys), keys], axis=2)
            out_values = mx.concatenate([*self._history(buffer_values), values], axis=2)
        self._set_total(self._total() + keys.shape[2])
        self._idx = out_keys.shape[2]
        # Written from what is returned, so MLX computes that before overwriting the slots it
        # read. Read and writes being one graph, MLX copies the buffer once for the writes
        # (tests/test_rotating.py measures it); an mx.eval in between would break mx.compile.
        self._store_window(out_keys, out_values)
        return self._returned(out_keys, out_values)

    def _returned(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """What a prefill returns, made to depend on the buffer writes so that evaluating it
        does them (no `mx.eval` here: it would break `mx.compile`)."""
        out = mx.depends([keys, values], [*self._buffers()])
        return out[0], out[1]

    # mlx-lm's protocol.

    @property
    def keys(self) -> mx.array | None:
        """The key slots holding tokens, as mlx-lm's attribute: the whole buffer once the
        window is full, the first `size()` slots before (the rest is allocated, unused).
        Assignable as mlx-lm's is: models running a pipeline set `cache.keys =
        mx.depends(cache.keys, h)`."""
        return self._held(self._keys)

    @keys.setter
    def keys(self, v: mx.array | None) -> None:
        self._keys = self._assigned(self._keys, v)

    @property
    def values(self) -> mx.array | None:
        return self._held(self._values)

    @values.setter
    def values(self, v: mx.array | None) -> None:
        self._values = self._assigned(self._values, v)

    def _held(self, v: mx.array | None) -> mx.array | None:
        held = max(0, self.size())  # a row extracted with more padding than tokens has offset < 0
        return v if v is None or held >= self.max_size else v[..., :held, :]

    def _assigned(self, buffer: mx.array | None, v: mx.array | None) -> mx.array | None:
        """The buffer after `keys` or `values` is set to `v`: None or a whole buffer replaces
        it, the held slots (what the attribute reads) are written into it."""
        if v is None or v.shape[2] == self.max_size:
            return v
        held = self._held(buffer)
        if buffer is None or held is None or v.shape != held.shape:
            raise ValueError(f"expected None, {self.max_size} slots or the held slots "
                             f"{None if held is None else held.shape}, got {v.shape}")
        buffer[..., : v.shape[2], :] = v
        return buffer

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        keys, values = self.keys, self.values
        assert keys is not None and values is not None, "no update yet"
        return keys, values

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> Any:
        """As mlx-lm's: a prefill chunk's columns are its history then itself, consecutive; a
        decode step's are the slots, in which the query's window is rolled to the write index."""
        total = self._total()
        if N > 1:
            window = window_size or self.max_size
            offset = min(self.max_size - 1, total)
            if return_array or offset + N > window:
                return create_causal_mask(N, offset, window_size=window)
            return "causal"
        if window_size is None or total < window_size or self.max_size <= window_size:
            return None
        width = min(total + 1, self.max_size)
        mask = mx.arange(width) >= width - window_size
        return mx.roll(mask, (self._idx if self._idx < self.max_size else 0) + 1)

    def size(self) -> int:
        return min(self._total(), self.max_size)

    def empty(self) -> bool:
        return self._keys is None

    @property
    def step(self) -> int:
        """Slots one allocation adds: the whole window, once."""
        return self.max_size

    @property
    def state(self) -> tuple[Any, ...]:
        """As mlx-lm's RotatingKVCache: the held slots (`keys`, `values`), the offset, `keep`,
        the window and `_idx`. After a prefill chunk that is the window in time order, which
        mlx-lm reads right only with `_idx` at the window: past it, mlx-lm takes the buffer for
        its longer one and trims it again. Both classes load either's state."""
        return self.keys, self.values, self.offset, self.keep, self.max_size, min(self._idx, self.max_size)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        keys, values, self.offset, self.keep, self.max_size, self._idx = v
        self._load(keys, values)

    def _load(self, keys: mx.array | None, values: mx.array | None) -> None:
        """The buffers from a state's keys and values: a whole window as it is; fewer slots
        (mlx-lm's buffer before it is full) from slot 0; more (mlx-lm's buffer after a prefill
        chunk, in time order) kept as a prefill chunk keeps them."""
        self._keys = self._values = None
        if keys is None or values is None:
            return
        if keys.shape[2] == self.max_size:
            self._keys, self._values = keys, values
            return
        self._allocate(keys, values)
        self._store_window(keys, values)

    def is_trimmable(self) -> bool:
        return self._total() < self.max_size

    def trim(self, n: int) -> int:
        """Drop the newest `n` tokens; only meaningful before the window fills (`is_trimmable`),
        where token t sits in slot t."""
        n = min(self._total(), n)
        self._set_total(self._total() - n)
        self._idx -= n
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
        raise NotImplementedError("a rotating cache cannot be quantized (nor can mlx-lm's)")

    @classmethod
    def merge(cls, caches: Sequence[PreallocatedRotatingKVCache]) -> PreallocatedRotatingKVCache:
        return cls.batch.merge(caches)

    def _aligned(
        self, length: int, rows: int, like: PreallocatedRotatingKVCache
    ) -> tuple[mx.array, mx.array]:
        """The tokens held, oldest first, right-aligned in `length` slots (zeros in front, the
        oldest dropped); all zeros, shaped as `like`'s, for a cache with none yet."""
        if self._keys is None or self._values is None:
            keys, values = like._buffers()
            return (mx.zeros((rows, keys.shape[1], length, keys.shape[3]), keys.dtype),
                    mx.zeros((rows, values.shape[1], length, values.shape[3]), values.dtype))
        aligned = []
        for v in (self._time_order(self._keys), self._time_order(self._values)):
            v = v[..., max(v.shape[2] - length, 0) :, :]
            aligned.append(mx.pad(v, [(0, 0), (0, 0), (length - v.shape[2], 0), (0, 0)]))
        return aligned[0], aligned[1]

    @property
    def nbytes(self) -> int:
        if self._keys is None or self._values is None:
            return 0
        return self._keys.nbytes + self._values.nbytes




def window_size(spec: LayerSpec, max_size: int | None) -> int:
    size = max_size or spec.window
    if size is None:
        raise ValueError(f"layer {spec.index} has no window: give the option max_size")
    return size


def estimate_bytes(spec: LayerSpec, tokens: int, max_size: int | None = None, **options: Any) -> int:
    """For the size check: the whole window is allocated on the first update, whatever `tokens`."""
    return window_size(spec, max_size) * spec.token_bytes() * spec.batch
