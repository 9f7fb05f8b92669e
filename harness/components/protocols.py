"""What the engine calls on a scenario's components, as `typing.Protocol`s.

A scenario names a layer cache factory per layer kind, optionally a store shared across requests
and, for chats, a session (README, "Scenario format"). Anything with the members below works:
nothing has to be inherited. `StoreBase` and `SessionBase` give a store or a session no-op
defaults, so it writes only what it does.

Two sizes, sampled after every step:
- `nbytes`: every byte of MLX memory the component keeps alive. The `retained` detector compares
  the sum over all components with what MLX's allocator holds, so what a component keeps and
  does not report (a slice that pins its whole buffer) is exactly what it finds.
- `host_bytes`: bytes the component holds outside MLX (Python `bytes`, NumPy arrays, queued
  writes), which only the process RSS sees.

Size check: before a variant runs, `harness.pipeline.isolation.estimate_bytes` adds what each factory
declares through an optional `estimate_bytes` attribute (a function attribute, classmethod or
staticmethod): `estimate_bytes(layer, tokens, **options)` for a layer cache factory, the bytes
it allocates for `tokens` tokens when that is more than twice their K/V (a window allocated up
front); `estimate_bytes(geometry, workload, **options)` for a store or session, what it adds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar, cast, runtime_checkable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

if TYPE_CHECKING:
    from ..models.geometry import Geometry


@runtime_checkable
class LayerCache(Protocol):
    """One layer's cache, in mlx-lm's protocol (`mlx_lm.models.cache._BaseCache`), built as
    `factory(layer: LayerSpec, **options)`.

    mlx-lm's own classes are driven as they are, so kvmem's follow the same protocol: a store
    keeps any of them through `state` and `from_state`, and a list of them saves and loads with
    mlx-lm's `save_prompt_cache` / `load_prompt_cache` (which looks a class up by its name in
    `mlx_lm.models.cache`: one defined elsewhere loads once it is bound there too).
    """

    offset: Any  # tokens seen: an int, or a (batch,) array in mlx-lm's batch caches

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Add one step's K/V, (batch, kv_heads, tokens, head_dim), and return what attention
        reads. The engine evaluates only what is returned, all layers at once, so work the cache
        must get done (its buffer writes) should be reachable from the result (`mx.depends`):
        an `mx.eval` in here breaks `mx.compile`."""
        ...

    @property
    def nbytes(self) -> int:
        """MLX bytes the cache keeps alive, spare capacity included."""
        ...

    @property
    def state(self) -> Any:
        """Everything that rebuilds the cache, as mlx-lm (0.32) has it: a tuple (or list) of
        arrays (or nested tuples of arrays) and plain values (int, float, bool, str, None), the
        settings included, as there is no `meta_state`. `save_prompt_cache` writes it; after a
        store's hit the engine evaluates it, so a lazily rebuilt cache is materialised before
        the request's first step."""
        ...

    @state.setter
    def state(self, v: Any) -> None: ...

    def is_trimmable(self) -> bool:
        """Whether `trim` can drop the newest tokens (see `Trimmable`)."""
        ...

    @classmethod
    def from_state(cls, state: Any) -> LayerCache:
        """A cache rebuilt from `state` without `__init__`, as mlx-lm's `_BaseCache` does:
        `cls.__new__(cls)`, then `obj.state = state`."""
        ...


@runtime_checkable
class Trimmable(LayerCache, Protocol):
    """A layer cache whose `is_trimmable()` can be true."""

    def trim(self, n: int) -> int:
        """Drop the newest `n` tokens (fewer when it holds fewer); return how many it dropped."""
        ...


@runtime_checkable
class TokenRanged(LayerCache, Protocol):
    """A layer cache that can give the state of a token range by itself (see `state_range`)."""

    def state_range(self, start: int, end: int) -> Any:
        """The state of a cache that has seen `end` tokens and holds only [start, end)."""
        ...


def state_range(cache: LayerCache, start: int, end: int) -> Any:
    """The state of `cache` cut to tokens [start, end), for stores that keep a prefix in blocks.

    It is the state of a cache that has seen `end` tokens and holds only [start, end): the
    states of consecutive ranges joined by `join_ranges` are the state of the whole prefix.
    The cache's own `state_range` when it has one (`TokenRanged`); otherwise mlx-lm's layout of
    token caches, `(keys, values, offset, *rest)`, keys and values arrays (or tuples of arrays,
    as in `QuantizedKVCache`) with tokens on axis 2. Arrays may be views of the cache's own.
    """
    own = getattr(cache, "state_range", None)
    if own is not None:
        return own(start, end)
    from .mlx_lm_state import state as merged  # mlx-lm's, as its 0.32 keeps it

    state: Any = merged(cache)
    tokens = tree_flatten(state[:2]) if isinstance(state, (tuple, list)) and len(state) > 2 else []
    if not tokens or not all(isinstance(pair[1], mx.array) for pair in tokens):
        raise TypeError(
            f"{type(cache).__name__} cannot be cut by token: its state is not mlx-lm's "
            "(keys, values, offset, ...) and it has no state_range(start, end)"
        )
    keys, values, _, *rest = tuple(state)

    def cut(x: mx.array) -> mx.array:
        return x[..., start:end, :]

    return (tree_map(cut, keys), tree_map(cut, values), end, *rest)


