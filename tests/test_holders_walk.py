"""The holder walk: every live MLX buffer is attributed, once, to the shortest path from a root
that reaches it, and the path is named by the program's object that holds it. Exact bytes on the
CPU backend (`exact_allocator`: no buffer reuse)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import types
import weakref
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from harness.agent import kvmem_holders
from harness.agent.kvmem_holders import Census, Group, buffer_limit, census
from harness.agent.kvmem_rest import unreachable

FIXTURE = "holders_fixture"


class Store:
    def __init__(self) -> None:
        self._entries: dict[str, mx.array] = {}


class Entry:
    """Refers to itself: only the cycle collector frees it."""

    def __init__(self, value: mx.array) -> None:
        self.value = value
        self.me = self


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = [nn.Linear(4, 2)]


@pytest.fixture
def program() -> Iterator[types.ModuleType]:
    """A throwaway module whose globals are the roots a test sets."""
    module = types.ModuleType(FIXTURE)
    sys.modules[FIXTURE] = module
    yield module
    del sys.modules[FIXTURE]


def evaluated(*shape: int) -> mx.array:
    array = mx.zeros(shape, dtype=mx.float32)
    mx.eval(array)
    return array


def group(found: Census, holder: str) -> Group:
    matches = [g for g in found.groups if g.holder == holder]
    assert len(matches) == 1, [g.holder for g in found.groups]
    return matches[0]


def test_a_store_is_one_group_with_its_exact_bytes(exact_allocator, program):
    program.STORE = Store()
    for key in ("a", "b", "c"):
        program.STORE._entries[key] = evaluated(256)
    found = census(mx)
    assert group(found, "tests.test_holders_walk:Store._entries[*]") == Group(
        "tests.test_holders_walk:Store._entries[*]", f"{FIXTURE}:STORE._entries['a']", "global",
        bytes=3 * 1024, logical=3 * 1024, arrays=3, buffers=3, pending=0)
    assert found.bytes == sum(g.bytes for g in found.groups)
    assert found.buffers == sum(g.buffers for g in found.groups)
    assert not found.approximate


def test_a_slice_counts_its_whole_buffer_once(exact_allocator, program):
    whole = evaluated(1024)
    program.VIEW = whole[:4]
    mx.eval(program.VIEW)
    program.HOLD = [whole]
    del whole
    found = census(mx)
    view = group(found, f"{FIXTURE}:VIEW")
    held = group(found, f"{FIXTURE}:HOLD[*]")
    assert (view.bytes, view.logical, view.buffers) == (4096, 16, 1)
    assert (held.bytes, held.logical, held.buffers, held.arrays) == (0, 4096, 0, 1)
    assert found.bytes == mx.get_array_buffer_size(
        *(g for g in gc.get_objects() if type(g) is mx.array and _is_evaluated(g)))


def _is_evaluated(array: mx.array) -> bool:
    try:
        mx.get_array_buffer_size(array)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("pointers", [True, False], ids=["by_pointer", "pairwise"])
def test_buffers_of_one_size_are_told_apart(exact_allocator, program, monkeypatch, pointers):
    if not pointers:  # a backend whose arrays do not export their memory
        monkeypatch.setattr(kvmem_holders.kvmem_buffers, "pointer", lambda array: None)
    program.ALL = [evaluated(1024) for _ in range(3)]
    program.FIRST, program.LAST = program.ALL[0][1:3], program.ALL[2][5:]
    mx.eval(program.FIRST, program.LAST)
    found = census(mx)
    assert group(found, f"{FIXTURE}:FIRST").bytes == group(found, f"{FIXTURE}:LAST").bytes == 4096
    rest = group(found, f"{FIXTURE}:ALL[*]")
    assert (rest.bytes, rest.buffers, rest.arrays) == (4096, 1, 3)


def test_an_array_reached_twice_is_attributed_to_the_shorter_path(exact_allocator, program):
    array = evaluated(64)
    program.DEEP = {"one": [[array]]}
    program.SHORT = array
    del array
    found = census(mx)
    assert group(found, f"{FIXTURE}:SHORT").bytes == 256
    assert not [g for g in found.groups if g.holder.startswith(f"{FIXTURE}:DEEP")]


def test_an_unreachable_cycle_is_named_by_its_types_and_stays_garbage(exact_allocator):
    enabled = gc.isenabled()
    gc.disable()
    try:
        Entry(evaluated(256))
        held = mx.get_active_memory()
        garbage = unreachable()
        found = census(mx, garbage=garbage)
        del garbage
        cycle = group(found, "tests.test_holders_walk:Entry.value (cycle of Entry)")
        assert (cycle.root, cycle.bytes, cycle.buffers) == ("cycle", 1024, 1)
        assert cycle.path == "(cycle of Entry) <Entry>.value"
        assert mx.get_active_memory() == held  # neither freed nor kept
        gc.collect()
        assert mx.get_active_memory() == held - 1024
    finally:
        if enabled:
            gc.enable()


def test_unreachable_leaves_the_collector_as_it_was():
    before = (gc.get_debug(), len(gc.garbage))
    unreachable()
    assert (gc.get_debug(), len(gc.garbage)) == before


def test_a_pending_graph_counts_its_buffers_and_is_not_evaluated(exact_allocator, program):
    x = mx.array([1.0, 2.0])
    for _ in range(3):
        x -= 1
    program.PENDING = x
    del x
    active = mx.get_active_memory()
    found = census(mx)
    assert mx.get_active_memory() == active
    assert not _is_evaluated(program.PENDING)
    assert group(found, f"{FIXTURE}:PENDING") == Group(
        f"{FIXTURE}:PENDING", f"{FIXTURE}:PENDING", "global", bytes=0, logical=8, arrays=1,
        buffers=4, pending=1)


def test_a_census_allocates_no_mlx_memory(exact_allocator, program):
    program.STORE = Store()
    program.STORE._entries["a"] = evaluated(1000)
    program.STORE._entries["b"] = program.STORE._entries["a"][3:7]
    mx.eval(program.STORE._entries["b"])
    active, peak = mx.get_active_memory(), mx.get_peak_memory()
    census(mx)
    assert (mx.get_active_memory(), mx.get_peak_memory()) == (active, peak)


def _hold(ready: threading.Event, done: threading.Event) -> None:
    kept = evaluated(32)
    ready.set()
    done.wait()
    del kept


def test_frames_are_roots_except_skipped_threads_and_the_walk(exact_allocator):
    ready, done = threading.Event(), threading.Event()
    thread = threading.Thread(target=_hold, args=(ready, done))
    thread.start()
    ready.wait()
    local = evaluated(16)
    try:
        seen = {g.holder: g for g in census(mx).groups}
        skipped = {g.holder for g in census(mx, skip_threads={thread.ident or 0}).groups}
    finally:
        done.set()
        thread.join()
    name = "tests.test_holders_walk:test_frames_are_roots_except_skipped_threads_and_the_walk()"
    assert (seen[f"{name}/local"].root, seen[f"{name}/local"].bytes) == ("frame", 64)
    assert seen["tests.test_holders_walk:_hold()/kept"].bytes == 128
    assert "tests.test_holders_walk:_hold()/kept" not in skipped
    assert not [h for h in seen if "kvmem_holders" in h]
    mx.eval(local)


def test_skip_frame_leaves_the_callers_frame_out(exact_allocator):
    local = evaluated(16)
    found = census(mx, skip_frame=sys._getframe())
    assert not [g for g in found.groups if "test_skip_frame_leaves" in g.holder]
    assert mx.get_array_buffer_size(local) == 64


def test_a_module_holder_is_named_by_its_attributes(exact_allocator, program):
    program.MODEL = Outer()
    mx.eval(program.MODEL.parameters())
    found = census(mx)
    weight = group(found, "tests.test_holders_walk:Outer.blocks[*].weight")
    assert (weight.bytes, weight.path) == (32, f"{FIXTURE}:MODEL.blocks[0].weight")
    assert group(found, "tests.test_holders_walk:Outer.blocks[*].bias").bytes == 8


def test_the_walk_keeps_nothing_alive(exact_allocator):
    store: Store | None = Store()
    assert store is not None
    store._entries["a"] = evaluated(512)
    alive = weakref.ref(store)
    active = mx.get_active_memory()
    census(mx)
    store = None  # a snapshot of this frame's locals would still hold it
    assert alive() is None
    assert mx.get_active_memory() == active - 2048


def test_without_buffer_sizes_the_figures_are_approximate(exact_allocator, program):
    program.VIEW = evaluated(100)[:10]
    mx.eval(program.VIEW)
    old = types.SimpleNamespace(array=mx.array)
    found = census(old)
    view = group(found, f"{FIXTURE}:VIEW")
    assert found.approximate
    assert (view.bytes, view.buffers, view.logical) == (40, 1, 40)


def test_the_buffer_limit_is_the_backends_where_mlx_reports_it():
    assert buffer_limit(mx) == mx.device_info().get("resource_limit")
    metal = types.SimpleNamespace(device_info=lambda: {"resource_limit": 499000})
    assert buffer_limit(metal) == 499000
    assert buffer_limit(types.SimpleNamespace()) is None


def test_it_runs_standalone_beside_the_agent():
    """In a server it is the top-level `kvmem_holders`, where kvmem's package may be absent."""
    script = ("import sys; sys.modules['harness'] = None; import kvmem_holders, mlx.core as mx; "
              "x = mx.ones((4,)); mx.eval(x); "
              "print([g.bytes for g in kvmem_holders.census(mx).groups if g.holder == '__main__:x'])")
    agent = str(Path(kvmem_holders.__file__).parent)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": agent}, check=True)
    assert ran.stdout.strip() == "[16]"


def _closing_over(kept: list) -> None:
    def detach() -> tuple:
        return detach, kept  # its own closure cell: function, tuple, cell, a cycle

    detach()


def test_a_cycle_of_a_function_is_named_where_the_function_is_defined(exact_allocator):
    """A closure that refers to itself and keeps a list of arrays: no class of the program's
    on the path, so the cycle's function names it, module and qualified name, for a maintainer
    to find (vllm-mlx's cache_memory: a `_detach` closure over its `eval_targets`)."""
    arrays = [mx.ones((64,), dtype=mx.float32)]
    mx.eval(arrays)
    _closing_over(arrays)
    del arrays
    garbage = unreachable()
    try:
        found = census(mx, garbage=garbage)
        (cycle,) = [g for g in found.groups if g.root == "cycle"]
        assert cycle.holder == ("(cycle of cell, tuple, function) "
                                "tests.test_holders_walk:_closing_over.<locals>.detach.kept[*]")
        assert (cycle.bytes, cycle.arrays) == (256, 1)
    finally:
        del garbage
