"""Verdicts on stores kvmem did not write (tests/fixtures/corpus_stores.py): each gets exactly
its one right finding, with its exact bytes, in one run and (slow) in ten."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from harness.common.units import MiB
from harness.judge import expect
from harness.judge.records import Finding
from harness.scenario import ScenarioError, ScenarioSpec, load_variants
from tests.conftest import serve

CORPUS = Path(__file__).resolve().parent / "fixtures" / "corpus.yaml"
RUNS = 10
# mlx-lm's KVCache grows by concatenation when a request decodes onto caches a hit gave back.
GROWING = {"growth", "spike"}

# variant: (its finding, its severity, its bytes or None where they follow the collector's
# timing, the kinds it may raise besides)
VERDICTS: dict[str, tuple[str | None, str, int | None, set[str]]] = {
    # A store that fills to its limit and evicts: filled and held, early or late, whether or
    # not it counts its bytes; never a leak (ollama #17924, MTPLX #438).
    "plateau_early": ("plateau", "error", 3 * MiB, set()),
    "plateau_late": ("plateau", "error", 16 * MiB, set()),
    "plateau_early_unaccounted": ("plateau", "error", 3 * MiB, set()),
    "plateau_late_unaccounted": ("plateau", "error", 15 * MiB, set()),
    # Never evicting: unbounded, a warning with no budget stated, an error past one.
    "hoarding": ("unbounded", "warning", MiB, set()),
    "hoarding_budget": ("unbounded", "error", MiB, set()),
    # Eviction that forgets the index: a leak of one entry a request, fitted past the fill.
    "broken_eviction": ("leak", "error", MiB, set()),
    # Cycles: gc_deferred, never also retained or a leak.
    "cycle_in_store": ("gc_deferred", "error", 19 * MiB, set()),
    "cycle_in_fetch": ("gc_deferred", "error", None, GROWING),
    # A fetch that hands out the store's own cache objects (vllm-mlx #641's hazard).
    "aliasing_fetch": ("aliased", "error", 2 * MiB, GROWING),
    "copying_fetch": (None, "error", None, GROWING),
}


@functools.cache
def specs() -> dict[str, ScenarioSpec]:
    return {v.name: v.spec for v in load_variants(CORPUS)}


def outcome(variant: str) -> tuple[dict[str, Finding], list[dict], dict]:
    """Findings by kind, failed expectations and metrics of one in-process run."""
    spec = specs()[variant]
    _frame, findings, figures = serve(spec)
    failed = [c for c in expect.check(spec.expect, findings, figures) if not c.ok]
    return {f.kind: f for f in findings}, failed, figures


def test_every_variant_has_a_verdict():
    assert set(specs()) == set(VERDICTS)


@pytest.mark.parametrize("variant", sorted(VERDICTS))
def test_each_store_gets_its_one_finding(variant):
    kind, severity, size, allowed = VERDICTS[variant]
    found, failed, _ = outcome(variant)
    assert failed == []
    assert set(found) - allowed == ({kind} if kind else set()), found
    if kind:
        assert found[kind].severity == severity
    if size is not None:
        assert found[kind].bytes == size


def test_cycle_garbage_is_what_a_server_would_hold_and_only_gc_deferred_reports_it():
    """The automatic collector runs as in a server: evicted cyclic entries stay allocated, and
    the run's final memory says so, while leak and retained leave those bytes alone."""
    found, _, figures = outcome("cycle_in_store")
    assert figures["final"] == 20 * MiB                # one entry kept, 19 evicted and cyclic
    assert figures["leak_rate"] == 0 and "retained" not in found
    assert "unreachable reference cycles hold 19.00 MiB" in found["gc_deferred"].message


def test_a_leak_after_a_fill_is_fitted_where_the_growth_is():
    found, _, figures = outcome("broken_eviction")
    assert figures["leak_rate"] == MiB
    assert "from request 7" in found["leak"].message


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VERDICTS))
def test_each_verdict_holds_over_ten_runs(variant):
    kind, _severity, size, allowed = VERDICTS[variant]
    for run in range(RUNS):
        found, failed, _ = outcome(variant)
        assert failed == [] and set(found) - allowed == ({kind} if kind else set()), (run, found)
        assert size is None or found[kind].bytes == size, (run, found)


GLUE = '''
from harness.components.protocols import StoreBase
from tests.fixtures.corpus_stores import FillingStore


def filling(geometry, **options):
    """Glue that passes every option on: a typo is only seen when the store is built."""
    return FillingStore(geometry, **options)


class Remaining:
    """A store in mlx-lm's shape (fetch gives cache and remaining tokens), without nbytes."""

    def __init__(self, geometry):
        pass

    def fetch(self, tokens):
        return None, tokens

    def store(self, tokens, caches):
        pass
'''


@pytest.mark.parametrize("store, message", [
    ({"component": "glue_corpus:filling", "options": {"max_entires": 3}},
     "cache.store.options: TypeError: FillingStore.__init__() got an unexpected keyword "
     "argument 'max_entires' (building glue_corpus:filling)"),
    ({"component": "adapt.remaining", "options": {"store": "glue_corpus:Remaining"}},
     "cache.store.component: adapt.remaining (around glue_corpus:Remaining) builds a "
     "RemainingStore without nbytes (a store needs fetch, store, on_prefill, nbytes, close)"),
])
def test_what_glue_hides_fails_the_pre_run_check(tmp_path, monkeypatch, store, message):
    (tmp_path / "glue_corpus.py").write_text(GLUE)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "glue.yaml"
    path.write_text(CORPUS.read_text().split("variants:")[0]
                    + f"cache: {{store: {json.dumps(store)}}}\n")
    with pytest.raises(ScenarioError) as raised:
        load_variants(path)
    assert str(raised.value) == f"{path}: {message}"
