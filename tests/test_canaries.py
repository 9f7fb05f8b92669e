"""scenarios/canaries.yaml served in this process: each at-rest detector's canary is found with
its exact bytes, and its clean twin raises nothing, in one run and (slow) in ten."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from harness.common.units import MiB
from harness.judge import at_rest, expect
from harness.scenario import ScenarioSpec, load_variants
from tests.conftest import serve

CANARIES = Path(__file__).resolve().parent.parent / "scenarios" / "canaries.yaml"
RUNS = 10
GROWING = {"spike", "growth"}   # mlx-lm's KVCache growing over an 8,192-token prompt, unchecked

# variant: (the finding it must raise, or None for a twin; the kinds it may raise besides)
VARIANTS = {
    "broken_eviction": ("leak", set()),
    "evicting": ("plateau", set()),
    "no_limit": ("unbounded", set()),
    "slice": ("retained", set()),
    "copy": (None, set()),
    "cyclic": ("gc_deferred", set()),
    "acyclic": (None, set()),
    "pooling": ("pooled", GROWING),
    "default_pool": (None, GROWING),
}
# The canaries' bytes, exact on the CPU backend (pooled's depends on MLX's buffer reuse).
BYTES = {
    "leak": MiB,                   # one evicted 256-token entry of 4 KiB a token per request
    "unbounded": MiB,              # one entry per request, reported
    "retained": 2_211_840,         # 20 entries' spare slots: 5 x (42 + 32 + 22 + 12) x 4 KiB
    "gc_deferred": 19 * MiB,       # every entry evicted so far, each a cycle still uncollected
    "plateau": 8 * MiB,            # eight entries kept, one evicted per request once full
}


@functools.cache
def specs() -> dict[str, ScenarioSpec]:
    """Every variant's spec, loaded once (loading checks the stores in a spawned child)."""
    return {v.name: v.spec for v in load_variants(CANARIES)}


def spec(variant: str) -> ScenarioSpec:
    return specs()[variant]


def outcome(variant: str) -> tuple[dict, list[dict]]:
    """The findings by kind of one in-process run, and its failed expectations."""
    variant_spec = spec(variant)
    _frame, findings, figures = serve(variant_spec)
    failed = [c for c in expect.check(variant_spec.expect, findings, figures) if not c.ok]
    return {f.kind: f for f in findings}, failed


def test_every_variant_is_bundled_here():
    assert set(specs()) == set(VARIANTS)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_canary_is_found_with_its_bytes_and_each_twin_is_clean(variant):
    kind, allowed = VARIANTS[variant]
    found, failed = outcome(variant)
    assert failed == []
    assert set(found) - allowed == ({kind} if kind else set())
    if kind in BYTES:
        assert found[kind].bytes == BYTES[kind]
    if kind == "pooled":
        assert found[kind].bytes > at_rest.POOLED_CPU_FLOOR


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_canaries_and_twins_hold_over_ten_runs(variant):
    kind, allowed = VARIANTS[variant]
    for run in range(RUNS):
        found, failed = outcome(variant)
        assert failed == [] and set(found) - allowed == ({kind} if kind else set()), (run, found)