def join_ranges(states: list[Any]) -> Any:
    """The state of consecutive `state_range` cuts as one: arrays concatenated on the token
    axis, plain values (the offset among them) from the last cut."""
    return tree_map(
        lambda *xs: mx.concatenate(list(xs), axis=2) if isinstance(xs[0], mx.array) else xs[-1],
        states[0], *states[1:],
    )


@runtime_checkable
class Store(Protocol):
    """A cache shared across requests (a prefix cache, a paged block store), built once per
    run as `factory(geometry: Geometry, **options)`.

    Per request the engine calls `fetch`, prefills the rest of the prompt in chunks (calling
    `on_prefill` after each), decodes, then calls `store`; `close` once at the end.
    """

    def fetch(self, tokens: tuple[int, ...]) -> tuple[list[LayerCache] | None, int]:
        """`(caches, matched)`: one cache per layer, in the geometry's order, holding the first
        `matched` tokens of the prompt `tokens`; `(None, 0)` on a miss.

        The request takes the caches: the engine evaluates their `state`, prefills
        `tokens[matched:]` into them and decodes into them. Writing into an `mx.array` updates
        that array object in place, so the caches, and the array objects they hold, must be
        the request's: a new array made from what the store keeps (a slice, a concatenation)
        is, the store's own object is not. While the request runs, the caches' `nbytes` count
        as the request's."""
        ...

    def store(self, tokens: tuple[int, ...], caches: list[LayerCache]) -> None:
        """A finished request: its prompt and generated `tokens` and its caches, which hold
        them all. The engine drops the caches next; what the store keeps of them (the caches,
        copies, views pinning their buffers) it counts in `nbytes`."""
        ...

    def on_prefill(self, tokens: tuple[int, ...], done: int, caches: list[LayerCache]) -> None:
        """After each prefill chunk: `tokens` are the prompt's first `done` tokens, all held by
        `caches` (a hit's tokens included). Where a store snapshots state at block boundaries."""
        ...

    @property
    def nbytes(self) -> int:
        """MLX bytes the store keeps alive (see the module's docstring)."""
        ...

    @property
    def host_bytes(self) -> int:
        """Bytes the store holds outside MLX (see the module's docstring)."""
        ...

    def close(self) -> None:
        """At the end of the run, also after a failure: stop threads, remove files."""
        ...


class _Holder:
    """What the store and session bases share: built from the geometry, holding nothing outside
    MLX unless a subclass says so, and no default for the MLX bytes it holds."""

    def __init__(self, geometry: Geometry):
        self.geometry = geometry

    @property
    def nbytes(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must implement nbytes")

    @property
    def host_bytes(self) -> int:
        return 0


class StoreBase(_Holder, Store):
    """A store that serves no hit, snapshots nothing, holds nothing outside MLX and has nothing
    to close: a subclass writes `store` and `nbytes`, and what else it does."""

    def fetch(self, tokens: tuple[int, ...]) -> tuple[list[LayerCache] | None, int]:
        return None, 0

    def store(self, tokens: tuple[int, ...], caches: list[LayerCache]) -> None:
        raise NotImplementedError("Store sub-class must implement store")

    def on_prefill(self, tokens: tuple[int, ...], done: int, caches: list[LayerCache]) -> None:
        pass

    def close(self) -> None:
        pass


@runtime_checkable
class Session(Protocol):
    """A chat's per-conversation state, built once per run as
    `factory(geometry: Geometry, **options)` for a chat workload.

    Per turn the engine calls `start_turn`, then `evict` with the turns held; it prefills the
    user's tokens and decodes the model's, handing every decode step's logits to `keep_logits`.
    """

    def start_turn(self) -> None:
        """A new turn begins: drop what only the last turn needed."""
        ...

    def evict(self, turns: list[int]) -> int:
        """How many of the oldest `turns` (token counts, oldest first) to drop. When it is more
        than 0, the engine re-prefills the turns left into fresh caches while the old caches
        are still alive, as a server does."""
        ...

    def keep_logits(self, logits: mx.array) -> None:
        """One decode step's (batch, vocab) float32 logits; what is kept counts in `nbytes`."""
        ...

    @property
    def nbytes(self) -> int:
        """MLX bytes the session keeps alive (see the module's docstring)."""
        ...

    @property
    def host_bytes(self) -> int:
        """Bytes the session holds outside MLX (see the module's docstring)."""
        ...


class SessionBase(_Holder, Session):
    """A session that never evicts, keeps no logits and holds nothing outside MLX: a subclass
    writes `nbytes`, and what else it does."""

    def start_turn(self) -> None:
        pass

    def evict(self, turns: list[int]) -> int:
        return 0

    def keep_logits(self, logits: mx.array) -> None:
        pass


_P = ParamSpec("_P")
_R = TypeVar("_R")
_R_co = TypeVar("_R_co", covariant=True)


class Estimated(Protocol[_P, _R_co]):
    """A factory function that declares its size for the size check through a function
    attribute (see the module's docstring), as `with_estimate` makes it: called as it was,
    plus `estimate_bytes`."""

    estimate_bytes: Callable[..., int]

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R_co: ...


def with_estimate(estimator: Callable[..., int]) -> Callable[[Callable[_P, _R]], Estimated[_P, _R]]:
    """Decorator giving a factory function `estimator` as its `estimate_bytes` attribute.

    The factory itself is returned (its signature, which scenarios' options are checked
    against, unchanged), typed as `Estimated`."""

    def attach(factory: Callable[_P, _R]) -> Estimated[_P, _R]:
        estimated = cast("Estimated[_P, _R]", factory)
        estimated.estimate_bytes = estimator
        return estimated

    return attach
