"""TurboQuant cache: packing is exact, the error is bounded, bytes are the packed bytes,
dequantizing on restore costs exactly 16/b times the codes, and what `update_and_fetch` returns
is what an unmodified mlx-lm model attends over."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from reference_impl.turboquant import BITS, TurboQuantKVCache, dequantize, pack, quantize, rotate, unpack
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


def test_updates_return_every_token_as_attention_reads_it():
    """Pending tokens as given; once decoding starts, every earlier token dequantized from its
    codes; then a new chunk as given after them. The input dtype throughout."""
    cache = TurboQuantKVCache(D, bits=4)
    first, token, chunk = kv(20), kv(1, seed=2), kv(6, seed=4)
    keys, values = cache.update_and_fetch(*first)
    assert mx.array_equal(keys, first[0]) and mx.array_equal(values, first[1])

    def rounded(x: mx.array) -> mx.array:
        return dequantize(*quantize(x, 4), 4, D)

    seen = [mx.concatenate([a, b], axis=2) for a, b in zip(first, token, strict=True)]
    keys, values = cache.update_and_fetch(*token)
    assert keys.dtype == mx.float16 and keys.shape == (B, H, 21, D)
    assert mx.array_equal(keys, rounded(seen[0])) and mx.array_equal(values, rounded(seen[1]))
    keys, values = cache.update_and_fetch(*chunk)
    assert mx.array_equal(keys, mx.concatenate([rounded(seen[0]), chunk[0]], axis=2))
    assert mx.array_equal(values, mx.concatenate([rounded(seen[1]), chunk[1]], axis=2))


def test_the_width_is_not_called_bits():
    """mlx-lm's attention treats a cache with a `bits` attribute as its own affine-quantized
    one (`mx.quantized_matmul` with its `group_size`), which TurboQuant's codes are not."""
    cache = TurboQuantKVCache(D, bits=3)
    assert cache.code_bits == 3 and not hasattr(cache, "bits")


def test_rejects_unknown_settings():
    with pytest.raises(ValueError, match="bits"):
        TurboQuantKVCache(D, bits=5)
    with pytest.raises(ValueError, match="on_restore"):
        TurboQuantKVCache(D, on_restore="lazy")
    with pytest.raises(ValueError, match="power of two"):
        TurboQuantKVCache(96)
