"""Preallocated rotating caches: the same outputs as mlx-lm's, slot for slot, from one fixed
buffer, and what mlx-lm's own growing buffers cost at a small geometry (H=2, D=64, float16: 512
bytes per token)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache

from harness.models.geometry import LayerSpec
from reference_impl.rotating import PreallocatedRotatingKVCache, rotating
from reference_impl.rotating_batch import PreallocatedBatchRotatingKVCache, batch_rotating
from tests.conftest import active

H, D = 2, 64
TOKEN_BYTES = 2 * H * D * 2


def chunk(start: int, n: int, batch: int = 1) -> tuple[mx.array, mx.array]:
    """K/V for tokens [start, start + n): every key element holds its token position (exact in
    float16 below 2048), so equal outputs hold the same tokens in the same slots."""
    pos = mx.arange(start, start + n, dtype=mx.float32)[None, None, :, None]
    keys = mx.broadcast_to(pos, (batch, H, n, D)) + mx.arange(D, dtype=mx.float32) / D
    keys = keys.astype(mx.float16)
    values = -keys
    mx.eval(keys, values)
    return keys, values


def step(cache, start: int, n: int, batch: int = 1) -> tuple[int, int]:
    """Run one update as the runner does, with fresh K/V for tokens [start, start + n) dropped
    after it; return (active after, step peak above max(active before, active after))."""
    keys, values = chunk(start, n, batch)
    before = active()
    mx.reset_peak_memory()
    out = cache.update_and_fetch(keys, values)
    mx.eval(out)
    del out, keys, values
    after = active()
    return after, max(mx.get_peak_memory(), before, after) - max(before, after)


PATTERNS = {
    "prefill-then-decode-across-wrap": [40] + [1] * 100,
    "prefill-larger-than-window": [100] + [1] * 30,
    "second-chunk-after-wrap": [20] + [1] * 40 + [25] + [1] * 40 + [7, 3] + [1] * 5,
    "decode-from-empty": [1] * 80 + [5] + [1] * 10,
}


@pytest.mark.parametrize("max_size,keep", [(32, 0), (33, 4), (64, 0), (7, 1), (1, 0)])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_single_outputs_match_mlx_lm(max_size, keep, pattern):
    theirs, ours = RotatingKVCache(max_size, keep), PreallocatedRotatingKVCache(max_size, keep)
    start = 0
    for n in PATTERNS[pattern]:
        keys, values = chunk(start, n)
        a = theirs.update_and_fetch(keys, values)
        b = ours.update_and_fetch(keys, values)
        assert a[0].shape == b[0].shape
        assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1]), (start, n)
        assert ours.offset == theirs.offset == start + n
        assert ours.nbytes == max_size * TOKEN_BYTES
        start += n


@pytest.mark.parametrize("max_size", [16, 45])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_batch_outputs_match_mlx_lm_with_left_padding(max_size, pattern):
    padding = [0, 3, 11]
    theirs = BatchRotatingKVCache(max_size, padding)
    ours = PreallocatedBatchRotatingKVCache(max_size, padding)
    start = 0
    for n in PATTERNS[pattern]:
        keys, values = chunk(start, n, batch=3)
        a = theirs.update_and_fetch(keys, values)
        b = ours.update_and_fetch(keys, values)
        assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1]), (start, n)
        assert ours.offset.tolist() == theirs.offset.tolist() == [start + n - p for p in padding]
        start += n


@pytest.mark.parametrize("make,batch", [(lambda: PreallocatedRotatingKVCache(600), 1),
                                        (lambda: PreallocatedRotatingKVCache(600, keep=4), 1),
                                        (lambda: PreallocatedBatchRotatingKVCache(600, [0, 5]), 2)])
def test_one_buffer_of_max_size_from_first_update_to_1000_tokens(make, batch):
    mx.clear_cache()
    base = active()
    cache = make()
    offsets = 8 * batch if batch > 1 else 0  # the batch cache's offset and left_padding, int32
    steady = 600 * TOKEN_BYTES * batch + offsets
    after, _ = step(cache, 0, 300, batch)
    assert cache.keys.shape[2] == 300  # the slots holding tokens; all 600 are allocated
    assert after - base == steady == cache.nbytes + offsets
    start, concats = 300, []
    real = mx.concatenate
    mx.concatenate = lambda *a, **k: concats.append(1) or real(*a, **k)
    try:
        for _ in range(1000):
            after, spike = step(cache, start, 1, batch)
            start += 1
            assert after - base == steady
            assert spike < 4096  # a decode step never holds a second buffer
    finally:
        mx.concatenate = real
    assert concats == []
    assert cache.keys.shape[2] == 600 and cache.nbytes == 600 * TOKEN_BYTES * batch
    after, _ = step(cache, start, 250, batch)  # a prefill chunk past the free space
    assert after - base == steady
    after, _ = step(cache, start + 250, 850, batch)  # 600 of it on slots 0..599, pinning none
    assert after - base == steady


@pytest.mark.parametrize("batch", [1, 2])
def test_a_first_chunk_longer_than_the_window_pins_nothing_of_it(batch):
    # 1200 tokens into 600 slots: the last 600 land on slots 0..599 in one write covering the
    # whole buffer, which must be a copy: a view of them would keep all 1200 alive.
    mx.clear_cache()
    base = active()
    cache = PreallocatedRotatingKVCache(600)
    after, _ = step(cache, 0, 1200, batch)
    assert after - base == 600 * TOKEN_BYTES * batch == cache.nbytes


@pytest.mark.parametrize("batch", [1, 2])
def test_a_prefill_chunk_after_history_holds_at_most_one_window_copy_during_the_step(batch):
    # update_and_fetch evaluates nothing (it would break mx.compile), so reading the history a
    # chunk attends to and writing the window are one graph: while the read's views are alive
    # MLX copies the buffer to write it, at most once. Whether it copies, and when the read's
    # temporaries are freed, depends on when MLX's CPU worker thread releases them: alone in a
    # process it was seen to copy or to write in place; beside another test process, to hold
    # half a window more at the wrap. So the bound, not a figure: the step holds what it returns
    # (history + chunk) and at most one window more; afterwards only the window is left.
    # (Beyond these, the batch cache's int32 row counts: a few bytes.)
    mx.clear_cache()
    base = active()
    cache = (PreallocatedRotatingKVCache(600) if batch == 1
             else PreallocatedBatchRotatingKVCache(600, [0] * batch))
    steady = 600 * TOKEN_BYTES * batch
    step(cache, 0, 300, batch)
    start = 300
    for n, history in [(250, 300), (1, None), (49, 551), (2, 599), (40, 599)]:
        after, spike = step(cache, start, n, batch)
        start += n
        assert 0 <= after - base - steady < 64
        if history is not None:
            returned, copy = (history + n) * TOKEN_BYTES * batch, 600 * TOKEN_BYTES * batch
            assert 0 <= spike - returned < copy + 64, (n, spike)


def test_mlx_lm_grows_in_256_slot_steps_with_a_transient_copy():
    mx.clear_cache()
    base = active()
    cache = RotatingKVCache(600)
    sizes, spikes = [], []
    for t in range(600):
        after, spike = step(cache, t, 1)
        sizes.append(cache.keys.shape[2])
        spikes.append(spike)
        assert after - base == cache.keys.shape[2] * TOKEN_BYTES
    assert sorted(set(sizes)) == [256, 512, 600]
    assert sizes.index(512) == 256 and sizes.index(600) == 512
    # Growing by concatenation holds the old buffer next to the new one, however the
    # allocator's asynchronous frees fall.
    assert spikes[256] >= 256 * TOKEN_BYTES and spikes[512] >= 512 * TOKEN_BYTES


@pytest.mark.parametrize("batch", [1, 2])
def test_mlx_lm_chunked_prefill_leaves_max_size_plus_chunk_minus_one_slots(batch):
    mx.clear_cache()
    base = active()
    cache = RotatingKVCache(600) if batch == 1 else BatchRotatingKVCache(600, [0] * batch)
    offsets = 8 * batch if batch > 1 else 0  # offset and left_padding, int32 per row
    after, _ = step(cache, 0, 700, batch)  # first chunk is kept as given
    assert after - base == 700 * TOKEN_BYTES * batch + offsets
    after, _ = step(cache, 700, 512, batch)
    assert cache.keys.shape[2] == 600 + 512 - 1
    assert after - base == (600 + 512 - 1) * TOKEN_BYTES * batch + offsets
    after, _ = step(cache, 1212, 1, batch)  # the next decode step trims to the window
    assert after - base == 600 * TOKEN_BYTES * batch + offsets


def test_factories_default_to_the_layer_window():
    spec = LayerSpec(index=0, kind="sliding", kv_heads=H, head_dim=D, dtype=mx.float16, window=128, batch=2)
    assert rotating(spec).max_size == 128
    assert rotating(spec, max_size=64, keep=4).keep == 4
    assert batch_rotating(spec).offset.tolist() == [0, 0]
    full = LayerSpec(index=3, kind="full", kv_heads=H, head_dim=D, dtype=mx.float16)
    with pytest.raises(ValueError, match="max_size"):
        rotating(full)
