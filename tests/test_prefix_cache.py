"""Prefix cache store: what each trim / quantize switch costs in exact active bytes, at a small
geometry (2 layers, H=2, D=64, float16: 512 bytes per token per layer, K and V)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from harness.models.geometry import build
from harness.scenario import WorkloadSpec
from reference_impl.prefix_cache import PrefixCache, prefix_cache
from tests.conftest import active

LAYERS, H, D = 2, 2, 64
TOKEN_BYTES = 2 * H * D * 2                     # per layer
Q8_BYTES = 2 * H * (D * 8 // 8 + 2 * 2 * D // 64)  # packed values + fp16 scale and bias per 64
Q4_BYTES = 2 * H * (D * 4 // 8 + 2 * 2 * D // 64)
GEOMETRY = build([{"count": LAYERS, "kind": "full", "kv_heads": H, "head_dim": D}], dtype="float16")


def request_caches(n: int, seed: int = 0) -> list[KVCache]:
    """Per-layer mlx-lm caches after a prefill of `n` tokens (capacity rounded up to 256)."""
    caches = []
    for layer in range(LAYERS):
        k = mx.random.normal((1, H, n, D), key=mx.random.key(seed * 10 + layer)).astype(mx.float16)
        cache = KVCache()
        cache.update_and_fetch(k, -k)
        mx.eval(cache.keys, cache.values)
        caches.append(cache)
    return caches


def tokens(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def stored_bytes(n: int, **options) -> tuple[int, int]:
    """(active bytes, nbytes) a store holds for one `n`-token request once the request is gone."""
    mx.clear_cache()
    base = active()
    store = PrefixCache(GEOMETRY, **options)
    caches = request_caches(n)
    store.store(tokens(n), caches)
    del caches
    return active() - base, store.nbytes


def test_slice_trim_keeps_the_whole_buffer_alive():
    held, reported = stored_bytes(300, trim="slice")
    assert reported == LAYERS * 300 * TOKEN_BYTES == 307200
    assert held == LAYERS * 512 * TOKEN_BYTES == 524288  # the 512-slot buffer, not the slice


def test_copy_trim_frees_the_buffer():
    held, reported = stored_bytes(300, trim="copy")
    assert held == reported == LAYERS * 300 * TOKEN_BYTES == 307200


def test_no_trim_stores_the_spare_slots_and_says_so():
    held, reported = stored_bytes(300, trim="none")
    assert held == reported == LAYERS * 512 * TOKEN_BYTES


@pytest.mark.parametrize("bits,per_token,ratio", [(8, Q8_BYTES, 1.88), (4, Q4_BYTES, 3.56)])
def test_quantized_entries_cost_the_packed_bytes(bits, per_token, ratio):
    held, reported = stored_bytes(300, quantize=bits)
    assert held == reported == LAYERS * 300 * per_token  # 163200 (8-bit), 86400 (4-bit)
    assert TOKEN_BYTES / per_token == pytest.approx(ratio, abs=0.005)


def test_short_sequences_stay_unquantized_below_the_threshold():
    held, _ = stored_bytes(255, quantize=8)
    assert held == LAYERS * 255 * TOKEN_BYTES
    held, _ = stored_bytes(256, quantize=8)
    assert held == LAYERS * 256 * Q8_BYTES
    held, _ = stored_bytes(10, quantize=8, min_quantize_tokens=0)
    assert held == LAYERS * 10 * Q8_BYTES


def test_bad_options_are_rejected_by_name():
    with pytest.raises(ValueError, match="min_quantize_tokens"):
        prefix_cache(GEOMETRY, quantize=8, min_quantize_tokens=-1)
    with pytest.raises(ValueError, match="trim"):
        prefix_cache(GEOMETRY, trim="view")
    with pytest.raises(ValueError, match="quantize"):
        prefix_cache(GEOMETRY, quantize=2)
    sliding = build([{"count": 1, "kind": "sliding", "kv_heads": H, "head_dim": D, "window": 64}])
    with pytest.raises(ValueError, match="full-attention"):
        prefix_cache(sliding)


def test_lru_budget_evicts_the_least_recently_used():
    entry = LAYERS * 300 * TOKEN_BYTES
    store = PrefixCache(GEOMETRY, budget=2 * entry)
    a, b, c = tokens(300, 0), tokens(300, 1000), tokens(300, 2000)
    store.store(a, request_caches(300))
    store.store(b, request_caches(300))
    assert store.fetch(a)[1] == 300  # a is now the most recently used
    store.store(c, request_caches(300))
    assert store.nbytes == 2 * entry
    assert store.fetch(b) == (None, 0)
    assert store.fetch(a)[1] == 300 and store.fetch(c)[1] == 300
    store.store(tokens(700, 5000), request_caches(700))  # alone over budget: kept by no one
    assert store.nbytes <= 2 * entry


def test_fetch_finds_the_longest_prefix_and_cuts_longer_entries():
    store = PrefixCache(GEOMETRY)
    caches = request_caches(300)
    store.store(tokens(300), caches)
    working, matched = store.fetch(tokens(300))
    assert matched == 300
    working, matched = store.fetch((*tokens(300), 7, 8, 9))  # the stored entry is a prefix
    assert matched == 300
    working, matched = store.fetch((*tokens(120), 99999))  # shorter match from a longer entry
    assert matched == 120
    for w, c in zip(working, caches, strict=True):
        assert w.offset == 120 and w.keys.shape[2] == 120  # no spare slots
        assert mx.array_equal(w.keys, c.keys[..., :120, :])
    working[0].update_and_fetch(*request_caches(1)[0].state[:2])
    assert working[0].keys.shape[2] == 120 + 256  # the first step grows it again
    assert store.fetch(tokens(50, 7000)) == (None, 0)


def test_fetch_dequantizes_into_a_working_kv_cache():
    store = PrefixCache(GEOMETRY, quantize=8)
    caches = request_caches(300)
    store.store(tokens(300), caches)
    assert isinstance(store._entries[tokens(300)][0], QuantizedKVCache)
    mx.clear_cache()
    base = active()
    mx.reset_peak_memory()
    working, _matched = store.fetch(tokens(300))
    mx.eval([w.state for w in working])
    assert type(working[0]) is KVCache and working[0].keys.dtype == mx.float16
    assert active() - base == LAYERS * 300 * TOKEN_BYTES  # a full fp16 copy next to the entry
    assert mx.allclose(working[0].keys, caches[0].keys[..., :300, :], atol=0.05)


@pytest.mark.parametrize("fixed", [True, False])
def test_bug_69_appends_after_the_untrimmed_quantized_entry(fixed):
    store = PrefixCache(GEOMETRY, quantize=8, trim_quantized_offset=fixed)
    store.store(tokens(600), request_caches(600))
    mx.clear_cache()
    base = active()
    working, matched = store.fetch(tokens(100) + tokens(50, 9000))
    assert matched == 100
    new = request_caches(50, seed=3)
    for w, c in zip(working, new, strict=True):
        mx.eval(w.update_and_fetch(c.keys[..., :50, :], c.values[..., :50, :]))
    del new, c
    held = 100 + 256 if fixed else 600 + 256  # slots after the first growth step
    assert [w.offset for w in working] == [150 if fixed else 650] * LAYERS
    assert active() - base == LAYERS * held * TOKEN_BYTES  # 364544 fixed, 876544 with #69


@pytest.mark.parametrize("dedupe", [True, False])
def test_a_repeated_sequence_skips_or_wastes_the_work(dedupe, monkeypatch):
    store = PrefixCache(GEOMETRY, quantize=8, dedupe_before_work=dedupe)
    store.store(tokens(300), request_caches(300))
    kept = store._entries[tokens(300)]
    calls = []
    real = KVCache.to_quantized
    monkeypatch.setattr(KVCache, "to_quantized", lambda self, **kw: calls.append(1) or real(self, **kw))
    caches = request_caches(300)
    mx.clear_cache()
    before = active()
    mx.reset_peak_memory()
    store.store(tokens(300), caches)
    peak = max(mx.get_peak_memory(), before) - before
    assert store._entries[tokens(300)] is kept
    if dedupe:
        assert calls == [] and peak == 0
    else:
        assert calls == [1] * LAYERS
        assert peak >= LAYERS * 300 * Q8_BYTES  # the discarded quantized copy existed


def test_the_size_check_counts_every_request_in_fp16_up_to_the_budget():
    workload = WorkloadSpec(requests=[{"prompt": 300, "decode": 20}, {"prompt": 100, "repeat": 3}])
    assert prefix_cache.estimate_bytes(GEOMETRY, workload) == 420 * LAYERS * TOKEN_BYTES
    assert prefix_cache.estimate_bytes(GEOMETRY, workload, budget=1000, trim="slice") == 1000
