"""The probe: exact readings around one step, and rows compact enough for long runs."""

from __future__ import annotations

import mlx.core as mx

from harness.probe import PHASES, ROW, Probe, to_frame


def test_a_step_records_its_transient_peak_and_settled_active_bytes():
    probe = Probe(capacity=2)
    keep = mx.zeros((1024, 1024), dtype=mx.float32)  # 4 MiB held across the step
    mx.eval(keep)
    probe.begin()
    scratch = mx.ones((2048, 1024), dtype=mx.float32)  # 8 MiB alive only inside the step
    total = mx.sum(scratch)
    mx.eval(total)
    del scratch
    probe.end("decode", 3, -1, 17, logical=4 * 2**20, host=0, minimum=0, work=0)
    row = to_frame(probe.rows()).iloc[0]
    assert row["phase"] == "decode" and row["request"] == 3 and row["tokens"] == 17
    assert row["peak"] - row["active"] >= 8 * 2**20
    assert row["logical"] == 4 * 2**20
    del keep


def test_rows_stay_compact_and_grow_by_doubling():
    assert ROW.itemsize <= 96  # a million steps under 100 MB
    probe = Probe(capacity=4)
    for step in range(1000):
        probe.begin()
        probe.end(PHASES[step % len(PHASES)], 0, -1, step, 0, 0, 0, 0)
    assert probe.steps == 1000
    assert len(probe.rows()) == 1000 and probe.rows()["step"][-1] == 999
    assert probe._rows.nbytes <= 2 * 1000 * ROW.itemsize
