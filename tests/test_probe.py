"""The probe: exact readings around one step, and rows compact enough for long runs."""

from __future__ import annotations

import sys

import mlx.core as mx
import psutil
import pytest

from harness.agent.kvmem_rest import release_freed_heap
from harness.agent.kvmem_sample import PHASES, Sample
from harness.common.units import MiB
from harness.run.probe import ROW, Probe, current_rss, to_frame


def test_a_step_records_its_transient_peak_and_settled_active_bytes():
    probe = Probe(capacity=2)
    keep = mx.zeros((1024, 1024), dtype=mx.float32)  # 4 MiB held across the step
    mx.eval(keep)
    probe.begin()
    scratch = mx.ones((2048, 1024), dtype=mx.float32)  # 8 MiB alive only inside the step
    total = mx.sum(scratch)
    mx.eval(total)
    del scratch
    probe.end(phase="decode", request=3, turn=-1, tokens=17, logical=4 * MiB, host=0,
              minimum=0, work=0)
    row = to_frame(probe.rows()).iloc[0]
    assert row["phase"] == "decode" and row["request"] == 3 and row["tokens"] == 17
    assert row["peak"] - row["active"] >= 8 * MiB
    assert row["logical"] == 4 * MiB
    del keep


def test_a_row_is_a_sample_with_the_steps_own_columns():
    """The row is defined once (harness.agent.kvmem_sample.Sample): the probe's columns are its
    fields, less `entries`, and the step's own, each given by name, whatever their order."""
    assert set(ROW.names) == set(Sample._fields) - {"entries"} | {"step", "host", "minimum", "work"}
    probe = Probe()
    sample = Sample(time=1.5, phase="fetch", request=2, turn=3, tokens=4, active=5, peak=6, cache=7,
                    rss=8, logical=9, entries=10, cyclic=11, cap=12, buffers=13, arrays=14)
    probe.add(sample, host=15, minimum=16, work=17)
    row = probe.rows()[0]
    assert {name: row[name].item() for name in ROW.names} == {
        "step": 0, "phase": PHASES.index("fetch"), "request": 2, "turn": 3, "tokens": 4,
        "active": 5, "peak": 6, "cache": 7, "rss": 8, "logical": 9, "host": 15, "minimum": 16,
        "work": 17, "cyclic": 11, "time": 1.5, "cap": 12, "buffers": 13, "arrays": 14}


def test_rows_stay_compact_and_grow_by_doubling():
    assert ROW.itemsize <= 120  # a million steps under 120 MB
    probe = Probe(capacity=4)
    for step in range(1000):
        probe.begin()
        probe.end(phase=PHASES[step % len(PHASES)], request=0, turn=-1, tokens=step, logical=0,
                  host=0, minimum=0, work=0)
    assert probe.steps == 1000
    assert len(probe.rows()) == 1000 and probe.rows()["step"][-1] == 999
    assert probe._rows._block.nbytes <= 2 * 1000 * ROW.itemsize


def test_rss_reading_follows_memory_the_process_touches():
    """The probe's RSS reader agrees with psutil's and sees 64 MiB of touched host memory. RSS is
    the whole process's: a thread of the test worker may hand back a few MiB meanwhile (once 5.4
    MiB beside the suite's other processes), so the rise is held to three quarters."""
    assert abs(current_rss() - psutil.Process().memory_info().rss) < MiB
    before = current_rss()
    held = bytearray(b"\xff") * (64 * MiB)  # written, so every page is touched
    assert current_rss() - before >= 48 * MiB
    assert abs(current_rss() - psutil.Process().memory_info().rss) < MiB
    del held


def test_release_freed_heap_returns_glibc_heap_to_the_kernel():
    """Many small freed blocks stay in glibc's heap (RSS) until `release_freed_heap`, which the
    engine calls before each idle sample."""
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc heap behaviour")
    chunks = [bytearray(4096) for _ in range(16_384)]  # 64 MiB in blocks below mmap's threshold
    keep = bytearray(8192)  # malloc'd last: pins the top of the heap, so free() cannot shrink it
    held = current_rss()
    del chunks
    kept = held - current_rss()
    assert kept < 16 * MiB, f"glibc gave back {kept:,} B by itself: nothing left to test"
    release_freed_heap()
    assert held - current_rss() >= 48 * MiB
    del keep
