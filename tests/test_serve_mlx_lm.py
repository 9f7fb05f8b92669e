"""Serve mode on the real `mlx_lm.server` of the installed mlx-lm: the bundled scenario's canary
and its clean twin, run as `kvmem run` runs them but on 8 of their 16 prompts (about 10 s side by
side): the server holds at most 3 entries, so 5 more requests make the hoard plain.

The twin proves the detectors stay quiet on the real server under the same plugin; the canary
proves they fire on it. The other variants' verdicts are recorded in the scenario and checked by
`python -m harness run scenarios/mlx_lm_server.yaml` (and the baselines)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from harness.common.units import KiB
from harness.pipeline.suite import run_variants
from harness.scenario import Variant, load_variants
from tests.processes import started_under, tagged

SCENARIO = Path(__file__).parent.parent / "scenarios" / "mlx_lm_server.yaml"


def shortened(variant: Variant, requests: int) -> Variant:
    """`variant` with each of its HTTP phases cut to `requests` requests."""
    workload = variant.spec.workload
    assert workload.http is not None
    phases = [phase.model_copy(update={"requests": requests}) for phase in workload.http.phases]
    http = workload.http.model_copy(update={"phases": phases})
    spec = variant.spec.model_copy(update={"workload": workload.model_copy(update={"http": http})})
    return dataclasses.replace(variant, spec=spec)


@pytest.fixture(scope="module")
def canaries(tmp_path_factory: pytest.TempPathFactory) -> dict:
    variants = [shortened(v, 8) for v in load_variants(SCENARIO, ["canary_hoard", "canary_clean"])]
    # Side by side: each server waits on its client most of the time, and what is judged is
    # memory at rest, which sharing the cores does not move.
    with tagged() as token:
        summaries = run_variants(variants, tmp_path_factory.mktemp("reports"), jobs=2)
    left = started_under(token, "mlx_lm.server", "mlx_lm server")  # either way started
    return {"summaries": {s.variant: s for s in summaries}, "left": left}


def test_the_hoarding_plugin_is_a_leak_of_one_entry_a_request(canaries: dict) -> None:
    summary = canaries["summaries"]["canary_hoard"]
    assert summary.status == "ok" and summary.passed
    (leak,) = [f for f in summary.findings if f.kind == "leak"]
    assert "per request" in leak.message
    # Each hoarded entry keeps its K/V: at least 16 KiB a token for its ~220 tokens.
    assert summary.metrics["leak_rate"] > 220 * 16 * KiB
    assert summary.model is not None and summary.model.engine == "server"
    assert summary.store_stats is not None
    assert summary.store_stats["entries"] <= 3  # the LRU itself stays within its cap


def test_its_clean_twin_has_no_finding_at_rest(canaries: dict) -> None:
    summary = canaries["summaries"]["canary_clean"]
    assert summary.status == "ok" and summary.passed
    assert {f.kind for f in summary.findings} <= {"spike", "plateau"}


def test_no_server_outlives_the_run(canaries: dict) -> None:
    assert canaries["left"] == []
