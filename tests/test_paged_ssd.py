"""Paged SSD store: exact bytes of blocks and snapshots per tier and mode, and an SSD tier that
survives a full queue and writes files that reload to the same arrays.

Geometry: 2 full layers (2 heads, head_dim 64, fp16: 512 B per token), 1 sliding layer (window
64, so blocks are 64 tokens) and 1 recurrent layer (4 KiB state).
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import psutil
import pytest
from mlx_lm.models.cache import RotatingKVCache

from harness.common.units import MiB
from harness.models.geometry import build
from harness.run.recurrent import RecurrentState
from harness.scenario import WorkloadSpec
from reference_impl import paged_ssd
from reference_impl.paged_ssd import PagedSSDStore, read_block, restore_layer, state_piece
from reference_impl.rotating import rotating
from reference_impl.turboquant import TurboQuantKVCache, dequantize
from tests.conftest import active

GEOMETRY = build([
    {"count": 2, "kind": "full", "kv_heads": 2, "head_dim": 64},
    {"count": 1, "kind": "sliding", "kv_heads": 2, "head_dim": 64, "window": 64},
    {"count": 1, "kind": "recurrent", "kv_heads": 0, "head_dim": 0, "state_bytes": 4096},
], dtype="float16", vocab=1024)
BLOCK = 64
FULL_PIECE = BLOCK * 512           # one full layer's K and V for one block
SNAPSHOT = 64 * 512 + 4096          # the sliding window and the recurrent state
BLOCK_BYTES = 2 * FULL_PIECE + SNAPSHOT
CODES = 2 * BLOCK * 2 * (64 * 4 // 8 + 2)  # a full layer's block as 4-bit TurboQuant codes
TOKENS = tuple(range(300))          # 4 full blocks and 44 tokens


pytestmark = pytest.mark.usefixtures("exact_allocator")


def make_caches(geometry=GEOMETRY, full=None) -> list:
    kinds = {"full": full or (lambda layer: mx_kv()), "sliding": rotating, "recurrent": RecurrentState}
    return [kinds[layer.kind](layer) for layer in geometry.layers]


def mx_kv():
    from mlx_lm.models.cache import KVCache
    return KVCache()


def prefill(store, tokens, caches=None, start=0, chunk=32, geometry=GEOMETRY) -> list:
    """What the runner does: chunks through every layer, then `on_prefill`."""
    caches = caches or make_caches(geometry)
    for pos in range(start, len(tokens), chunk):
        done = min(pos + chunk, len(tokens))
        out = []
        for layer, cache in zip(geometry.layers, caches, strict=True):
            shape = (1, max(layer.kv_heads, 1), done - pos, max(layer.head_dim, 1))
            k = mx.full(shape, float(pos % 7), dtype=layer.dtype)
            out.append(cache.update_and_fetch(k, k))
        mx.eval(out)
        store.on_prefill(tokens[:done], done, caches)
    return caches


def serve(store, tokens) -> None:
    store.store(tokens, prefill(store, tokens))


@pytest.fixture
def stores():
    made = []

    def make(**options):
        made.append(PagedSSDStore(GEOMETRY, **options))
        return made[-1]

    yield make
    for store in made:
        store.close()


def test_block_size_follows_the_window(stores):
    assert stores().block_size == BLOCK
    plain = build([{"count": 1, "kind": "full", "kv_heads": 2, "head_dim": 64}])
    assert PagedSSDStore(plain).block_size == 256


def test_only_full_blocks_under_chained_keys(stores):
    store = stores(hot_cache_only=True)
    serve(store, TOKENS)
    assert list(store._hot) == store._chain(TOKENS, 4)
    # Same tokens from block 1 on, another first block: no key shared.
    other = (999, *TOKENS[1:])
    assert not set(store._chain(other, 4)) & set(store._hot)


def test_arrays_are_in_mlx_active(stores):
    store = stores(hot_cache_only=True, hot_storage="arrays", snapshots="off")
    base = active()
    serve(store, TOKENS)
    assert store.nbytes == 4 * BLOCK_BYTES and store.host_bytes == 0
    assert active() - base == 4 * BLOCK_BYTES


def test_raw_bytes_are_outside_mlx_and_a_hit_keeps_them(stores):
    store = stores(hot_cache_only=True, hot_storage="raw_bytes", snapshots="off")
    base = active()
    serve(store, TOKENS)
    assert store.nbytes == 0 and store.host_bytes == 4 * BLOCK_BYTES
    assert active() == base
    caches, matched = store.fetch(TOKENS)
    mx.eval([c.state for c in caches])
    assert matched == 4 * BLOCK
    # The rebuilt caches are new MLX arrays; the bytes stay as they were.
    assert active() - base == sum(c.nbytes for c in caches) == 2 * 4 * FULL_PIECE + SNAPSHOT
    assert store.host_bytes == 4 * BLOCK_BYTES


def test_raw_bytes_show_in_rss():
    """32 MiB blocks (one full layer, 8 heads x 128, 16,384-token blocks) are mapped pages of
    their own, so RSS rises by the raw bytes while MLX active does not move."""
    geometry = build([{"count": 1, "kind": "full", "kv_heads": 8, "head_dim": 128}],
                     dtype="float16")
    tokens = tuple(range(16384))
    store = PagedSSDStore(geometry, block_size=16384, hot_cache_only=True,
                          hot_storage="raw_bytes", hot_budget="1 GiB")
    try:
        caches = prefill(store, tokens, chunk=16384, geometry=geometry)
        base, rss = active(), psutil.Process().memory_info().rss
        store.store(tokens, caches)
        assert store.host_bytes == 2 * 32 * MiB
        assert active() == base
        assert psutil.Process().memory_info().rss - rss >= store.host_bytes - MiB
    finally:
        store.close()


def test_snapshot_leak_grows_one_snapshot_per_block(stores):
    store = stores(hot_cache_only=True, snapshots="leak")
    base = active()
    caches = prefill(store, TOKENS[:BLOCK])
    held = active() - base
    assert store.nbytes == SNAPSHOT
    for boundary in (2, 3, 4):  # one more block boundary: exactly one more snapshot
        prefill(store, TOKENS[: boundary * BLOCK], caches, start=(boundary - 1) * BLOCK)
        # (the full layers' KVCache already holds 256 slots: only the snapshot is new)
        assert active() - base - held == (boundary - 1) * SNAPSHOT
        assert store.nbytes == boundary * SNAPSHOT
    store.store(TOKENS[: 4 * BLOCK], caches)
    del caches
    assert active() - base == 4 * BLOCK_BYTES + 4 * SNAPSHOT
    serve(store, tuple(range(1000, 1000 + 2 * BLOCK)))  # another request, two blocks
    assert active() - base == 6 * BLOCK_BYTES + 6 * SNAPSHOT
    assert store.nbytes == 6 * BLOCK_BYTES + 6 * SNAPSHOT


def test_snapshot_release_returns_to_the_same_active(stores):
    released = stores(hot_cache_only=True, snapshots="release")
    base = active()
    caches = prefill(released, TOKENS)
    during = active() - base - sum(c.nbytes for c in caches)
    assert during == 4 * SNAPSHOT
    released.store(TOKENS, caches)
    del caches
    after = active() - base
    assert after == 4 * BLOCK_BYTES == released.nbytes
    for _ in range(3):  # repeated requests hit, prefill the tail, store nothing new
        caches, matched = released.fetch(TOKENS)
        released.store(TOKENS, prefill(released, TOKENS, caches, start=matched))
        del caches
        assert active() - base == after


def test_store_all_blocks_decides_walk_back(stores):
    shorter = TOKENS[: 2 * BLOCK + 10]
    last_only = stores(hot_cache_only=True, store_all_blocks=False, snapshots="off")
    base = active()
    serve(last_only, TOKENS)
    assert active() - base == 4 * 2 * FULL_PIECE + SNAPSHOT
    assert last_only.fetch(shorter) == (None, 0)  # blocks 1 and 2 carry no window state
    every = stores(hot_cache_only=True, store_all_blocks=True, snapshots="off")
    serve(every, TOKENS)
    caches, matched = every.fetch(shorter)
    assert matched == 2 * BLOCK and [c.offset for c in caches[:2]] == [2 * BLOCK] * 2


def turboquant(on_restore: str):
    return lambda layer: TurboQuantKVCache(layer.head_dim, bits=4, on_restore=on_restore)


@pytest.mark.parametrize("on_restore", ["keep", "dequantize"])
def test_turboquant_blocks_hold_codes_and_a_hit_restores_as_on_restore_says(stores, on_restore):
    """Blocks of a TurboQuant layer are cut from its state like any cache's and hold its codes;
    a hit rebuilds them with its `from_state`: the codes (`keep`) or fp16 (`dequantize`)."""
    store = stores(hot_cache_only=True, snapshots="off")
    caches = make_caches(full=turboquant(on_restore))
    base = active()
    store.store(TOKENS, prefill(store, TOKENS, caches))
    codes = caches[0].codes(0, 4 * BLOCK)
    mx.eval(codes)
    del caches
    assert store.nbytes == active() - base - sum(a.nbytes for a in codes)
    assert store.nbytes == 4 * (2 * CODES + SNAPSHOT)
    caches, matched = store.fetch(TOKENS)
    mx.eval([c.state for c in caches])
    assert matched == 4 * BLOCK and [c.offset for c in caches[:2]] == [4 * BLOCK] * 2
    if on_restore == "keep":
        assert [type(c) for c in caches[:2]] == [TurboQuantKVCache] * 2
        assert [c.nbytes for c in caches[:2]] == [4 * CODES] * 2
        assert all(mx.array_equal(a, b) for a, b in zip(caches[0].state[:4], codes, strict=True))
    else:
        assert [type(c).__name__ for c in caches[:2]] == ["KVCache"] * 2
        assert [c.nbytes for c in caches[:2]] == [4 * FULL_PIECE] * 2
        assert mx.array_equal(caches[0].keys, dequantize(codes[0], codes[1], 4, 64))
    # New arrays for every layer: the window and the recurrent state are copies, since the
    # request updates its caches' arrays in place and the block must stay as stored.
    assert active() - base == store.nbytes + sum(c.nbytes for c in caches) + sum(
        a.nbytes for a in codes)


def test_turboquant_blocks_read_back_from_disk_restore_the_same_codes(stores, tmp_path):
    store = stores(hot_budget=1, snapshots="off", ssd_dir=str(tmp_path))
    caches = prefill(store, TOKENS, make_caches(full=turboquant("keep")))
    store.store(TOKENS, caches)
    store.close()
    blocks = [read_block(tmp_path / f"{key}.block") for key in store._chain(TOKENS, 4)]
    restored = restore_layer([b.pieces[1] for b in blocks])
    assert type(restored) is TurboQuantKVCache and restored.offset == 4 * BLOCK
    assert restored.nbytes == 4 * CODES and (restored.bits, restored.on_restore) == (4, "keep")
    assert all(mx.array_equal(a, b) for a, b in zip(restored.state[:4], caches[1].codes(0, 256), strict=True))


def test_a_full_layer_that_cannot_be_cut_by_token_is_refused(stores):
    store = stores(hot_cache_only=True)
    caches = make_caches(full=RecurrentState)
    with pytest.raises(TypeError, match="RecurrentState cannot be cut by token"):
        store.store(TOKENS, prefill(store, TOKENS, caches))


def test_hot_budget_evicts_lru_and_hot_cache_only_writes_nothing(stores, tmp_path):
    store = stores(hot_cache_only=True, hot_budget=2 * BLOCK_BYTES + 100, snapshots="off",
                   ssd_dir=str(tmp_path))
    base = active()
    serve(store, TOKENS)
    assert list(store._hot) == store._chain(TOKENS, 4)[2:]
    assert active() - base == 2 * BLOCK_BYTES
    assert store.fetch(TOKENS) == (None, 0)  # the chain starts with an evicted block
    store.close()
    assert list(tmp_path.iterdir()) == []  # two blocks evicted, none written


def test_evicted_blocks_reload_to_identical_arrays(stores, tmp_path):
    store = stores(hot_budget=BLOCK_BYTES, snapshots="off", ssd_dir=str(tmp_path))
    caches = prefill(store, TOKENS)
    keys = store._chain(TOKENS, 4)
    expected = [(caches[0].keys[..., i * BLOCK:(i + 1) * BLOCK, :]) for i in range(4)]
    store.store(TOKENS, caches)
    caches, matched = store.fetch(TOKENS)  # blocks 0-2 from disk, block 3 from the hot tier
    assert matched == 4 * BLOCK
    assert mx.array_equal(caches[0].keys, mx.concatenate(expected, axis=2))
    # Blocks 0-1 only: the window and recurrent state come back from block 1's file. With no
    # snapshots that state is the live one at store time (offset 300), as omlx stores it.
    caches, matched = store.fetch(TOKENS[: 2 * BLOCK + 10])
    assert matched == 2 * BLOCK
    assert [type(c).__name__ for c in caches[2:]] == ["PreallocatedRotatingKVCache", "RecurrentState"]
    assert sum(c.nbytes for c in caches[2:]) == SNAPSHOT and caches[3].offset == 300
    store.close()
    files = sorted(p.stem for p in tmp_path.glob("*.block"))
    assert files == sorted(keys[:3])
    for i, key in enumerate(keys[:3]):
        block = read_block(tmp_path / f"{key}.block")
        assert mx.array_equal(block.pieces[0].live()[0], expected[i])
        assert block.nbytes == BLOCK_BYTES
    assert not list(tmp_path.glob("*.tmp"))


def test_full_queue_loses_nothing_and_does_not_deadlock(stores, tmp_path, monkeypatch):
    """A writer far slower than the producer: store() waits at the full queue, every evicted
    block reaches disk, and close() drains it in bounded time."""
    store = stores(hot_budget=BLOCK_BYTES, queue_size=2, snapshots="off", ssd_dir=str(tmp_path))
    depths = []
    write = paged_ssd.write_block

    def slow_write(path, block):
        time.sleep(0.05)  # meanwhile the producer refills the queue
        depths.append(store._queue.qsize())
        write(path, block)

    monkeypatch.setattr(paged_ssd, "write_block", slow_write)
    tokens = tuple(range(12 * BLOCK))
    caches = prefill(store, tokens, chunk=BLOCK)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (store.store(tokens, caches), done.set()))
    worker.start()
    worker.join(timeout=30)
    assert done.is_set(), "store() did not get past the full queue"
    assert max(depths) == 2  # the queue was full: the producer had to wait
    store.close(timeout=30)
    evicted = store._chain(tokens, 12)[:11]
    assert sorted(p.stem for p in tmp_path.glob("*.block")) == sorted(evicted)
    for i, key in enumerate(evicted):
        block = read_block(tmp_path / f"{key}.block")
        want = caches[0].keys[..., i * BLOCK:(i + 1) * BLOCK, :]
        assert mx.array_equal(block.pieces[0].live()[0], want)


def test_estimate_counts_snapshots_per_mode():
    workload = WorkloadSpec.model_validate(
        {"requests": [{"prompt": 300, "decode": 10}, {"prompt": 200, "decode": 0}]})
    leak = PagedSSDStore.estimate_bytes(GEOMETRY, workload, snapshots="leak")
    release = PagedSSDStore.estimate_bytes(GEOMETRY, workload, snapshots="release")
    off = PagedSSDStore.estimate_bytes(GEOMETRY, workload, snapshots="off")
    assert leak - off == (4 + 3) * SNAPSHOT  # every boundary of every prefill
    assert release - off == 4 * SNAPSHOT     # the longest prefill's, freed at store


def test_a_restored_state_is_the_requests_own_not_the_blocks():
    """The working cache updates its arrays in place: handing out the block's own arrays would
    let a request rewrite what the store keeps (and count the same bytes twice)."""
    cache = RotatingKVCache(max_size=8)
    cache.update_and_fetch(mx.ones((1, 1, 8, 4)), mx.ones((1, 1, 8, 4)))
    stored = state_piece(cache)
    restored = restore_layer([stored])
    kept = {id(a) for a in stored.arrays}
    assert not kept & {id(restored.keys), id(restored.values)}
