"""TurboQuant cache: packing is exact and mlx's own, the error is bounded, bytes are the packed
bytes, dequantizing on restore costs exactly 16/b times the codes, attention reads the codes in
place (what `update_and_fetch` returns, through mlx-lm's own attention) and a decode step holds
at most `step_transient` bytes beyond what stays."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from reference_impl.turboquant import (
    BITS,
    Held,
    TurboQuantKVCache,
    dequantize,
    pack,
    quantize,
    rotate,
    step_transient,
    unpack,
)
from tests.conftest import active

B, H, D = 1, 2, 64


pytestmark = pytest.mark.usefixtures("exact_allocator")


def kv(tokens: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    k = mx.random.normal((B, H, tokens, D), key=mx.random.key(seed)).astype(mx.float16)
    v = mx.random.normal((B, H, tokens, D), key=mx.random.key(seed + 1)).astype(mx.float16)
    mx.eval(k, v)
    return k, v


def code_bytes(tokens: int, bits: int) -> int:
    """Bytes of the K or V codes alone: D*b/8 per vector."""
    return B * H * tokens * D * bits // 8


def scale_bytes(tokens: int) -> int:
    return B * H * tokens * 2


@pytest.mark.parametrize("bits", BITS)
def test_pack_round_trips_and_uses_b_bits_per_code(bits):
    codes = mx.random.randint(0, 2**bits, (3, 5, D)).astype(mx.uint32)
    words = pack(codes, bits)
    assert words.dtype == mx.uint32 and words.shape == (3, 5, D * bits // 32)
    assert mx.array_equal(unpack(words, bits, D), codes)


@pytest.mark.parametrize("bits", BITS)
def test_codes_are_packed_as_mx_quantize_packs_them(bits):
    """What lets `mx.quantized_matmul` read the codes where they lie."""
    for group in (32, 64):
        words, _, _ = mx.quantize(mx.random.normal((3, 5, D)), group_size=group, bits=bits)
        assert mx.array_equal(pack(unpack(words, bits, D), bits), words)


def test_rotation_is_orthogonal():
    x = mx.random.normal((4, D))
    y = rotate(x)
    assert mx.allclose(mx.linalg.norm(y, axis=-1), mx.linalg.norm(x, axis=-1), rtol=1e-5)
    assert not mx.allclose(y, x)


@pytest.mark.parametrize("bits", BITS)
def test_dequantized_error_within_the_grid_bound(bits):
    """Per vector, ||x - x'|| <= sqrt(D) * (s / (2^b - 1) + |s - s_fp16|) plus fp16 rounding of
    the output: the grid's half step in the rotated space, which the rotation preserves."""
    x, _ = kv(300)
    words, scale = quantize(x, bits)
    restored = dequantize(words, scale, bits, D).astype(mx.float32)
    exact = mx.abs(rotate(x)).max(axis=-1)
    stored = scale.astype(mx.float32)[..., 0]
    bound = math.sqrt(D) * (exact / (2**bits - 1) + mx.abs(exact - stored))
    x32 = x.astype(mx.float32)
    error = mx.linalg.norm(restored - x32, axis=-1)
    rounding = 2**-10 * mx.linalg.norm(x32, axis=-1)
    assert mx.all(error <= bound + rounding).item()
    relative = (error / mx.linalg.norm(x32, axis=-1)).mean().item()
    assert relative < {2: 0.6, 3: 0.3, 4: 0.15, 8: 0.01}[bits]


@pytest.mark.parametrize("bits", BITS)
def test_bytes_are_the_packed_bytes(bits):
    """Prefill stays fp16 until decoding starts; then 256 slots of b-bit codes plus a 2-byte
    scale per vector, for K and V: exactly what the allocator holds."""
    cache = TurboQuantKVCache(D, bits=bits)
    base = active()
    mx.eval(cache.update_and_fetch(*kv(255)))
    assert cache.nbytes == 2 * B * H * 256 * D * 2  # fp16, held by mlx-lm's KVCache
    assert active() - base == cache.nbytes
    mx.eval(cache.update_and_fetch(*kv(1, seed=7)))
    packed = 2 * (code_bytes(256, bits) + scale_bytes(256))
    assert cache.offset == 256 and cache.nbytes == packed
    assert active() - base == packed
    assert code_bytes(256, bits) * 16 == (B * H * 256 * D * 2) * bits  # b/16 of fp16


