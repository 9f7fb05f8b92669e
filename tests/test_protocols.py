"""The component protocols as code: kvmem's layer caches save and load with mlx-lm's prompt-cache
files and carry on as the originals, token ranges of a cache join back into it, and a store that
writes only `store` and `nbytes` runs through the engine."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

from harness.components.mlx_lm_state import SPLIT, from_state
from harness.components.protocols import (
    LayerCache,
    Session,
    SessionBase,
    Store,
    StoreBase,
    TokenRanged,
    Trimmable,
    join_ranges,
    state_range,
)
from harness.models.geometry import build
from harness.run.recurrent import RecurrentState
from reference_impl.chat import ChatSession
from reference_impl.paged_ssd import PagedSSDStore
from reference_impl.prefix_cache import PrefixCache
from reference_impl.rotating import PreallocatedRotatingKVCache
from reference_impl.rotating_batch import PreallocatedBatchRotatingKVCache
from reference_impl.turboquant import TurboQuantKVCache
from tests.conftest import TOKEN_BYTES, make_spec, serve

H, D = 2, 64
GEOMETRY = build([{"count": 1, "kind": "full", "kv_heads": H, "head_dim": D},
                  {"count": 1, "kind": "recurrent", "kv_heads": 0, "head_dim": 0, "state_bytes": 256}],
                 dtype="float16")
KVMEM_CACHES = (PreallocatedRotatingKVCache, PreallocatedBatchRotatingKVCache, TurboQuantKVCache,
                RecurrentState)

pytestmark = pytest.mark.usefixtures("exact_allocator")  # no cached buffers left for later tests


def kv(start: int, n: int, batch: int = 1) -> tuple[mx.array, mx.array]:
    keys = mx.random.normal((batch, H, n, D), key=mx.random.key(start)).astype(mx.float16)
    return keys, -keys


def fill(caches: list, steps: list[int], batch: int = 1) -> None:
    start = 0
    for n in steps:
        mx.eval([c.update_and_fetch(*kv(start, n, batch)) for c in caches])
        start += n


def assert_same_state(a, b) -> None:
    flat_a, flat_b = tree_flatten(a.state), tree_flatten(b.state)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and mx.array_equal(x, y), path
        else:
            assert x == y, path


def caches_of_each_kind() -> list[list]:
    """Each kvmem cache, batch 1 and 2, part way through (rotated, quantized, pending)."""
    single = [PreallocatedRotatingKVCache(48, keep=4), TurboQuantKVCache(D, bits=3, on_restore="keep"),
              RecurrentState(GEOMETRY.layers[1]), mlx_cache.KVCache()]
    fill(single, [40, 1, 1, 30, 1, 20])  # a window that wrapped; codes and pending fp16 tokens
    batch = [PreallocatedBatchRotatingKVCache(32, [0, 3])]
    fill(batch, [20, 1, 1, 25, 1], batch=2)
    return [single, batch]


@pytest.fixture
def mlx_lm_knows_kvmem(monkeypatch):
    """`load_prompt_cache` finds a class by name in mlx-lm's cache module only."""
    for cls in KVMEM_CACHES:
        monkeypatch.setattr(mlx_cache, cls.__name__, cls, raising=False)


@pytest.mark.skipif(SPLIT, reason="mlx-lm before 0.32 saves state and meta_state apart; the "
                    "reference caches follow 0.32's single state")
@pytest.mark.usefixtures("mlx_lm_knows_kvmem")
@pytest.mark.parametrize("kind", ["single", "batch"])
def test_save_and_load_prompt_cache_round_trip(tmp_path, kind):
    caches = caches_of_each_kind()[kind == "batch"]
    path = str(tmp_path / "prompt.safetensors")
    nbytes = [c.nbytes for c in caches]
    mlx_cache.save_prompt_cache(path, caches, {"who": "kvmem"})
    loaded, metadata = mlx_cache.load_prompt_cache(path, return_metadata=True)
    assert metadata == {"who": "kvmem"}
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    for original, copy in zip(caches, loaded, strict=True):
        assert isinstance(copy, LayerCache)
        assert mx.array_equal(mx.array(copy.offset), mx.array(original.offset))
        assert_same_state(copy, original)
    # TurboQuant's pending fp16 tokens come back as codes, as its state has them.
    assert [c.nbytes for c in loaded] == [
        n if not isinstance(c, TurboQuantKVCache) else sum(a.nbytes for a in c.state[:4])
        for c, n in zip(caches, nbytes, strict=True)]
    # A loaded cache carries on exactly as the original would.
    batch = 2 if kind == "batch" else 1
    for n in (1, 9, 1):
        keys, values = kv(1000 + n, n, batch)
        for original, copy in zip(caches, loaded, strict=True):
            mx.eval(original.update_and_fetch(keys, values), copy.update_and_fetch(keys, values))
            assert_same_state(copy, original)


def test_turboquant_dequantize_loads_as_its_fp16_expansion():
    cache = TurboQuantKVCache(D, bits=4, on_restore="dequantize")
    fill([cache], [100, 1])
    restored = TurboQuantKVCache.from_state(cache.state)
    assert isinstance(restored, mlx_cache.KVCache) and restored.offset == 101
    assert_same_state(restored, cache.expanded())


