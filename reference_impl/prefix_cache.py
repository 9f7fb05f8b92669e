"""A prefix cache shared across requests, in the style of vllm-mlx's memory cache (seed 001).

Entries are per-layer mlx-lm caches keyed by the request's token sequence, kept in LRU order
under a byte budget. Storing trims each layer's pre-allocated buffer to its tokens and may
quantize it; fetching hands back working `KVCache`s holding the longest matching prefix.

The switches reproduce the seed's bugs and fixes:
- `trim`: `slice` keeps a view of the first `offset` slots, which keeps the whole buffer alive
  while `nbytes` reports only the view; `copy` makes a real copy so the buffer is freed; `none`
  stores the buffer, spare slots and all.
- `dedupe_before_work`: a repeated token sequence returns before trimming and quantizing, or
  (false) does that work and then discards it.
- `trim_quantized_offset` false is vllm-mlx bug #69: a match shorter than a quantized entry keeps
  the entry's full offset, so the request's new tokens go after the whole untrimmed entry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from harness.components.protocols import StoreBase, with_estimate
from harness.models.geometry import KIND_FULL, Geometry

TRIMS = ("none", "slice", "copy")
BITS = (None, 4, 8)

Entry = Sequence[KVCache | QuantizedKVCache]  # one stored cache per layer


def _trimmed(cache: KVCache, trim: str) -> KVCache:
    """A stored copy of a layer's cache; slicing and copying drop the spare slots."""
    if trim == "none":
        return cache
    assert cache.keys is not None and cache.values is not None, "a finished request holds tokens"
    n = cache.offset
    keys, values = cache.keys[..., :n, :], cache.values[..., :n, :]
    if trim == "copy":
        keys, values = mx.contiguous(keys), mx.contiguous(values)
    stored = KVCache()
    stored.keys, stored.values, stored.offset = keys, values, n
    mx.eval(stored.keys, stored.values)
    return stored


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache(StoreBase):
    """A store of whole entries, taken when a request finishes (no prefill snapshots)."""

    def __init__(
        self,
        geometry: Geometry,
        budget: int | None = None,
        trim: str = "copy",
        quantize: int | None = None,
        group_size: int = 64,
        min_quantize_tokens: int = 256,
        dedupe_before_work: bool = True,
        trim_quantized_offset: bool = True,
    ):
        if any(layer.kind != KIND_FULL for layer in geometry.layers):
            raise ValueError("prefix_cache: only full-attention layers can be cut to a prefix")
        if trim not in TRIMS:
            raise ValueError(f"prefix_cache option trim: expected one of {TRIMS}, got {trim!r}")
        if quantize not in BITS:
            raise ValueError(f"prefix_cache option quantize: expected null, 4 or 8, got {quantize!r}")
        if min_quantize_tokens < 0:
            raise ValueError(
                f"prefix_cache option min_quantize_tokens must be >= 0, got {min_quantize_tokens}"
            )
        if budget is not None and budget < 0:
            raise ValueError(f"prefix_cache option budget must be >= 0 bytes, got {budget}")
        super().__init__(geometry)
        self.budget = budget
        self.trim = trim
        self.bits = quantize
        self.group_size = group_size
        self.min_quantize_tokens = min_quantize_tokens
        self.dedupe_before_work = dedupe_before_work
        self.trim_quantized_offset = trim_quantized_offset
        self._entries: OrderedDict[tuple[int, ...], Entry] = OrderedDict()

    def _prepare(self, caches: list[KVCache]) -> Entry:
        """Trim, then quantize sequences long enough for it to pay."""
        trimmed = [_trimmed(c, self.trim) for c in caches]
        if self.bits is None or caches[0].offset < self.min_quantize_tokens:
            return trimmed
        stored = [c.to_quantized(group_size=self.group_size, bits=self.bits) for c in trimmed]
        mx.eval([c.state[:2] for c in stored])
        return stored

    def store(self, tokens: tuple[int, ...], caches: list) -> None:
        if self.dedupe_before_work and tokens in self._entries:
            self._entries.move_to_end(tokens)
            return
        entry = self._prepare(caches)
        if tokens in self._entries:  # the work is done, and thrown away
            self._entries.move_to_end(tokens)
            return
        self._entries[tokens] = entry
        while self.budget is not None and self._entries and self.nbytes > self.budget:
            self._entries.popitem(last=False)

    def fetch(self, tokens: tuple[int, ...]) -> tuple[list | None, int]:
        """Working caches for the longest common prefix with a stored entry (the most recently
        used on a tie); an entry longer than the match is cut down to it."""
        best, matched = None, 0
        for key in reversed(self._entries):
            n = _common_prefix(key, tokens)
            if n > matched:
                best, matched = key, n
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        return [self._working(c, matched) for c in self._entries[best]], matched

    def _working(self, stored: KVCache | QuantizedKVCache, matched: int) -> KVCache:
        """A working cache for `matched` tokens with no spare slots: its first update grows it.
        A quantized entry is dequantized; with bug #69 it keeps its whole length and offset."""
        assert stored.keys is not None and stored.values is not None, "a stored entry holds tokens"
        if isinstance(stored, QuantizedKVCache):
            n = matched if self.trim_quantized_offset else stored.offset

            def expand(parts: list[mx.array]) -> mx.array:
                codes, scales, biases = (x[..., :n, :] for x in parts)
                return mx.dequantize(codes, scales, biases, group_size=stored.group_size, bits=stored.bits)

            keys, values = expand(stored.keys), expand(stored.values)
        else:
            n = matched
            keys, values = stored.keys[..., :n, :], stored.values[..., :n, :]
        working = KVCache()
        working.keys, working.values, working.offset = keys, values, n
        return working

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for entry in self._entries.values() for c in entry)

    def close(self) -> None:
        self._entries.clear()


def _estimate_bytes(geometry: Geometry, workload: Any, budget: int | None = None, **options: Any) -> int:
    """For the size check: every distinct request kept as an fp16 entry, capped by the budget."""
    tokens = sum(r.prompt + r.decode for r in workload.requests or [])
    held = tokens * geometry.token_bytes() * geometry.batch
    return held if budget is None else min(held, budget)


@with_estimate(_estimate_bytes)
def prefix_cache(geometry: Geometry, **options: Any) -> PrefixCache:
    """Factory for `reference.prefix_cache`."""
    return PrefixCache(geometry, **options)