@pytest.mark.parametrize("bits", BITS)
def test_restore_dequantize_costs_16_over_b_times_the_codes(bits):
    """`dequantize` rebuilds an fp16 KVCache: 16/b times the codes, and while it is built the
    quantized and fp16 copies coexist; `keep` rebuilds the codes alone."""
    cache = TurboQuantKVCache(D, bits=bits)
    mx.eval(cache.update_and_fetch(*kv(128)))
    mx.eval(cache.update_and_fetch(*kv(1, seed=3)))
    blocks = [cache.codes(0, 64), cache.codes(64, 128)]
    mx.eval(blocks)
    del cache
    quantized = 2 * (code_bytes(128, bits) + scale_bytes(128))
    fp16 = 2 * B * H * 128 * D * 2

    base = active()
    mx.reset_peak_memory()
    kept = TurboQuantKVCache.restore(blocks, head_dim=D, bits=bits, on_restore="keep")
    mx.eval(kept.state)
    assert isinstance(kept, TurboQuantKVCache) and kept.nbytes == quantized
    assert active() - base == quantized
    del kept

    base = active()
    mx.reset_peak_memory()
    full = TurboQuantKVCache.restore(blocks, head_dim=D, bits=bits, on_restore="dequantize")
    mx.eval(full.state)
    assert isinstance(full, KVCache) and full.offset == 128
    assert full.nbytes == fp16 and full.nbytes * bits == 2 * code_bytes(128, bits) * 16
    assert active() - base == fp16
    assert mx.get_peak_memory() - base >= quantized + fp16


def test_state_round_trips_the_codes():
    cache = TurboQuantKVCache(D, bits=3, on_restore="keep")
    mx.eval(cache.update_and_fetch(*kv(100)))
    *parts, offset = cache.state  # pending tokens quantized on the fly
    other = TurboQuantKVCache(D, bits=3, on_restore="keep")
    other.state = (*parts, offset)
    assert other.offset == 100 and other.nbytes == 2 * (code_bytes(100, 3) + scale_bytes(100))
    for a, b in zip(other.state[:4], parts[:4], strict=True):
        assert mx.array_equal(a, b)


def test_updates_return_the_codes_in_place_and_pending_tokens_as_given():
    """Before decoding starts, the prefill as given (mlx's attention reads it as an fp16
    cache's); then the codes' buffers themselves, whose first `held` slots hold every token
    quantized, and a later chunk pending as given."""
    cache = TurboQuantKVCache(D, bits=4)
    first, token, chunk = kv(20), kv(1, seed=2), kv(6, seed=4)
    keys, values = cache.update_and_fetch(*first)
    assert mx.array_equal(keys, first[0]) and mx.array_equal(values, first[1])

    seen = [mx.concatenate([a, b], axis=2) for a, b in zip(first, token, strict=True)]
    for _ in range(2):
        keys, values = cache.update_and_fetch(*token) if _ == 0 else cache.update_and_fetch(*chunk)
        assert isinstance(keys, Held) and isinstance(values, Held) and keys.held == 21
        assert cache.packed is not None and keys.codes is cache.packed[0]
        assert values.scales is cache.packed[3] and keys.codes.shape[2] == cache.step
        for held, x in ((keys, seen[0]), (values, seen[1])):
            codes, scale = quantize(x, 4)
            assert mx.array_equal(held.codes[..., :21, :], codes)
            assert mx.array_equal(held.scales[..., :21, :], scale)
    assert mx.array_equal(keys.pending, chunk[0]) and mx.array_equal(values.pending, chunk[1])


def reference(queries: mx.array, keys, values, bits: int, mask) -> mx.array:
    """Float32 attention over the keys and values a step returned, the codes dequantized."""
    if isinstance(keys, Held):
        parts = []
        for held in (keys, values):
            codes, scales = held.codes[..., : held.held, :], held.scales[..., : held.held, :]
            whole = [dequantize(codes, scales, bits, D)]
            if held.pending is not None:
                whole.append(held.pending)
            parts.append(mx.concatenate(whole, axis=2).astype(mx.float32))
        keys, values = parts
    return mx.fast.scaled_dot_product_attention(queries.astype(mx.float32), keys.astype(mx.float32),
                                                values.astype(mx.float32), scale=D**-0.5,
                                                mask=mask)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("window", [None, 5])
