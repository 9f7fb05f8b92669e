"""Paged prefix cache with a hot tier and an SSD tier (seed 000, omlx style).

Prompts are cut into blocks of `block_size` tokens, each keyed by a hash of its parent's key and
its own tokens, so a key names a whole prefix. A block holds, per layer, the state of its tokens
(full-attention layers, cut with `harness.protocols.state_range`) or a copy of the layer's whole
state (sliding-window and recurrent layers, which cannot be cut by token), whatever the cache's
class: a hit rebuilds each layer with its class's `from_state`. Blocks live in a hot tier (LRU,
bounded in bytes); blocks evicted from it go to files in `ssd_dir`, written by one thread
through a bounded queue, unless `hot_cache_only` drops them.

The seed's bug switches:
- `hot_storage: raw_bytes` keeps blocks as `bytes` copies: invisible to MLX's counters (only RSS
  sees them), and a hit rebuilds arrays from them while they stay; `arrays` keeps the arrays.
- `snapshots: leak` copies the sliding/recurrent state at every block boundary of a prefill and
  never frees it; `release` frees it once the block is stored; `off` takes none.
- `store_all_blocks: false` gives only a prompt's last block the sliding/recurrent state, so a
  shorter prefix cannot be restored; `true` stores it in every block (n_blocks x state bytes).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import queue
import shutil
import struct
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from harness.common.units import parse_size
from harness.components import mlx_lm_state
from harness.components.protocols import LayerCache, join_ranges, state_range
from harness.models.geometry import KIND_FULL, Geometry

HOT_STORAGE = ("raw_bytes", "arrays")
SNAPSHOTS = ("off", "leak", "release")
TOKENS, STATE = "tokens", "state"  # a piece holds a token range of a cache, or its whole state
_PLAIN = (int, float, str, bool, type(None))


@dataclass
class Raw:
    """An array's bytes outside MLX, with what it takes to rebuild it."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, array: mx.array) -> Raw:
        # mx.array implements the buffer protocol; mlx's stubs do not declare `__buffer__`.
        data = bytes(memoryview(array))  # type: ignore[arg-type]
        return cls(data, str(array.dtype).removeprefix("mlx.core."), array.shape)

    def array(self) -> mx.array:
        dtype = getattr(mx, self.dtype)
        flat = np.frombuffer(self.data, dtype=np.uint8)
        return mx.array(flat).view(dtype).reshape(self.shape)


@dataclass
class Piece:
    """One layer's share of a block: a cache's state taken apart into its arrays and a recipe
    (JSON-able): what the piece holds (TOKENS or STATE), the cache's class as an import path,
    where each array goes in the state, and the state's plain values with their places."""

    recipe: tuple  # (kind, class path, array paths, [(path, plain value)])
    arrays: list[mx.array | Raw]  # Raw in the raw_bytes hot tier and on the SSD tier

    @property
    def nbytes(self) -> int:
        return sum(len(a.data) if isinstance(a, Raw) else a.nbytes for a in self.arrays)

    def raw(self) -> Piece:
        return Piece(self.recipe, [a if isinstance(a, Raw) else Raw.of(a) for a in self.arrays])

    def copy(self) -> Piece:
        return Piece(self.recipe, [a if isinstance(a, Raw) else _copy(a) for a in self.arrays])

    def live(self) -> list[mx.array]:
        return [a.array() if isinstance(a, Raw) else a for a in self.arrays]

    def state(self) -> Any:
        _, _, paths, plain = self.recipe
        return tree_unflatten([*zip(paths, self.live(), strict=True), *plain])


@dataclass
class Block:
    key: str
    pieces: list[Piece | None]  # per layer; None: a sliding/recurrent layer without its state

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces if p is not None)

    @property
    def restorable(self) -> bool:
        return all(p is not None for p in self.pieces)

    def layer_piece(self, layer: int) -> Piece:
        """The piece of `layer`, which a full-attention layer and a restorable block have."""
        held = self.pieces[layer]
        assert held is not None, f"block {self.key} holds no state for layer {layer}"
        return held

    def raw(self) -> Block:
        return Block(self.key, [None if p is None else p.raw() for p in self.pieces])


