"""mlx-lm's cache state across the releases kvmem supports (0.31.3 and later).

From 0.32 a cache's whole state is one tuple, `state` (KVCache: keys, values, offset), rebuilt by
`from_state(state)`, and `keys_and_values()` gives a KVCache's tokens. Up to 0.31 the arrays,
cut to the cache's tokens, were `state`, the rest `meta_state` (strings), rebuilt by
`from_state(state, meta_state)`, and there was no `keys_and_values`. kvmem reads and writes the
0.32 form; these functions give and take it for mlx-lm's own classes on either release, from
the attributes each state is made of. Other classes (kvmem's, a user's) keep their own form, and
one that inherits `from_state` is rebuilt as 0.32 rebuilds it.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as mlx_cache

# mlx-lm before 0.32: state and meta_state apart.
SPLIT = "meta_state" in vars(mlx_cache._BaseCache)

# mlx-lm 0.32's state of each of its token caches, by the attributes it is made of.
FIELDS: dict[str, tuple[str, ...]] = {
    "KVCache": ("keys", "values", "offset"),
    "QuantizedKVCache": ("keys", "values", "offset", "group_size", "bits"),
    "RotatingKVCache": ("keys", "values", "offset", "keep", "max_size", "_idx"),
    "ChunkedKVCache": ("keys", "values", "offset", "chunk_size", "start_position"),
    "BatchKVCache": ("keys", "values", "offset", "left_padding", "_idx"),
    "BatchRotatingKVCache": ("keys", "values", "offset", "left_padding", "max_size", "_offset",
                             "_idx", "rotated"),
    "ArraysCache": ("cache", "left_padding", "lengths"),
}


_BASE_FROM_STATE = vars(mlx_cache._BaseCache)["from_state"].__func__


def _fields(cls: type) -> tuple[str, ...] | None:
    """The attributes of `cls`'s 0.32 state where this mlx-lm keeps it apart, else None."""
    if not SPLIT or getattr(mlx_cache, cls.__name__, None) is not cls:
        return None
    return FIELDS.get(cls.__name__)


def state(cache: Any) -> Any:
    """`cache.state` as mlx-lm 0.32 gives it."""
    fields = _fields(type(cache))
    return cache.state if fields is None else tuple(getattr(cache, f) for f in fields)


def from_state(cls: Any, value: Any) -> Any:
    """A cache of `cls` from a state in mlx-lm 0.32's form (`cls.from_state(value)`)."""
    fields = _fields(cls)
    inherited = getattr(cls.from_state, "__func__", None) is _BASE_FROM_STATE
    if fields is None and not (SPLIT and inherited):
        return cls.from_state(value)
    made = cls.__new__(cls)
    if fields is None:  # a class of its own, on 0.32's protocol: as 0.32's _BaseCache does
        made.state = value
        return made
    for name, part in zip(fields, value, strict=True):
        setattr(made, name, part)
    return made


def keys_and_values(cache: Any) -> tuple[Any, Any]:
    """A KVCache's keys and values cut to its tokens (its own `keys_and_values` from 0.32)."""
    own = getattr(cache, "keys_and_values", None)
    if own is not None:
        return own()
    keys, values, offset = cache.keys, cache.values, cache.offset
    if offset < keys.shape[2]:
        return keys[..., :offset, :], values[..., :offset, :]
    return keys, values