def test_attention_over_the_codes_is_attention_over_them_dequantized(bits, window):
    """mlx-lm's own attention, given this cache, attends over the codes in place (4 query heads
    on 2 KV heads): what float32 attention gives over the codes dequantized and the pending
    tokens, to the fp16 output's rounding. Chunks after codes, windowed (boolean) masks, the
    spare slots of the buffers, and an additive mask."""
    cache = TurboQuantKVCache(D, bits=bits)
    for i, n in enumerate([20, 1, 1, 7, 1, 3] + [1] * 240 + [4, 1]):
        k, v = kv(n, seed=10 * i)
        queries = mx.random.normal((B, 2 * H, n, D), key=mx.random.key(5000 + i)).astype(mx.float16)
        mask = cache.make_mask(n, window_size=window)
        keys, values = cache.update_and_fetch(k, v)
        out = mlx_lm_base.scaled_dot_product_attention(queries, keys, values, cache,
                                                       scale=D**-0.5, mask=mask)
        assert out.dtype == mx.float16 and out.shape == queries.shape
        expected = reference(queries, keys, values, bits, mask)
        assert mx.allclose(out.astype(mx.float32), expected, atol=2**-8, rtol=0).item(), (i, n)
    additive = mx.random.normal((1, cache.offset), key=mx.random.key(7)) * 4
    out = mlx_lm_base.scaled_dot_product_attention(queries[..., -1:, :], keys, values, cache,
                                                   scale=D**-0.5, mask=additive)
    expected = reference(queries[..., -1:, :], keys, values, bits, additive)
    assert mx.allclose(out.astype(mx.float32), expected, atol=2**-8, rtol=0).item()


def test_mlx_lm_quantized_kv_cache_attends_as_before():
    """Importing this module routes mlx-lm's quantized attention: its own QuantizedKVCache still
    gets mlx-lm's, unchanged."""
    theirs = mlx_lm_base.quantized_scaled_dot_product_attention.__wrapped__
    cache = QuantizedKVCache(group_size=32, bits=4)
    queries = mx.random.normal((B, 2 * H, 1, D), key=mx.random.key(3)).astype(mx.float16)
    keys, values = cache.update_and_fetch(*kv(9))
    # mlx-lm's scales the queries in place (`queries *= scale`): each call gets its own.
    out = mlx_lm_base.scaled_dot_product_attention(mx.array(queries), keys, values, cache,
                                                   scale=0.1, mask=None)
    expected = theirs(mx.array(queries), keys, values, 0.1, None, group_size=32, bits=4)
    assert mx.array_equal(out, expected)


@pytest.mark.parametrize("bits", BITS)
def test_a_decode_step_holds_at_most_step_transient(bits):
    """A layer's decode step through mlx-lm's attention (8 query heads on 2 KV heads of 128)
    holds at most `step_transient` bytes beyond what stays, the first one (which also quantizes
    the 1,000-token prefill) as the later ones; the bound of a later step is under a quarter of
    the layer's fp16 keys and values, which dequantizing for attention held 7-18 times over."""
    heads, kv_heads, dim, tokens = 8, 2, 128, 1000
    cache = TurboQuantKVCache(dim, bits=bits)

    def kv_of(n: int, seed: int) -> list[mx.array]:
        shape = (B, kv_heads, n, dim)
        return [mx.random.normal(shape, key=mx.random.key(seed + i)).astype(mx.float16)
                for i in (0, 1)]

    def step(seed: int) -> int:
        k, v = kv_of(1, seed)
        queries = mx.random.normal((B, heads, 1, dim), key=mx.random.key(seed + 2))
        queries = queries.astype(mx.float16)
        mx.eval(k, v, queries)
        before = active()
        mx.reset_peak_memory()
        keys, values = cache.update_and_fetch(k, v)
        out = mlx_lm_base.scaled_dot_product_attention(queries, keys, values, cache,
                                                       scale=dim**-0.5, mask=cache.make_mask(1))
        mx.eval(out)
        del keys, values, out
        return mx.get_peak_memory() - max(before, active())

    mx.eval(cache.update_and_fetch(*kv_of(tokens, 0)))  # the prefill, pending
    slots = 1024
    assert step(10) <= step_transient(slots, heads, kv_heads, dim, bits, pending=tokens)
    bound = step_transient(slots, heads, kv_heads, dim, bits)
    for i in range(3):
        assert step(20 + 10 * i) <= bound
    assert cache.packed is not None and cache.packed[0].shape[2] == slots
    assert bound < 2 * B * kv_heads * tokens * dim * 2 // 4


def test_rejects_unknown_settings():
    with pytest.raises(ValueError, match="bits"):
        TurboQuantKVCache(D, bits=5)
    with pytest.raises(ValueError, match="on_restore"):
        TurboQuantKVCache(D, on_restore="lazy")
    with pytest.raises(ValueError, match="power of two"):
        TurboQuantKVCache(96)