def test_an_empty_cache_round_trips_too():
    for cache in (PreallocatedRotatingKVCache(8), TurboQuantKVCache(D, on_restore="keep"),
                  RecurrentState(GEOMETRY.layers[1])):
        copy = from_state(type(cache), cache.state)
        assert copy.empty() and copy.nbytes == 0 and copy.offset == 0
        fill([cache, copy], [3, 1])
        assert_same_state(copy, cache)


@pytest.mark.parametrize("make", [mlx_cache.KVCache,
                                  lambda: mlx_cache.QuantizedKVCache(group_size=64, bits=8),
                                  lambda: TurboQuantKVCache(D, bits=4, on_restore="keep")])
def test_token_ranges_join_back_into_the_cache(make):
    cache = make()
    fill([cache], [70, 1, 1])  # TurboQuant: all codes; mlx-lm's: spare slots past the offset
    cuts = [state_range(cache, a, b) for a, b in ((0, 32), (32, 64), (64, 72))]
    joined = from_state(type(cache), join_ranges(cuts))
    assert joined.offset == cache.offset == 72
    whole = from_state(type(cache), state_range(cache, 0, 72))
    assert_same_state(joined, whole)
    first = from_state(type(cache), join_ranges(cuts[:2]))
    assert first.offset == 64


def test_a_cache_that_cannot_be_cut_by_token_says_so():
    with pytest.raises(TypeError, match="RecurrentState cannot be cut by token"):
        state_range(RecurrentState(GEOMETRY.layers[1]), 0, 1)


def forbidden(*args, **kwargs):
    raise AssertionError("mx.eval inside update_and_fetch")


@pytest.mark.parametrize("make,batch", [
    (lambda: TurboQuantKVCache(D), 1),
    (lambda: RecurrentState(GEOMETRY.layers[1]), 1),
    (lambda: PreallocatedRotatingKVCache(8), 1),
    (lambda: PreallocatedBatchRotatingKVCache(8, [0, 1]), 2),
])
def test_updates_leave_evaluation_to_the_caller(make, batch, monkeypatch):
    """No `mx.eval` inside `update_and_fetch`, which `mx.compile` could not trace."""
    cache = make()
    for n in [20, 1, 1, 5, 1] + [1] * 10:
        keys, values = kv(n, n, batch)
        mx.eval(keys, values)
        with monkeypatch.context() as patched:
            patched.setattr(mx, "eval", forbidden)
            out = cache.update_and_fetch(keys, values)
        mx.eval(out)


def test_components_follow_their_protocols():
    caches = [PreallocatedRotatingKVCache(8), PreallocatedBatchRotatingKVCache(8, [0]),
              TurboQuantKVCache(D), RecurrentState(GEOMETRY.layers[1])]
    for cache in caches:
        assert isinstance(cache, mlx_cache._BaseCache) and isinstance(cache, LayerCache)
    # mlx-lm's can_trim_prompt_cache asks is_trimmable: a window is trimmable until it wraps,
    # TurboQuant always, a recurrent state never.
    assert [c.is_trimmable() for c in caches] == [True, True, True, False]
    used = mlx_cache.KVCache()  # before mlx-lm 0.32 a fresh one's `state` cannot be read
    fill([used], [1])
    assert isinstance(used, Trimmable)
    assert isinstance(TurboQuantKVCache(D), TokenRanged)
    paged = PagedSSDStore(GEOMETRY)
    try:
        assert isinstance(paged, Store)
    finally:
        paged.close()
    assert isinstance(PrefixCache(build([{"count": 1, "kind": "full", "kv_heads": H,
                                          "head_dim": D}])), Store)
    assert isinstance(ChatSession(GEOMETRY), Session)


class KeepLast(StoreBase):
    """A user's store: it keeps a copy of the last request's layer 0 keys, nothing more."""

    kept: mx.array | None = None

    def store(self, tokens, caches) -> None:
        self.kept = mx.array(caches[0].keys[..., : caches[0].offset, :])
        mx.eval(self.kept)

    @property
    def nbytes(self) -> int:
        return 0 if self.kept is None else self.kept.nbytes


def test_a_store_that_writes_only_store_and_nbytes_runs_through_the_engine():
    spec = make_spec(
        cache={"store": {"component": "tests.test_protocols:KeepLast"}},
        workload={"prefill_chunk": 128, "requests": [{"prompt": 200, "decode": 10, "repeat": 3}]},
    )
    frame, findings, figures = serve(spec)
    assert findings == []
    assert {"fetch", "prefill", "decode", "store", "idle"} <= set(frame["phase"])
    keys = 210 * TOKEN_BYTES // 4 // 2  # one layer's keys of 210 tokens
    assert figures["final"] == keys == frame["logical"].iloc[-1] and frame["host"].max() == 0


def test_the_bases_ask_only_for_what_a_component_does():
    store, session = StoreBase(GEOMETRY), SessionBase(GEOMETRY)
    assert store.fetch((1,)) == (None, 0) and store.host_bytes == 0
    assert store.on_prefill((1,), 1, []) is None and store.close() is None
    assert session.evict([10, 20]) == 0 and session.host_bytes == 0
    assert session.start_turn() is None and session.keep_logits(mx.zeros((1, 4))) is None
    for missing in (lambda: store.nbytes, lambda: store.store((1,), []), lambda: session.nbytes):
        with pytest.raises(NotImplementedError):
            missing()
