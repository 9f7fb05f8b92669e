"""`host_memory`'s trend: host memory that rises with every request is flagged under the 32 MiB
floor, while RSS's own noise (a flat wobble, a slow creep, a one-off step) is not."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.common.units import KiB
from harness.judge.detectors import detect
from tests.conftest import make_spec, serve
from tests.test_detect import MiB, at_rest, kinds

# scenarios/canaries.yaml's model and workload: 4 KiB a token, 256 tokens a request, so a
# request's keys and values copied into NumPy are 1 MiB.
CANARY_MODEL = {"dtype": "float16", "vocab": 1024,
                "layers": [{"count": 4, "kind": "full", "kv_heads": 4, "head_dim": 64}]}
TWENTY = {"prefill_chunk": 128, "requests": [{"prompt": 248, "decode": 8, "repeat": 20}]}


def host(outside: list[int]) -> pd.DataFrame:
    """Nothing held in MLX at rest; process memory outside MLX `outside` above the baseline at
    each point at rest."""
    frame = at_rest([0] * len(outside), [0] * len(outside))
    return frame.assign(rss=frame["rss"] + [0, *outside])


def rising_by(rate: int, requests: int, start: int = 3 * MiB) -> list[int]:
    return [start + rate * k for k in range(requests)]


def numpy_copies(keep: bool) -> tuple[pd.DataFrame, dict]:
    """The samples and the findings by kind of twenty requests on `NumpyCopyStore`."""
    spec = make_spec(model=CANARY_MODEL, workload=TWENTY, cache={"store": {
        "component": "tests.fixtures.host_store:NumpyCopyStore", "options": {"keep": keep}}})
    frame, findings, _figures = serve(spec)
    return frame, {f.kind: f for f in findings}


def test_a_store_keeping_a_numpy_copy_of_every_request_is_found_by_its_trend():
    frame, found = numpy_copies(keep=True)
    assert kinds(frame, host_memory={"min_trend_bytes": "1 GiB"}) == {}   # under the floor
    assert set(found) == {"host_memory"}
    finding = found["host_memory"]
    # Each 1 MiB copy is touched whole, with the allocator's own page or none besides.
    assert MiB <= finding.bytes <= MiB + 16 * KiB and finding.count == 18
    assert f"grows {finding.bytes:,} B per request over 18 requests" in finding.message
    assert "the components report 20.00 MiB outside MLX" in finding.message


def test_the_same_copying_with_nothing_kept_is_clean():
    assert numpy_copies(keep=False)[1] == {}


@pytest.mark.slow
def test_the_canary_and_its_twin_hold_over_ten_runs():
    for _ in range(10):
        assert set(numpy_copies(keep=True)[1]) == {"host_memory"}
        assert numpy_copies(keep=False)[1] == {}


def test_flat_noise_and_a_slow_creep_are_not_a_trend():
    wobble = [3 * MiB + (k * 7919 % 13 - 6) * 40 * KiB for k in range(32)]   # ±240 KiB
    assert kinds(host(wobble)) == {}
    assert kinds(host(rising_by(40 * KiB, 64))) == {}    # Python's bookkeeping: 2.5 MiB in all


@pytest.mark.parametrize("at", [8, 17, 18, 19])
def test_a_one_off_step_is_not_a_trend_wherever_it_falls(at):
    """Held after it, or too close to the end to be: the typical request adds nothing. Two
    points before the end (18) only the lower median tells it from a rise."""
    step = [3 * MiB + k * 8 * KiB + (24 * MiB if k >= at else 0) for k in range(20)]
    assert kinds(host(step)) == {}


def test_a_sustained_rise_is_flagged_from_its_rate_per_request():
    assert kinds(host(rising_by(255 * KiB, 40))) == {}   # 9.5 MiB in all, under the rate
    found = kinds(host(rising_by(256 * KiB, 40)))
    assert set(found) == {"host_memory"}
    assert (found["host_memory"].bytes, found["host_memory"].count) == (256 * KiB, 38)
    assert "grows 262,144 B per request over 38 requests (fit r²=1.000)" \
        in found["host_memory"].message


def test_a_sustained_rise_is_flagged_from_what_it_adds_in_all():
    assert kinds(host(rising_by(MiB, 9))) == {}          # 7 deltas past the warm-up: 7 MiB
    found = kinds(host(rising_by(MiB, 10)))              # 8 deltas: 8 MiB
    assert set(found) == {"host_memory"}
    assert (found["host_memory"].bytes, found["host_memory"].count) == (MiB, 8)
    assert kinds(host(rising_by(MiB, 10)), host_memory={"min_trend_bytes": "9 MiB"}) == {}


def test_a_noisy_rise_is_flagged_at_its_typical_rate_and_from_where_it_begins():
    noisy = [3 * MiB] * 6 + [3 * MiB + k * MiB + (k % 2) * 192 * KiB for k in range(1, 17)]
    found = kinds(host(noisy))
    assert set(found) == {"host_memory"}
    assert found["host_memory"].bytes == MiB - 192 * KiB      # the lower median of the deltas
    assert "per request from request 5 over 16 requests" in found["host_memory"].message


def test_a_rise_past_the_floor_is_reported_as_the_rise_not_the_trend():
    found = kinds(host(rising_by(2 * MiB, 20)))
    assert found["host_memory"].bytes == 41 * MiB
    assert "grew 41.00 MiB while MLX active grew 0.00 MiB" in found["host_memory"].message


def test_elsewhere_rss_rising_with_mlx_memory_is_not_host_memory():
    """On Metal RSS may count MLX's own buffers: a store growing in MLX is unbounded there, and
    the same rise on CPU, outside MLX, is host memory."""
    growing = [k * MiB for k in range(1, 21)]
    frame = at_rest(growing, growing)
    spec = make_spec(workload=TWENTY, detect={"unbounded": {"budget": "64 MiB"}})
    assert detect(frame, spec.detect, "gpu") == []
    assert {f.kind for f in detect(frame.assign(rss=frame["rss"] + [0, *growing]), spec.detect,
                                   "cpu")} == {"host_memory"}
