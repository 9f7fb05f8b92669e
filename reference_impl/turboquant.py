"""TurboQuant-style KV cache (seed 000): rotate, then quantize every coordinate to `bits` bits.

A seeded random orthogonal rotation spreads each key/value vector's energy evenly over its
coordinates, so one absmax scale per vector and a uniform b-bit grid lose little. The rotation
is a randomized Hadamard transform (random signs, then the orthonormal Hadamard matrix), which
is orthogonal, costs O(D log D) per vector and holds no D x D matrix. Codes are packed
into uint32 words (bit planes of 32 coordinates), so a vector of D coordinates costs exactly
D*b/8 bytes plus a 2-byte scale: about b/16 of fp16.

Prefill chunks are kept in fp16 and quantized lazily when decoding starts (one token per update).
As a drop-in for mlx-lm's caches (docs/reference_caches.md), `update_and_fetch` returns what an
unmodified model attends over: every token's keys and values in the input dtype, the codes
dequantized (a transient copy, 16/b times the codes, each step) and the pending tokens as they
are. The width is kept as `code_bits`, not `bits`: mlx-lm's attention takes a cache with a `bits`
attribute for its own affine-quantized one and would hand the result to `mx.quantized_matmul`.
`on_restore` is the seed's bug switch for rebuilding a cache from its state (`from_state`, which
a store's hit and mlx-lm's `load_prompt_cache` call): `dequantize` (before) expands it into a full
fp16 `KVCache`, 16/b times the codes, and the quantized and fp16 copies coexist while it does;
`keep` (after) stays quantized.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

BITS = (2, 3, 4, 8)
ON_RESTORE = ("dequantize", "keep")
_WORD = 32


@cache
def signs(head_dim: int, seed: int = 0) -> mx.array:
    """The rotation's random signs for `head_dim`, float32, the same for a given seed."""
    drawn = np.random.default_rng([seed, head_dim]).choice([-1.0, 1.0], head_dim)
    flip = mx.array(drawn.astype(np.float32))
    mx.eval(flip)
    return flip


def rotate(x: mx.array, seed: int = 0) -> mx.array:
    """x (..., D) times the orthogonal matrix H·diag(signs), in float32."""
    dim = x.shape[-1]
    return mx.hadamard_transform(x.astype(mx.float32) * signs(dim, seed), scale=dim**-0.5)


