"""Rows in memory and spilled to a spool file: a soak holds one block, a killed writer leaves
what it spilled."""

from __future__ import annotations

import numpy as np

from harness.run import rows as rows_module
from harness.run.probe import ROW, Probe, Sample
from harness.run.rows import Rows, read

PAIR = np.dtype([("i", np.int32), ("t", np.float64)])


def test_in_memory_rows_double_and_come_back_in_order():
    kept = Rows(PAIR, capacity=2)
    for i in range(9):
        kept.append((i, i / 2))
    assert len(kept) == 9 and kept.all()["i"].tolist() == list(range(9))
    assert len(kept._block) == 16 and kept.last()["i"] == 8


def test_spooled_rows_hold_one_block_and_the_file_holds_the_rest(tmp_path):
    spool = tmp_path / "rows"
    kept = Rows(PAIR, capacity=4, spool=spool)
    for i in range(10):
        kept.append((i, 0.0))
    assert len(kept._block) == 4                      # never grown
    assert len(read(spool, PAIR)) == 8                # two full blocks spilled
    assert kept.last()["i"] == 9 and len(kept) == 10
    kept.spill()
    assert kept.last()["i"] == 9  # the block is empty: the last row spilled, not a file read
    kept.close()
    assert read(spool, PAIR)["i"].tolist() == list(range(10))


def test_a_block_older_than_the_spill_period_is_written_out(tmp_path, monkeypatch):
    spool = tmp_path / "rows"
    kept = Rows(PAIR, capacity=100, spool=spool)
    kept.append((0, 0.0))
    monkeypatch.setattr(rows_module, "SPILL_SECONDS", 0.0)
    kept.append((1, 0.0))
    assert read(spool, PAIR)["i"].tolist() == [0, 1]  # on disk without a close: a kill keeps it


def test_a_row_cut_short_is_left_out(tmp_path):
    spool = tmp_path / "rows"
    spool.write_bytes(np.array([(1, 1.0), (2, 2.0)], dtype=PAIR).tobytes()[:-3])
    assert read(spool, PAIR)["i"].tolist() == [1]
    assert len(read(tmp_path / "missing", PAIR)) == 0


def test_a_spooled_probe_keeps_samples_and_requests_apart(tmp_path):
    probe = Probe(capacity=8, spool=tmp_path)
    for i in range(20):
        probe.add(Sample(float(i), "serve", i, -1, 0, 1024 * i, 0, 0, 0, 0, 0, 0, 0))
    probe.request(3, 1.0, None, 2.5, 10, 4, False)
    probe.close()
    assert read(tmp_path / "samples.rows", ROW)["active"].tolist() == [1024 * i for i in range(20)]
    (request,) = probe.requests()
    assert (request["request"], request["done"], np.isnan(request["first"])) == (3, 2.5, True)