def block_key(parent: str, tokens: tuple[int, ...]) -> str:
    """The chained hash: a key names the block and every token before it."""
    digest = hashlib.blake2b(parent.encode(), digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.hexdigest()


def _copy(array: mx.array) -> mx.array:
    """A copy that owns its buffer (a slice would keep the whole source alive)."""
    return mx.array(array)


def piece(kind: str, cache: LayerCache, state: Any) -> Piece:
    """`state` of `cache` taken apart, its arrays copied."""
    paths: list[str] = []
    arrays: list[mx.array | Raw] = []
    plain: list[tuple[str, Any]] = []
    flat = tree_flatten(state)
    assert isinstance(flat, list)  # a dict only when given a `destination`
    for path, value in flat:
        if isinstance(value, mx.array):
            paths.append(path)
            arrays.append(_copy(value))
        elif isinstance(value, _PLAIN):
            plain.append((path, value))
        else:
            raise TypeError(f"paged_ssd cannot store the state of {type(cache).__name__}: "
                            f"{path} is a {type(value).__name__}, not an array or a plain value")
    cls = f"{type(cache).__module__}:{type(cache).__qualname__}"
    return Piece((kind, cls, paths, plain), arrays)


def token_piece(cache: LayerCache, start: int, end: int) -> Piece:
    """Tokens [start, end) of a full-attention layer's cache, copied."""
    return piece(TOKENS, cache, state_range(cache, start, end))


def state_piece(cache: LayerCache) -> Piece:
    """A copy of the whole state of a cache that cannot be cut by token."""
    return piece(STATE, cache, mlx_lm_state.state(cache))


def restore_layer(pieces: list[Piece]) -> LayerCache:
    """A working cache from one layer's pieces of consecutive blocks, by its class's `from_state`.

    Token ranges are joined (the blocks and the result coexist: a hit's peak is a multiple of
    the block bytes); a whole state is restored from the last block's copy.
    """
    kind, cls_path, _, _ = pieces[-1].recipe
    # A whole state is copied: the working cache updates its arrays in place, and the block's
    # own must stay as stored (join_ranges makes new arrays already).
    state = join_ranges([p.state() for p in pieces]) if kind == TOKENS else pieces[-1].copy().state()
    module, _, name = cls_path.partition(":")
    cls = reduce(getattr, name.split("."), importlib.import_module(module))
    return mlx_lm_state.from_state(cls, state)


def write_block(path: Path, block: Block) -> None:
    """One file per block: an 8-byte header length, a JSON header, then the raw arrays.

    Written to a temporary name and renamed, so a reader never sees half a block.
    """
    layers: list[dict[str, Any] | None] = []
    blobs: list[bytes] = []
    offset = 0
    for piece in block.pieces:
        if piece is None:
            layers.append(None)
            continue
        arrays = []
        for raw in piece.arrays:
            assert isinstance(raw, Raw), "blocks are written as Block.raw()"
            arrays.append({"dtype": raw.dtype, "shape": list(raw.shape), "offset": offset,
                           "size": len(raw.data)})
            blobs.append(raw.data)
            offset += len(raw.data)
        layers.append({"recipe": piece.recipe, "arrays": arrays})
    header = json.dumps({"key": block.key, "layers": layers}).encode()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def read_block(path: Path) -> Block:
    data = path.read_bytes()
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + length])
    body = memoryview(data)[8 + length :]
    pieces: list[Piece | None] = []
    for layer in header["layers"]:
        if layer is None:
            pieces.append(None)
            continue
        arrays: list[mx.array | Raw] = [
            Raw(bytes(body[a["offset"] : a["offset"] + a["size"]]), a["dtype"], tuple(a["shape"]))
            for a in layer["arrays"]
        ]
        pieces.append(Piece(tuple(layer["recipe"]), arrays))
    return Block(header["key"], pieces)


