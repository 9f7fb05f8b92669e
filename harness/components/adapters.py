"""Adapters that let mlx-lm's caches and third-party stores run as kvmem components unchanged.

mlx-lm's layer caches are built by the factories below, which only translate a layer's geometry
into their constructor arguments (`mlx_lm.KVCache` and the others in
`harness.components.REGISTRY`).

`RemainingStore` (`adapt.remaining`, built in the registry, which resolves the store it wraps)
wraps a store whose `fetch(tokens)` returns `(cache, remaining_tokens)`, as
mlx-lm's prompt caches do, instead of kvmem's `(caches, matched)`:

    store: {component: adapt.remaining, options: {store: "pkg.mod:factory", ...its options}}

The wrapped factory is built as `factory(geometry, **options)`; its `store`, `nbytes`, and
(when it has them) `on_prefill`, `host_bytes` and `close` are used as they are. The adapter
counts hits (a cache returned) and misses (None), and adds the wrapped store's own `stats`.

`mlx_lm.LRUPromptCache` is mlx-lm's server prompt cache behind the same adapter: `fetch` is its
`fetch_nearest_cache`, `store` its `insert_cache`, `nbytes` its own byte count (the sum of the
entries' `nbytes` as they were inserted; entries are not changed afterwards, as every fetch
returns a deep copy, so the count stays exact).

A store's statistics: a `stats` attribute or property giving a flat dict of numbers, read by the
engine at the end of the run and written to the summary as `store_stats`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlx_lm.models import cache as mlx_cache

from .protocols import LayerCache, StoreBase

if TYPE_CHECKING:
    from ..models.geometry import Geometry, LayerSpec


def kv_cache(spec: LayerSpec) -> mlx_cache.KVCache:
    """mlx-lm's growing cache: capacity in steps of 256 slots, by concatenation."""
    return mlx_cache.KVCache()


def rotating_kv_cache(
    spec: LayerSpec, max_size: int | None = None, keep: int = 0
) -> mlx_cache.RotatingKVCache:
    """mlx-lm's sliding-window cache; the window defaults to the layer's."""
    return mlx_cache.RotatingKVCache(max_size=max_size or spec.window, keep=keep)


def batch_rotating_kv_cache(
    spec: LayerSpec, max_size: int | None = None
) -> mlx_cache.BatchRotatingKVCache:
    """mlx-lm's batched sliding-window cache, with no left padding."""
    return mlx_cache.BatchRotatingKVCache(
        max_size=max_size or spec.window, left_padding=[0] * spec.batch
    )


def quantized_kv_cache(
    spec: LayerSpec, bits: int = 8, group_size: int = 64
) -> mlx_cache.QuantizedKVCache:
    """mlx-lm's quantized cache (keys and values packed to `bits`)."""
    return mlx_cache.QuantizedKVCache(group_size=group_size, bits=bits)


MODEL_KEY = "kvmem"  # the model every entry belongs to: one model per run


def store_stats(store: Any) -> dict[str, int | float] | None:
    """A store's `stats` as a flat dict of numbers, or None when it has none.

    Anything else (a nested value, a string) is an error naming the key, so a run never writes
    statistics the summary readers cannot trust."""
    stats = getattr(store, "stats", None)
    if stats is None:
        return None
    if not isinstance(stats, dict):
        raise TypeError(f"{type(store).__name__}.stats: expected a dict of numbers, "
                        f"got {type(stats).__name__}")
    flat: dict[str, int | float] = {}
    for key, value in stats.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{type(store).__name__}.stats[{key!r}]: expected a number, "
                            f"got {type(value).__name__}")
        flat[str(key)] = value
    return flat


class RemainingStore(StoreBase):
    """kvmem's store protocol over a store whose fetch returns `(cache, remaining_tokens)`."""

    def __init__(self, geometry: Geometry, inner: Any):
        super().__init__(geometry)
        self.inner = inner
        self.hits = 0
        self.misses = 0
        self.matched_tokens = 0  # prompt tokens served from the store, over all hits

    def fetch(self, tokens: tuple[int, ...]) -> tuple[list[LayerCache] | None, int]:
        cache, remaining = self.inner.fetch(tokens)
        if cache is None:
            self.misses += 1
            return None, 0
        left = len(remaining)
        if not 0 <= left <= len(tokens):
            raise ValueError(f"{type(self.inner).__name__}.fetch: {left} remaining tokens for "
                             f"a prompt of {len(tokens)}")
        matched = len(tokens) - left
        self.hits += 1
        self.matched_tokens += matched
        return list(cache), matched

    def store(self, tokens: tuple[int, ...], caches: list[LayerCache]) -> None:
        self.inner.store(tokens, caches)

    def on_prefill(self, tokens: tuple[int, ...], done: int, caches: list[LayerCache]) -> None:
        hook = getattr(self.inner, "on_prefill", None)
        if hook is not None:
            hook(tokens, done, caches)

    @property
    def nbytes(self) -> int:
        return int(self.inner.nbytes)

    @property
    def host_bytes(self) -> int:
        return int(getattr(self.inner, "host_bytes", 0))

    @property
    def stats(self) -> dict[str, int | float]:
        own: dict[str, int | float] = {"hits": self.hits, "misses": self.misses,
                                       "matched_tokens": self.matched_tokens}
        return {**(store_stats(self.inner) or {}), **own}

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


class LRUPromptStore:
    """mlx-lm's `LRUPromptCache` with a kvmem-shaped `fetch`/`store`; fetch returns
    `(cache, remaining_tokens)` as mlx-lm's does, for `RemainingStore`."""

    def __init__(self, max_size: int = 10, max_bytes: int | None = None):
        self.cache = mlx_cache.LRUPromptCache(
            max_size=max_size, max_bytes=(1 << 63) if max_bytes is None else max_bytes)

    def fetch(self, tokens: tuple[int, ...]) -> tuple[list[Any] | None, list[int]]:
        cache, left = self.cache.fetch_nearest_cache(MODEL_KEY, list(tokens))
        return cache, list(left)

    def store(self, tokens: tuple[int, ...], caches: list[LayerCache]) -> None:
        self.cache.insert_cache(MODEL_KEY, list(tokens), caches)

    @property
    def nbytes(self) -> int:
        return int(self.cache.nbytes)

    @property
    def stats(self) -> dict[str, int | float]:
        return {"entries": len(self.cache)}


def lru_prompt_cache(geometry: Geometry, max_size: int = 10,
                     max_bytes: int | None = None) -> RemainingStore:
    """`mlx_lm.LRUPromptCache`: at most `max_size` entries and `max_bytes` bytes (no limit when
    None), the least recently used evicted first."""
    for name, value, least in (("max_size", max_size, 0), ("max_bytes", max_bytes, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < least):
            raise ValueError(f"option {name!r}: expected a whole number >= {least}, "
                             f"got {value!r}")
    return RemainingStore(geometry, LRUPromptStore(max_size, max_bytes))
