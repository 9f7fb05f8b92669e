"""TurboQuant-style KV cache (seed 000): rotate, then quantize every coordinate to `bits` bits.

A seeded random orthogonal rotation spreads each key/value vector's energy evenly over its
coordinates, so one absmax scale per vector and a uniform b-bit grid lose little. The rotation
is a randomized Hadamard transform (random signs, then the orthonormal Hadamard matrix), which
is orthogonal, costs O(D log D) per vector and holds no D x D matrix. Codes are packed into
uint32 words in the layout of mlx's own `mx.quantize` (a little-endian bit stream), so a vector
of D coordinates costs exactly D*b/8 bytes plus a 2-byte scale: about b/16 of fp16.

Prefill chunks are kept in fp16 and quantized lazily when decoding starts (one token per update).

Attention reads the codes where they lie (`attention`). The rotation is orthogonal, so a query
scores against a key as the rotated query against the rotated key, and the softmax-weighted sum
of the rotated values is the rotated sum: the queries are rotated, `mx.quantized_matmul` scores
and sums over the packed codes (the absmax grid is mlx's affine one: code q of a vector of scale
s stands for q·2s/(2^b - 1) - s) and the sum is rotated back. No fp16 copy of the cache is made:
a decode step holds per layer the float32 scores, the grid's scales and biases and vectors of a
query's size, at most `step_transient` bytes (a 2-layer fp16 model of 8 KV heads of 128 holding
2,048 tokens: 0.48-0.57 MB a step, where dequantizing for attention held 50-134 MB for 2 to 8
bits and its whole fp16 KVCache is 16.8 MB; docs/reference_caches.md).

mlx-lm's models attend through `mlx_lm.models.base.scaled_dot_product_attention`, which hands
the keys and values of a cache that has `bits` (its `QuantizedKVCache`) to the module's
`quantized_scaled_dot_product_attention`. Its queries are never rotated, so it cannot read these
codes: importing this module wraps that function so that what this cache returns (`Held`) goes
to `attention`, and everything else to mlx-lm's as before.

`on_restore` is the seed's bug switch for rebuilding a cache from its state (`from_state`, which
a store's hit and mlx-lm's `load_prompt_cache` call): `keep` (after, the default) stays
quantized, so a restored conversation goes on exactly as the uninterrupted one; `dequantize`
(before) expands it into a full fp16 `KVCache`, 16/b times the codes, and the quantized and fp16
copies coexist while it does. That `KVCache` holds every later token in fp16 where this cache
would quantize it, so the conversation drifts from the uninterrupted one (measured in
docs/reference_caches.md).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, update_wrapper
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from harness.components import mlx_lm_state
from harness.components.mlx_lm_state import keys_and_values

BITS = (2, 3, 4, 8)
ON_RESTORE = ("keep", "dequantize")
_WORD = 32
_GROUP = 128  # the largest group mx.quantized_matmul takes


def group_size(head_dim: int) -> int:
    """The group the codes' grid is given per (mlx's affine format): every group of a vector
    shares its scale, so the largest one mlx takes, or the whole vector."""
    return min(head_dim, _GROUP)


@cache
def signs(head_dim: int, seed: int = 0) -> mx.array:
    """The rotation's random signs for `head_dim`, float32, the same for a given seed."""
    drawn = np.random.default_rng([seed, head_dim]).choice([-1.0, 1.0], head_dim)
    flip = mx.array(drawn.astype(np.float32))
    mx.eval(flip)
    return flip


def _hadamard(x: mx.array) -> mx.array:
    """The orthonormal Hadamard transform of the last axis, its own inverse."""
    return mx.hadamard_transform(x, scale=x.shape[-1] ** -0.5)


def rotate(x: mx.array, seed: int = 0) -> mx.array:
    """x (..., D) times the orthogonal matrix H·diag(signs), in float32."""
    return _hadamard(x.astype(mx.float32) * signs(x.shape[-1], seed))