class PagedSSDStore:
    """A store (`harness.protocols.Store`) over a hot LRU tier and an SSD tier."""

    def __init__(
        self,
        geometry: Geometry,
        block_size: int | None = None,
        hot_budget: int | str = "1 GiB",
        ssd_dir: str | None = None,
        queue_size: int = 8,
        hot_cache_only: bool = False,
        hot_storage: str = "arrays",
        snapshots: str = "release",
        store_all_blocks: bool = True,
    ):
        if hot_storage not in HOT_STORAGE:
            raise ValueError(f"hot_storage must be one of {HOT_STORAGE}, got {hot_storage!r}")
        if snapshots not in SNAPSHOTS:
            raise ValueError(f"snapshots must be one of {SNAPSHOTS}, got {snapshots!r}")
        self.geometry = geometry
        self.block_size = block_size or default_block_size(geometry)
        self.hot_budget = parse_size(hot_budget)
        self.hot_cache_only = hot_cache_only
        self.hot_storage = hot_storage
        self.snapshots = snapshots
        self.store_all_blocks = store_all_blocks
        self._full = [layer.kind == KIND_FULL for layer in geometry.layers]
        self._hot: OrderedDict[str, Block] = OrderedDict()
        self._hot_bytes = 0
        self._leaked: list[list[Piece]] = []
        self._boundary: dict[str, list[Piece]] = {}
        self._owns_dir = ssd_dir is None
        self.ssd_dir = Path(ssd_dir or tempfile.mkdtemp(prefix="kvmem-ssd-"))
        self.ssd_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._pending: dict[str, Block] = {}  # queued for the writer, still servable
        self._on_disk: set[str] = set()
        self._queue: queue.Queue[Block | None] = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._writer = threading.Thread(target=self._write_loop, name="paged-ssd-writer", daemon=True)
        self._writer.start()

    # -- store protocol -------------------------------------------------------------------

    def fetch(self, tokens: tuple[int, ...]) -> tuple[list[LayerCache] | None, int]:
        """Caches rebuilt from the longest chain of stored blocks that can be restored.

        At least one token is left to prefill. Walks back past blocks whose sliding/recurrent
        state was not stored (`store_all_blocks: false`).
        """
        blocks: list[Block] = []
        for key in self._chain(tokens, (len(tokens) - 1) // self.block_size):
            block = self._lookup(key)
            if block is None:
                break
            blocks.append(block)
        while blocks and not blocks[-1].restorable:
            blocks.pop()
        if not blocks:
            return None, 0
        # Left lazy, as a server hands them to the model: every layer is rebuilt in one go.
        caches = []
        for layer, full in enumerate(self._full):
            pieces = [b.layer_piece(layer) for b in blocks] if full else [blocks[-1].layer_piece(layer)]
            caches.append(restore_layer(pieces))
        return caches, len(blocks) * self.block_size

    def on_prefill(self, tokens: tuple[int, ...], done: int, caches: list[LayerCache]) -> None:
        """At a block boundary, snapshot the layers that cannot be cut by token."""
        if self.snapshots == "off" or done % self.block_size or all(self._full):
            return
        snapshot = [state_piece(c) for c, full in zip(caches, self._full, strict=True) if not full]
        mx.eval([p.arrays for p in snapshot])
        if self.snapshots == "leak":
            self._leaked.append(snapshot)  # the bug: nothing ever removes it
        key = self._chain(tokens, done // self.block_size)[-1]
        self._boundary[key] = snapshot

    def store(self, tokens: tuple[int, ...], caches: list[LayerCache]) -> None:
        """Every full block of `tokens` not stored yet; then the boundary snapshots go."""
        keys = self._chain(tokens, len(tokens) // self.block_size)
        for i, key in enumerate(keys):
            if self._has(key):
                continue
            last = i == len(keys) - 1
            snapshot = iter(self._boundary.get(key, []))  # the exact state at this boundary
            pieces: list[Piece | None] = []
            for cache, full in zip(caches, self._full, strict=True):
                if full:
                    pieces.append(token_piece(cache, i * self.block_size, (i + 1) * self.block_size))
                elif self.store_all_blocks or last:
                    taken = next(snapshot, None)
                    if taken is None:
                        taken = state_piece(cache)
                    elif self.snapshots == "leak":  # the leaked snapshot keeps its own copy
                        taken = taken.copy()
                    pieces.append(taken)
                else:
                    pieces.append(None)
            block = Block(key, pieces)
            mx.eval([p.arrays for p in pieces if p is not None])
            self._insert(block.raw() if self.hot_storage == "raw_bytes" else block)
        self._boundary.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held in MLX arrays: the hot tier (arrays) and the boundary snapshots."""
        snapshots = {id(p): p for s in [*self._leaked, *self._boundary.values()] for p in s}
        hot = sum(b.nbytes for b in self._hot.values()) if self.hot_storage == "arrays" else 0
        return hot + sum(p.nbytes for p in snapshots.values())

    @property
    def host_bytes(self) -> int:
        """Bytes held outside MLX: the raw hot tier and blocks waiting for the writer."""
        hot = self._hot_bytes if self.hot_storage == "raw_bytes" else 0
        with self._lock:
            return hot + sum(b.nbytes for b in self._pending.values())

    def close(self, timeout: float = 60.0) -> None:
        """Drain the writer, then remove the SSD directory if this store made it."""
        self._queue.put(None)
        self._writer.join(timeout)
        if self._writer.is_alive():
            raise RuntimeError(f"paged_ssd writer did not finish within {timeout} s")
        if self._owns_dir:
            shutil.rmtree(self.ssd_dir, ignore_errors=True)
        if self._error is not None:
            raise RuntimeError("paged_ssd writer failed") from self._error

    # -- tiers ----------------------------------------------------------------------------

    def _chain(self, tokens: tuple[int, ...], blocks: int) -> list[str]:
        keys, parent = [], ""
        for i in range(blocks):
            parent = block_key(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            keys.append(parent)
        return keys

    def _lookup(self, key: str) -> Block | None:
        """The block for `key`: hot tier first, then queued or written ones (read from disk)."""
        if key in self._hot:
            self._hot.move_to_end(key)
            return self._hot[key]
        with self._lock:
            block = self._pending.get(key)
            on_disk = key in self._on_disk
        if block is not None or not on_disk:
            return block
        return read_block(self._path(key))

    def _has(self, key: str) -> bool:
        """Whether `key` is stored in a tier, as `_lookup` finds it, without reading the disk."""
        if key in self._hot:
            self._hot.move_to_end(key)
            return True
        with self._lock:
            return key in self._pending or key in self._on_disk

    def _insert(self, block: Block) -> None:
        """Into the hot tier, evicting least recently used blocks until it fits."""
        while self._hot and self._hot_bytes + block.nbytes > self.hot_budget:
            _, old = self._hot.popitem(last=False)
            self._hot_bytes -= old.nbytes
            self._evict(old)
        if block.nbytes > self.hot_budget:
            self._evict(block)
            return
        self._hot[block.key] = block
        self._hot_bytes += block.nbytes

    def _evict(self, block: Block) -> None:
        """Dropped in hot_cache_only mode, else queued for the writer (blocks when it is full)."""
        if self.hot_cache_only:
            return
        raw = block.raw()
        with self._lock:
            self._pending[block.key] = raw
        self._queue.put(raw)

    def _path(self, key: str) -> Path:
        return self.ssd_dir / f"{key}.block"

    def _write_loop(self) -> None:
        while (block := self._queue.get()) is not None:
            try:
                write_block(self._path(block.key), block)
            except BaseException as exc:  # kept for close(), which raises it
                self._error = exc
            with self._lock:
                self._pending.pop(block.key, None)
                if self._error is None:
                    self._on_disk.add(block.key)

    @classmethod
    def estimate_bytes(cls, geometry: Geometry, workload: Any, **options: Any) -> int:
        """Upper bound on what the store adds: blocks, snapshots, and a hit's rebuild."""
        bs = options.get("block_size") or default_block_size(geometry)
        per_token = sum(layer.token_bytes() * layer.batch for layer in geometry.layers
                        if layer.kind == KIND_FULL)
        state = sum(layer.minimum_bytes(1 << 62) for layer in geometry.layers if layer.kind != KIND_FULL)
        requests = [r for r in workload.requests or [] for _ in range(r.repeat)]
        blocks = [(r.prompt + r.decode) // bs for r in requests]
        stated = blocks if options.get("store_all_blocks", True) else [min(n, 1) for n in blocks]
        held = sum(blocks) * bs * per_token + sum(stated) * state
        held = min(held, parse_size(options.get("hot_budget", "1 GiB")))
        if not options.get("hot_cache_only", False):  # blocks waiting for the writer
            held += options.get("queue_size", 8) * max(bs * per_token + state, 0)
        boundaries = [r.prompt // bs for r in requests]
        snapshots = {"off": 0, "leak": sum(boundaries),
                     "release": max(boundaries, default=0)}[options.get("snapshots", "release")]
        longest = max((r.prompt for r in requests), default=0)
        rebuild = 2 * (longest * per_token + state)
        return held + snapshots * state + rebuild


def default_block_size(geometry: Geometry) -> int:
    """256 tokens, or the sliding window when there is one (a block then holds a window)."""
    windows = [layer.window for layer in geometry.layers if layer.window]
    return max(windows) if windows else 256

