"""Held versus claimed: a budget judges the bytes MLX holds, never a count it does not back.

A store that reloads what it keeps with a lazy `mx.load` (tests/fixtures/lazy_store.py, as
vllm-mlx reloads its saved cache) counts every reloaded array's bytes while MLX allocates none
of them. Each request here stores 64 tokens of 16 KiB: 1 MiB of keys and values.
"""

from __future__ import annotations

import pytest

from harness.common.units import MiB
from harness.judge.expect import check
from tests.conftest import TOKEN_BYTES, make_spec, serve

STORE = "tests.fixtures.lazy_store:LazyReloadStore"
ENTRY = 64 * TOKEN_BYTES                                   # 1,048,576 B a request
SAVED = 64 * MiB

pytestmark = pytest.mark.usefixtures("exact_allocator")


def served(tmp_path, **options):
    """Six requests through the store, a budget of 4 MiB stated; samples, findings by kind and
    expectations by name."""
    spec = make_spec(cache={"store": {"component": STORE,
                                      "options": {"folder": str(tmp_path), **options}}},
                     workload={"requests": [{"prompt": 60, "decode": 4, "repeat": 6}]},
                     detect={"unbounded": {"budget": "4 MiB"}})
    frame, findings, figures = serve(spec)
    return frame, {f.kind: f for f in findings}, {c.name: c for c in check(spec.expect, findings,
                                                                          figures)}


def test_a_cache_reloaded_lazily_before_the_first_sample_is_claimed_not_held(tmp_path):
    frame, found, checks = served(tmp_path, saved=SAVED, keep=False)
    idle = frame[frame["phase"] == "idle"]
    assert (idle["logical"] == SAVED).all()     # 64 MiB counted at rest from the first sample
    assert frame["active"].iloc[0] < SAVED      # the baseline cannot hold them all
    assert (frame["active"].iloc[-1] - frame["active"].iloc[0]) == 0    # nor is any allocated
    assert "unbounded" not in found and checks["unbounded"].ok
    assert "overclaimed" not in found           # claimed before the run: not the run's claim
    assert "aliased" not in found               # nor is it an array the run counts twice


def test_a_store_that_reloads_lazily_what_it_keeps_is_overclaimed_never_over_its_budget(tmp_path):
    frame, found, checks = served(tmp_path)
    assert frame["logical"].iloc[-1] == 6 * ENTRY       # 6 MiB claimed against a 4 MiB budget
    assert "unbounded" not in found
    assert checks["unbounded"].ok and checks["unbounded"].superseded_by is None
    # Claimed and not held, by its exact bytes, at the 5 points past the 1 MiB floor.
    assert (found["overclaimed"].bytes, found["overclaimed"].count) == (6 * ENTRY, 5)
    assert not checks["overclaimed"].ok


def test_the_same_store_holding_what_it_reloads_is_over_its_budget(tmp_path):
    _, found, checks = served(tmp_path, evaluate=True)
    assert set(found) == {"unbounded"} and not checks["unbounded"].ok
    # 6 MiB held at rest against 4 MiB, growing 1 MiB a request.
    assert (found["unbounded"].bytes, found["unbounded"].count) == (ENTRY, 4)
    assert "components hold 6.00 MiB at rest, over the budget of 4.00 MiB, growing" \
        in found["unbounded"].message