def unrotate(y: mx.array, seed: int = 0) -> mx.array:
    """Inverse of `rotate` (the normalized Hadamard matrix is its own inverse)."""
    dim = y.shape[-1]
    return mx.hadamard_transform(y, scale=dim**-0.5) * signs(dim, seed)


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack codes (..., D) < 2**bits into uint32 words (..., D // 32 * bits), one bit plane each."""
    *lead, dim = codes.shape
    grouped = codes.astype(mx.uint32).reshape(*lead, dim // _WORD, _WORD)
    shifts = mx.arange(_WORD, dtype=mx.uint32)
    planes = [(((grouped >> plane) & 1) << shifts).sum(axis=-1) for plane in range(bits)]
    return mx.stack(planes, axis=-1).reshape(*lead, dim // _WORD * bits)


def unpack(words: mx.array, bits: int, dim: int) -> mx.array:
    """Inverse of `pack`: uint32 codes (..., dim)."""
    *lead, _ = words.shape
    planes = words.reshape(*lead, dim // _WORD, bits, 1)
    shifts = mx.arange(_WORD, dtype=mx.uint32)
    codes = mx.zeros((*lead, dim // _WORD, _WORD), dtype=mx.uint32)
    for plane in range(bits):
        codes = codes | (((planes[..., plane, :] >> shifts) & 1) << plane)
    return codes.reshape(*lead, dim)


def quantize(x: mx.array, bits: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    """(packed codes, per-vector scale in x's dtype) of x (..., D) rotated."""
    levels = 2**bits - 1
    y = rotate(x, seed)
    scale = mx.abs(y).max(axis=-1, keepdims=True)
    unit = y / mx.where(scale > 0, scale, 1)
    codes = mx.round((unit + 1) * (levels / 2))
    return pack(codes, bits), scale.astype(x.dtype)


def dequantize(
    words: mx.array, scale: mx.array, bits: int, dim: int, seed: int = 0
) -> mx.array:
    """x (..., dim) in the scale's dtype, rotated back."""
    levels = 2**bits - 1
    unit = unpack(words, bits, dim).astype(mx.float32) * (2 / levels) - 1
    y = unit * scale.astype(mx.float32)
    return unrotate(y, seed).astype(scale.dtype)


class TurboQuantKVCache(_BaseCache):
    """Layer cache holding rotated b-bit codes; prefill stays fp16 until decoding starts."""

    step = 256

    def __init__(self, head_dim: int, bits: int = 4, on_restore: str = "dequantize", seed: int = 0):
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        if on_restore not in ON_RESTORE:
            raise ValueError(f"on_restore must be one of {ON_RESTORE}, got {on_restore!r}")
        if head_dim < _WORD or head_dim & (head_dim - 1):
            raise ValueError(f"head_dim must be a power of two, at least {_WORD}, got {head_dim}")
        self.head_dim = head_dim
        self.code_bits = bits
        self.on_restore = on_restore
        self.seed = seed
        signs(head_dim, seed)  # drawn once per (head_dim, seed) and shared, before any step
        self.packed: list[mx.array] | None = None  # key codes, key scales, value codes, value scales
        self.quantized = 0  # tokens held as codes; the rest wait in `pending`
        self.pending = KVCache()
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Prefill chunks wait in fp16; a single token first quantizes them, then itself.
        Returns every token's keys and values, as mlx-lm's KVCache does (`keys_and_values`)."""
        self.offset += keys.shape[2]
        if keys.shape[2] > 1:
            self.pending.update_and_fetch(keys, values)
        else:
            self._flush()
            self._append(keys, values)
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """Keys and values of every token, oldest first: the codes dequantized, then the
        tokens still pending in fp16."""
        held = []
        if self.quantized:
            held.append(self._dequantized([p[..., : self.quantized, :] for p in self._packed()]))
        if self.pending.offset:
            held.append(self.pending.keys_and_values())
        if len(held) == 1:
            return held[0]
        keys, values = (mx.concatenate(list(parts), axis=2) for parts in zip(*held, strict=True))
        return keys, values

    def _packed(self) -> list[mx.array]:
        assert self.packed is not None, "no codes yet"
        return self.packed

    def _dequantized(self, parts: list[mx.array]) -> tuple[mx.array, mx.array]:
        """Keys and values from codes and scales (key codes, key scales, value codes, value
        scales)."""
        kc, ks, vc, vs = parts
        return (dequantize(kc, ks, self.code_bits, self.head_dim, self.seed),
                dequantize(vc, vs, self.code_bits, self.head_dim, self.seed))

    def _flush(self) -> None:
        """Quantize the fp16 tokens kept since the last decode step (lazy quantization)."""
        if self.pending.offset:
            self._append(*self.pending.keys_and_values())
            self.pending = KVCache()

    def _append(self, keys: mx.array, values: mx.array) -> None:
        parts = [*quantize(keys, self.code_bits, self.seed), *quantize(values, self.code_bits, self.seed)]
        start, end = self.quantized, self.quantized + keys.shape[2]
        if self.packed is None or end > self.packed[0].shape[2]:
            slots = -(-(end - (self.packed[0].shape[2] if self.packed else 0)) // self.step)
            grow = [mx.zeros((*p.shape[:2], slots * self.step, p.shape[3]), p.dtype) for p in parts]
            if self.packed is None:
                self.packed = grow
            else:
                held = [p[..., :start, :] for p in self.packed]
                self.packed = [mx.concatenate([h, g], axis=2) for h, g in zip(held, grow, strict=True)]
        for buffer, part in zip(self.packed, parts, strict=True):
            buffer[..., start:end, :] = part
        self.quantized = end

    def _parts(self, start: int, end: int) -> list[mx.array]:
        """Codes and scales of tokens [start, end): views of the codes, pending ones quantized."""
        parts = [p[..., start : min(end, self.quantized), :] for p in self.packed or []]
        if end <= self.quantized:
            return parts
        k, v = self.pending.keys_and_values()
        lo, hi = max(start - self.quantized, 0), end - self.quantized
        fresh = [*quantize(k[..., lo:hi, :], self.code_bits, self.seed),
                 *quantize(v[..., lo:hi, :], self.code_bits, self.seed)]
        if start >= self.quantized:
            return fresh
        return [mx.concatenate([p, f], axis=2) for p, f in zip(parts, fresh, strict=True)]

    def codes(self, start: int = 0, end: int | None = None) -> list[mx.array]:
        """Copies (no views of this cache's buffers) of the codes of tokens [start, end)."""
        return [mx.array(p) for p in self._parts(start, self.offset if end is None else end)]

    @classmethod
    def restore(cls, blocks: list[list[mx.array]], **options) -> TurboQuantKVCache | KVCache:
        """A working cache, as `from_state` makes it, from consecutive blocks of `codes()`."""
        parts = [mx.concatenate(list(column), axis=2) for column in zip(*blocks, strict=True)]
        return cls.from_state(cls(**options)._state(parts, parts[0].shape[2]))

    def expanded(self) -> KVCache:
        """An fp16 `KVCache` holding every token, dequantized (16/b times the codes)."""
        full = KVCache()
        keys, values = self._dequantized(self._parts(0, self.offset))
        full.state = (keys, values, keys.shape[2])
        return full

    def _state(self, parts: list[mx.array], offset: int) -> tuple[Any, ...]:
        return (*parts, offset, self.head_dim, self.code_bits, self.on_restore, self.seed)

    def state_range(self, start: int, end: int) -> tuple[Any, ...]:
        """The state of tokens [start, end) alone (see `harness.protocols.state_range`): a
        store cuts blocks with it, as it cuts mlx-lm's caches along their token axis."""
        return self._state(self._parts(start, end), end)

    @property
    def state(self) -> tuple[Any, ...]:
        """Codes and scales of every token (views; pending ones quantized), the offset, then
        the settings: what `from_state` needs, whatever `on_restore` says."""
        return self.state_range(0, self.offset)

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        *parts, offset, self.head_dim, self.code_bits, self.on_restore, self.seed = v
        signs(self.head_dim, self.seed)  # drawn here too, so no step of a restored cache draws it
        self.packed, self.quantized, self.offset = list(parts) or None, offset, offset
        self.pending = KVCache()

    @classmethod
    def from_state(cls, state: tuple[Any, ...]) -> TurboQuantKVCache | KVCache:
        """The cache `state` describes, or with `on_restore: dequantize` its fp16 expansion."""
        cache = super().from_state(state)
        return cache if cache.on_restore == "keep" else cache.expanded()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.packed or []) + self.pending.nbytes

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> Any:
        """As mlx-lm's KVCache: every token held is in time order, so a causal mask from the
        offset."""
        return create_attention_mask(N, self.offset, return_array, window_size)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the newest `n` tokens (pending ones first, then codes), as mlx-lm's
        QuantizedKVCache does: the slots stay allocated and are written over next."""
        n = min(self.offset, n)
        pending = self.pending.trim(n)
        self.quantized -= n - pending
        self.offset -= n
        return n


def turboquant(spec, bits: int = 4, on_restore: str = "dequantize", seed: int = 0) -> TurboQuantKVCache:
    """Layer-cache factory: one TurboQuant cache for the layer described by `spec`."""
    return TurboQuantKVCache(spec.head_dim, bits=bits, on_restore=on_restore, seed=seed)
