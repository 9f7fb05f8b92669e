"""Which MLX arrays share a buffer, and the buffers pending arrays' graphs hold: the counting
half of `kvmem_holders`, standalone as it is (the standard library and the process's own MLX).

Nothing here evaluates an array or allocates MLX memory: evaluated arrays are compared through
`mx.get_array_buffer_size` and their data pointers (read through the buffer protocol, which MLX
serves from the array's own memory), pending ones through the graph `mx.export_to_dot` writes.
"""

from __future__ import annotations

import ctypes
import io
import itertools
from typing import Any

PYBUF_FULL_RO = 0x11C


class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                *((name, ctypes.c_void_p) for name in (
                    "format", "shape", "strides", "suboffsets", "internal"))]


_GET_BUFFER = ctypes.pythonapi.PyObject_GetBuffer
_GET_BUFFER.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_RELEASE_BUFFER = ctypes.pythonapi.PyBuffer_Release
_RELEASE_BUFFER.argtypes = [ctypes.POINTER(_PyBuffer)]
_RELEASE_BUFFER.restype = None


def pointer(array: Any) -> int | None:
    """The data pointer of an evaluated array (inside its buffer, for a view), or None."""
    view = _PyBuffer()
    try:
        _GET_BUFFER(array, ctypes.byref(view), PYBUF_FULL_RO)
    except Exception:  # a backend whose arrays do not export their memory
        return None
    try:
        return view.buf or 0
    finally:
        _RELEASE_BUFFER(ctypes.byref(view))


def unique(mx: Any, arrays: list, sizes: list[int]) -> list[int]:
    """For each evaluated array, the first array (in walk order) behind the same buffer.

    Arrays are bucketed by their buffer's size; within a bucket, sorted by data pointer, the
    arrays of one buffer are neighbours (a view points inside its buffer, and other buffers of
    that size are disjoint ranges), each pair confirmed by MLX. The count of unique buffers MLX
    gives for the bucket checks the result; where it disagrees, or pointers are not available,
    each array is compared with the buffers found so far."""
    first = list(range(len(arrays)))
    buckets: dict[int, list[int]] = {}
    for i, size in enumerate(sizes):
        buckets.setdefault(size, []).append(i)
    for size, members in buckets.items():
        if size == 0:
            continue
        expected = mx.get_array_buffer_size(*(arrays[i] for i in members)) // size
        pointers = [pointer(arrays[i]) for i in members]
        if None not in pointers:
            shared = _neighbours(mx, arrays, sorted(zip(pointers, members, strict=True)), size)
            if len(shared) == expected:
                for run in shared:
                    owner = min(run)
                    for i in run:
                        first[i] = owner
                continue
        found: list[int] = []
        for i in members:
            first[i] = next((j for j in found if mx.get_array_buffer_size(
                arrays[j], arrays[i]) == size), i)
            if first[i] == i:
                found.append(i)
    return first


def _neighbours(mx: Any, arrays: list, order: list, size: int) -> list[list[int]]:
    """Runs of arrays, in pointer order, that share one buffer."""
    runs = [[order[0][1]]]
    for (low, i), (high, j) in itertools.pairwise(order):
        if high - low < size and mx.get_array_buffer_size(arrays[i], arrays[j]) == size:
            runs[-1].append(j)
        else:
            runs.append([j])
    return runs


def graph_buffers(mx: Any, pending: list) -> int:
    """The evaluated inputs the graphs of pending arrays hold, counted without evaluating."""
    if not pending or not hasattr(mx, "export_to_dot"):
        return 0
    out = io.StringIO()
    mx.export_to_dot(out, *pending)
    return out.getvalue().count("rank=source")
