"""The batch variant of the preallocated sliding-window cache (seed 002), as mlx-lm's
`BatchRotatingKVCache`: one `max_size` buffer per row, written in place, with mlx-lm's
bookkeeping for left padding and rotation (reference_impl.rotating_window explains the single
cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from harness.components.protocols import with_estimate
from harness.models.geometry import LayerSpec

from .rotating_window import PreallocatedRotatingKVCache, estimate_bytes, window_size


class PreallocatedBatchRotatingKVCache(PreallocatedRotatingKVCache):
    """Batch variant, as mlx-lm's `BatchRotatingKVCache`: rows are left-padded, `offset` holds
    each row's real token count and `left_padding` the padding slots at the front of mlx-lm's
    buffer; padding slots rotate out like any token."""

    # What `extract` makes. A subclass names its own with `single=`, which merges into it, so a
    # pair of subclasses (mlx-lm's names bound to the reference caches) stays a pair.
    single: ClassVar[type[PreallocatedRotatingKVCache]] = PreallocatedRotatingKVCache

    def __init_subclass__(cls, *, single: type[PreallocatedRotatingKVCache] | None = None,
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if single is not None:
            cls.single, single.batch = single, cls

    def __init__(self, max_size: int, left_padding: list[int]):
        super().__init__(max_size)
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-pad for pad in left_padding])
        self._offset = 0  # tokens written per row, padding included
        self.rotated = False
        self._lengths: mx.array | None = None  # where right padding starts, until `finalize`

    def _total(self) -> int:
        return self._offset

    def _set_total(self, n: int) -> None:
        self.offset = self.offset + (n - self._offset)
        self._offset = n

    def _wrapped(self) -> bool:
        return self.rotated

    def _decode(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._lengths is not None:
            raise RuntimeError("finalize() must be called before decoding")
        if self._idx > self.max_size:  # mlx-lm trims its longer buffer to the window here
            self.left_padding = self.left_padding - (self._idx - self.max_size)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self.rotated = True
        if self.rotated:
            self.left_padding = self.left_padding - 1
        out = super()._decode(keys, values)
        return self._with_counts(out)

    def _prefill(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self._keys is not None and self._offset > 0:
            if self._lengths is not None:  # the last chunk's right padding moves to the front
                moved = mx.maximum(0, self.offset - self._lengths)
                self.left_padding = self.left_padding + moved
                self.offset = self.offset - moved
            # mlx-lm puts its buffer in time order, then trims it to `max_size - 1` slots.
            trimmed = (self.max_size if self.rotated else self._idx) - self.max_size + 1
            if trimmed > 0:
                self.left_padding = self.left_padding - trimmed
        out = super()._prefill(keys, values)
        self.rotated = False
        return self._with_counts(out)

    def _store_window(self, keys: mx.array, values: mx.array) -> None:
        """As the single cache, but a row whose prompt ended in right padding holds its window
        with that padding rolled to the front, as mlx-lm's buffer holds it after `finalize`."""
        if self._lengths is None:
            super()._store_window(keys, values)
            return
        length = keys.shape[2]
        held = min(length, self.max_size)
        pad = mx.maximum(0, self.offset - self._lengths)[:, None, None, None]
        source = (mx.arange(length - held, length)[None, None, :, None] - pad) % length
        super()._store_window(
            mx.take_along_axis(keys, source, axis=2), mx.take_along_axis(values, source, axis=2))

    def _with_counts(self, out: tuple[mx.array, mx.array]) -> tuple[mx.array, mx.array]:
        """Evaluating the output evaluates the row counts too, so no lazy chain of them builds."""
        keys, values = mx.depends([*out], [self.left_padding, self.offset])
        return keys, values

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> Any:
        """As mlx-lm's: the causal window over history and chunk (or the slots, rolled to the
        write index, for one token), less each row's padding."""
        offset = min(self.max_size - 1, self._offset)
        mask = create_causal_mask(N, offset, window_size=window_size or self.max_size)
        padding = self.left_padding
        trimmed = self._idx - self.max_size + int(N > 1)
        if trimmed > 0:
            padding = padding - trimmed
        rolled = N == 1 and (self.rotated or self._idx >= self.max_size)
        if rolled:
            padding = padding - 1
        mask = mask & (mx.arange(offset + N) >= mx.expand_dims(padding, (1, 2, 3)))
        if rolled:
            mask = mx.roll(mask, (self._idx if self._idx < self.max_size else 0) + 1, -1)
        return mask

    @property
    def state(self) -> tuple[Any, ...]:
        """As mlx-lm's BatchRotatingKVCache: the held slots, with `_idx` at most the window and
        `left_padding` counted from the buffer's front (as mlx-lm holds them after its next
        trim; see the single cache's `state`)."""
        past = max(0, self._idx - self.max_size)
        padding = self.left_padding - past if past else self.left_padding
        return (self.keys, self.values, self.offset, padding, self.max_size,
                self._offset, self._idx - past, self.rotated)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        (keys, values, self.offset, self.left_padding, self.max_size,
         self._offset, self._idx, self.rotated) = v
        self.keep, self._lengths = 0, None
        self._load(keys, values)

    def prepare(self, *, left_padding: list[int] | None = None, lengths: list[int] | None = None,
                right_padding: list[int] | None = None) -> None:
        """Before a prompt: more left padding (on an empty cache), or the rows' prompt lengths
        when they are right-padded, so the padding does not push real tokens out."""
        if left_padding is not None:
            if self._keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            self.left_padding = self.left_padding + mx.array(left_padding)
            self.offset = self.offset - mx.array(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            assert lengths is not None, "right padding needs the rows' lengths"
            self._lengths = mx.array(lengths) + self.offset

    def finalize(self) -> None:
        """After a right-padded prompt: its padding counts as left padding from now on (the
        slots already hold it at the front, see `_store_window`)."""
        if self._lengths is not None:
            moved = mx.maximum(0, self.offset - self._lengths)
            self.left_padding = self.left_padding + moved
            self.offset = self.offset - moved
            self._lengths = None

    def is_trimmable(self) -> bool:
        return self._offset < self.max_size

    def filter(self, batch_indices: Any) -> None:
        """Keep only the rows `batch_indices`, in place."""
        if self._keys is not None and self._values is not None:
            self._keys, self._values = self._keys[batch_indices], self._values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]

    def extend(self, other: PreallocatedBatchRotatingKVCache) -> None:
        """Append `other`'s rows, in place. Where the two are laid out differently both windows
        are put in time order and aligned on their newest token, as mlx-lm does."""
        if self._keys is None and other._keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        if self._keys is not None and (self.rotated, self._idx) == (other.rotated, other._idx):
            (keys, values), padding = zip(self._buffers(), other._buffers(), strict=True), [0, 0]
        else:
            # mlx-lm's buffer length, in time order; a rotated one holds exactly the window.
            ends = [self.max_size if c.rotated else c._idx for c in (self, other)]
            newest = max(ends)
            like = self if self._keys is not None else other
            parts = [c._aligned(min(newest, self.max_size), c.offset.shape[0], like)
                     for c in (self, other)]
            keys, values = zip(*parts, strict=True)
            padding = [newest - end for end in ends]
            self._idx, self.rotated = newest, False
        self._fill(mx.concatenate(list(keys)), mx.concatenate(list(values)))
        self.left_padding = mx.concatenate(
            [c.left_padding + pad for c, pad in zip((self, other), padding, strict=True)])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._offset = max(self._offset, other._offset)

    def extract(self, idx: int) -> PreallocatedRotatingKVCache:
        """Row `idx` as a single-sequence cache holding its real tokens (none for a row whose
        padding covers the buffer, as a row added to a batch after a longer one can)."""
        mx.eval(self.left_padding, self.offset)
        cache = self.single(self.max_size)
        cache.offset = int(self.offset[idx])
        if self._keys is None:
            return cache
        end = self.max_size if self.rotated else self._idx  # mlx-lm's buffer, in time order
        held = max(0, end - max(0, int(self.left_padding[idx])))
        keys, values = self._aligned(min(held, self.max_size), 1, self)
        cache._fill(keys[idx : idx + 1], values[idx : idx + 1])
        cache._idx = held
        return cache

    @classmethod
    def merge(cls, caches: Sequence[PreallocatedRotatingKVCache]) -> PreallocatedBatchRotatingKVCache:
        """One batch cache of single-sequence ones (same window), left-padded to the longest."""
        if any(c.max_size != caches[0].max_size for c in caches):
            raise ValueError("only caches with the same max_size can be merged")
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        cache = cls(caches[0].max_size, [longest - n for n in lengths])
        if longest == 0:
            return cache
        like = next(c for c in caches if c._keys is not None)
        keys, values = zip(*(c._aligned(longest, 1, like) for c in caches), strict=True)
        cache._fill(mx.concatenate(list(keys)), mx.concatenate(list(values)))
        cache.offset = mx.array([c.offset for c in caches])
        cache._idx = cache._offset = longest
        return cache


PreallocatedRotatingKVCache.batch = PreallocatedBatchRotatingKVCache


@with_estimate(estimate_bytes)
def batch_rotating(
    spec: LayerSpec, max_size: int | None = None, left_padding: list[int] | None = None
) -> PreallocatedBatchRotatingKVCache:
    """Factory for `reference.batch_rotating`: rows unpadded unless `left_padding` says."""
    return PreallocatedBatchRotatingKVCache(window_size(spec, max_size), left_padding or [0] * spec.batch)