def unrotate(y: mx.array, seed: int = 0) -> mx.array:
    """Inverse of `rotate` (the normalized Hadamard matrix is its own inverse)."""
    return _hadamard(y) * signs(y.shape[-1], seed)


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack codes (..., D) < 2**bits into uint32 words (..., D // 32 * bits) as `mx.quantize`
    does: code i at bits [i*b, i*b + b) of a little-endian stream of words. Each word of a
    32-code group takes the codes with bits in it, shifted left (or right, for the high bits of
    a code begun in the word before) into place."""
    *lead, dim = codes.shape
    grouped = codes.astype(mx.uint32).reshape(*lead, dim // _WORD, _WORD)
    words = []
    for word in range(bits):
        first, last = word * _WORD // bits, -(-(word + 1) * _WORD // bits)
        offset = mx.arange(first * bits - word * _WORD, last * bits - word * _WORD, bits)
        left, right = (mx.maximum(o, 0).astype(mx.uint32) for o in (offset, -offset))
        words.append(((grouped[..., first:last] << left) >> right).sum(axis=-1))
    return mx.stack(words, axis=-1).reshape(*lead, dim // _WORD * bits)


def unpack(words: mx.array, bits: int, dim: int) -> mx.array:
    """Inverse of `pack`: uint32 codes (..., dim)."""
    ones = mx.ones((*words.shape[:-1], dim // group_size(dim)), mx.float32)
    codes = mx.dequantize(words, ones, mx.zeros_like(ones), group_size=group_size(dim), bits=bits)
    return codes.astype(mx.uint32)


def grid(scale: mx.array, bits: int, dim: int) -> tuple[mx.array, mx.array]:
    """The codes' grid in mlx's affine terms, float32 scales and biases (..., dim / group):
    code q of a vector of absmax s stands for q * 2s/(2^b - 1) - s in every group."""
    s = mx.broadcast_to(scale, (*scale.shape[:-1], dim // group_size(dim))).astype(mx.float32)
    return s * (2 / (2**bits - 1)), -s


def quantize(x: mx.array, bits: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    """(packed codes, per-vector scale in x's dtype) of x (..., D) rotated."""
    half = (2**bits - 1) / 2
    y = rotate(x, seed)
    scale = mx.abs(y).max(axis=-1, keepdims=True)
    codes = mx.round(y * (half / mx.where(scale > 0, scale, 1)) + half)
    return pack(codes, bits), scale.astype(x.dtype)


def dequantize(
    words: mx.array, scale: mx.array, bits: int, dim: int, seed: int = 0
) -> mx.array:
    """x (..., dim) in the scale's dtype, rotated back."""
    y = mx.dequantize(words, *grid(scale, bits, dim), group_size=group_size(dim), bits=bits)
    return unrotate(y, seed).astype(scale.dtype)


def step_transient(slots: int, heads: int, kv_heads: int, head_dim: int, bits: int,
                   pending: int = 0) -> int:
    """The most a decode step holds, in bytes, beyond what is held before or after it, per layer
    attending over `slots` slots of codes with `heads` query heads (mlx-lm's models attend a
    layer at a time, each on the one before): every array its graph makes, as if none were freed
    before the end (MLX frees them on a worker thread, so any may coexist). That is three float32
    arrays of the scores' size (scores, masked, probabilities) and three of each grid's, for keys
    and values (the scales made float32, the grid's scales and biases); the mask over the slots
    (an int32 range and two bool arrays); float32 vectors of the query's and the new token's size
    (under 32 bytes per coordinate of a query head and 96 of a KV head). With `pending` prefill
    tokens to quantize first (the first decode step after a prefill), add one `step`-token
    block's intermediates (each block waits for the one before: 96 bytes per coordinate of a KV
    head and token) and the codes' buffers, made while the fp16 tokens they replace still are.
    A step that grows the buffers (every 256 tokens) also copies them, as mlx-lm's caches do."""
    groups = head_dim // group_size(head_dim)
    attend = (4 * slots * (3 * heads + 6 * kv_heads * groups) + 6 * slots
              + 32 * head_dim * (heads + 3 * kv_heads))
    if not pending:
        return attend
    codes = 2 * slots * kv_heads * (head_dim * bits // 8 + 2)
    return attend + 96 * kv_heads * head_dim * min(pending, TurboQuantKVCache.step) + codes


class Held(NamedTuple):
    """A layer's keys or values as `update_and_fetch` returns them once it holds codes, for
    `attention`: the codes' and scales' buffers whole (`mx.quantized_matmul` copies a slice,
    so attention reads every slot and masks the spare ones), of which the first `held` slots
    hold tokens; then the tokens pending in the input dtype (None if none); the rotation's
    signs."""

    codes: mx.array
    scales: mx.array
    held: int
    pending: mx.array | None
    flip: mx.array


def _over_slots(mask: Any, length: int, held: int, slots: int, pending: int) -> mx.array | None:
    """mlx-lm's mask over the tokens (codes, then pending) laid over what attention reads: every
    slot of the codes' buffer, then the pending tokens. Spare slots are masked out."""
    if isinstance(mask, str):  # "causal"
        total = held + pending
        mask = mx.arange(total - length, total)[:, None] >= mx.arange(total)[None]
    if held == slots:
        return mask
    if mask is None:
        return mx.concatenate([mx.arange(slots) < held, mx.ones((pending,), mx.bool_)])
    spare = (mx.zeros((*mask.shape[:-1], slots - held), mx.bool_) if mask.dtype == mx.bool_ else
             mx.full((*mask.shape[:-1], slots - held), mx.finfo(mask.dtype).min, mask.dtype))
    return mx.concatenate([mask[..., :held], spare, mask[..., held:]], axis=-1)


def attention(queries: mx.array, keys: Held, values: Held, scale: float, mask: Any,
              bits: int) -> mx.array:
    """softmax(q·kᵀ·scale + mask)·v over what a TurboQuant layer holds, reading its codes in
    place: the queries rotated against the codes, the probabilities summed over the codes then
    rotated back; the pending tokens as mlx's attention reads them (in their dtype). Masks as
    mlx-lm's `quantized_scaled_dot_product_attention` takes them."""
    batch, heads, length, dim = queries.shape
    kv_heads, slots = keys.codes.shape[1], keys.codes.shape[2]
    repeats, group = heads // kv_heads, group_size(dim)
    # A KV head's queries as the rows of one matrix: the codes are read once, never broadcast.
    rows = (queries * scale).reshape(batch, kv_heads, repeats * length, dim)
    scores = mx.quantized_matmul(_hadamard(rows.astype(mx.float32) * keys.flip), keys.codes,
                                 *grid(keys.scales, bits, dim), transpose=True, group_size=group,
                                 bits=bits)
    pending = 0
    if keys.pending is not None:
        pending = keys.pending.shape[2]
        fresh = rows @ keys.pending.swapaxes(-1, -2)
        scores = mx.concatenate([scores, fresh.astype(mx.float32)], axis=-1)
    scores = scores.reshape(batch, kv_heads, repeats, length, -1)
    mask = _over_slots(mask, length, keys.held, slots, pending)
    if mask is not None:
        if mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        scores = (mx.where(mask, scores, mx.finfo(scores.dtype).min) if mask.dtype == mx.bool_
                  else scores + mask)
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(batch, kv_heads, repeats * length, -1)
    out = _hadamard(mx.quantized_matmul(probs[..., :slots], values.codes,
                                        *grid(values.scales, bits, dim), transpose=False,
                                        group_size=group, bits=bits)) * values.flip
    if values.pending is not None:
        out = out + probs[..., slots:].astype(values.pending.dtype) @ values.pending
    return out.astype(queries.dtype).reshape(batch, heads, length, dim)


def _routed(theirs: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """mlx-lm's quantized attention, with a TurboQuant cache's keys and values sent to
    `attention` instead, or before it holds codes (plain arrays, the prefill as given) to mlx's
    own attention, as an fp16 cache's."""
    def attend(queries: mx.array, q_keys: Any, q_values: Any, scale: float, mask: Any,
               group_size: int = 64, bits: int = 8) -> mx.array:
        if isinstance(q_keys, Held):
            return attention(queries, q_keys, q_values, scale, mask, bits)
        if isinstance(q_keys, mx.array):
            return mx.fast.scaled_dot_product_attention(queries, q_keys, q_values, scale=scale,
                                                        mask=mask)
        return theirs(queries, q_keys, q_values, scale, mask, group_size, bits)

    return update_wrapper(attend, theirs)


if not hasattr(mlx_lm_base.quantized_scaled_dot_product_attention, "__wrapped__"):
    mlx_lm_base.quantized_scaled_dot_product_attention = _routed(
        mlx_lm_base.quantized_scaled_dot_product_attention)


class TurboQuantKVCache(_BaseCache):
    """Layer cache holding rotated b-bit codes; prefill stays fp16 until decoding starts.
    Attention reads the codes in place: a decode step holds at most `step_transient` bytes
    beyond what stays, a few float32 values per slot and head, not the fp16 keys and values
    (16/b times the codes) that expanding them would make. `bits` and `group_size` give the
    codes' format in mlx's terms; having `bits` is also what sends mlx-lm's attention to
    `attention` (see the module's docstring)."""

    step = 256

    def __init__(self, head_dim: int, bits: int = 4, on_restore: str = "keep", seed: int = 0):
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        if on_restore not in ON_RESTORE:
            raise ValueError(f"on_restore must be one of {ON_RESTORE}, got {on_restore!r}")
        if head_dim < _WORD or head_dim & (head_dim - 1):
            raise ValueError(f"head_dim must be a power of two, at least {_WORD}, got {head_dim}")
        self.head_dim = head_dim
        self.bits = bits
        self.group_size = group_size(head_dim)
        self.on_restore = on_restore
        self.seed = seed
        signs(head_dim, seed)  # drawn once per (head_dim, seed) and shared, before any step
        self.packed: list[mx.array] | None = None  # key codes, key scales, value codes, value scales
        self.quantized = 0  # tokens held as codes; the rest wait in `pending`
        self.pending = KVCache()
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        """Prefill chunks wait in fp16; a single token first quantizes them, then itself.
        Returns every token's keys and values as attention reads them (`keys_and_values`)."""
        self.offset += keys.shape[2]
        if keys.shape[2] > 1:
            self.pending.update_and_fetch(keys, values)
        else:
            self._flush()
            self._append(keys, values)
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Any, Any]:
        """Keys and values of every token, oldest first, with nothing dequantized or copied:
        before the first decode step the prefill as given (mlx's attention reads it as an fp16
        cache's), then `Held` keys and values (the codes, then any pending tokens)."""
        if not self.quantized:
            return keys_and_values(self.pending)
        pending: tuple[mx.array | None, mx.array | None] = (None, None)
        if self.pending.offset:
            pending = keys_and_values(self.pending)
        kc, ks, vc, vs = self._packed()
        flip = signs(self.head_dim, self.seed)
        return (Held(kc, ks, self.quantized, pending[0], flip),
                Held(vc, vs, self.quantized, pending[1], flip))

    def _packed(self) -> list[mx.array]:
        assert self.packed is not None, "no codes yet"
        return self.packed

    def _dequantized(self, parts: list[mx.array]) -> tuple[mx.array, mx.array]:
        """Keys and values from codes and scales (key codes, key scales, value codes, value
        scales)."""
        kc, ks, vc, vs = parts
        return (dequantize(kc, ks, self.bits, self.head_dim, self.seed),
                dequantize(vc, vs, self.bits, self.head_dim, self.seed))

    def _flush(self) -> None:
        """Quantize the fp16 tokens kept since the last decode step (lazy quantization), `step`
        tokens at a time into room made once: a block's float32 intermediates are gone before
        the next block's are made, so the transient is a block's, not the prompt's."""
        if self.pending.offset:
            keys, values = keys_and_values(self.pending)
            room = self.quantized + keys.shape[2]
            for start in range(0, keys.shape[2], self.step):
                block = [keys[..., start : start + self.step, :], values[..., start : start + self.step, :]]
                if self.packed is not None:  # after the blocks before it, or MLX runs them abreast
                    block = mx.depends(block, self.packed)
                self._append(block[0], block[1], room)
            self.pending = KVCache()

    def _append(self, keys: mx.array, values: mx.array, room: int = 0) -> None:
        """Quantize tokens after the codes held, first growing the buffers by whole steps to
        hold them and at least `room` tokens in all."""
        parts = [*quantize(keys, self.bits, self.seed), *quantize(values, self.bits, self.seed)]
        start, end = self.quantized, self.quantized + keys.shape[2]
        have = self.packed[0].shape[2] if self.packed else 0
        if max(end, room) > have:
            slots = -(-(max(end, room) - have) // self.step)
            grow = [mx.zeros((*p.shape[:2], slots * self.step, p.shape[3]), p.dtype) for p in parts]
            if self.packed is None:
                self.packed = grow
            else:
                held = [p[..., :start, :] for p in self.packed]
                self.packed = [mx.concatenate([h, g], axis=2) for h, g in zip(held, grow, strict=True)]
        for buffer, part in zip(self._packed(), parts, strict=True):
            buffer[..., start:end, :] = part
        self.quantized = end

    def _parts(self, start: int, end: int) -> list[mx.array]:
        """Codes and scales of tokens [start, end): views of the codes, pending ones quantized."""
        parts = [p[..., start : min(end, self.quantized), :] for p in self.packed or []]
        if end <= self.quantized:
            return parts
        k, v = keys_and_values(self.pending)
        lo, hi = max(start - self.quantized, 0), end - self.quantized
        fresh = [*quantize(k[..., lo:hi, :], self.bits, self.seed),
                 *quantize(v[..., lo:hi, :], self.bits, self.seed)]
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
        keys, values = self._dequantized(self._parts(0, self.offset))
        return mlx_lm_state.from_state(KVCache, (keys, values, keys.shape[2]))

    def _state(self, parts: list[mx.array], offset: int) -> tuple[Any, ...]:
        return (*parts, offset, self.head_dim, self.bits, self.on_restore, self.seed)

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
        *parts, offset, self.head_dim, self.bits, self.on_restore, self.seed = v
        self.group_size = group_size(self.head_dim)
        signs(self.head_dim, self.seed)  # drawn here too, so no step of a restored cache draws it
        self.packed, self.quantized, self.offset = list(parts) or None, offset, offset
        self.pending = KVCache()

    @classmethod
    def from_state(cls, state: tuple[Any, ...]) -> TurboQuantKVCache | KVCache:
        """The cache `state` describes, or with `on_restore: dequantize` its fp16 expansion."""
        cache = cls.__new__(cls)
        cache.state = state
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


def turboquant(spec, bits: int = 4, on_restore: str = "keep", seed: int = 0) -> TurboQuantKVCache:
    """Layer-cache factory: one TurboQuant cache for the layer described by `spec`."""
    return TurboQuantKVCache(spec.head_dim, bits=bits, on_restore=on_restore, seed=seed)
