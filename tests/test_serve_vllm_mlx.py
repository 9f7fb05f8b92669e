"""Servers in environments of their own, end to end (slow: the first run builds each
environment from the package registry): vllm-mlx 0.6.0's bundled scenario passes every
expectation twice in a row with the same verdicts, leaving no server; the mlx-lm version pair
reports both releases side by side, each run by its own mlx-lm."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.pipeline.suite import run_variants
from harness.scenario import load_variants
from tests.processes import started_under, tagged

SERVERS = ("vllm_mlx.cli", "mlx_lm server")

SCENARIOS = Path(__file__).parent.parent / "scenarios"


@pytest.mark.slow
def test_vllm_mlx_passes_its_expectations_twice_with_the_same_verdicts(tmp_path: Path) -> None:
    variants = load_variants(SCENARIOS / "vllm_mlx_server.yaml")
    verdicts = []
    for run in range(2):
        with tagged() as token:
            summaries = run_variants(variants, tmp_path / f"run{run}")
        assert not started_under(token, *SERVERS)
        assert [(s.variant, s.status, s.passed) for s in summaries] == [
            (v.name, "ok", True) for v in variants]
        verdicts.append({s.variant: sorted({f.kind for f in s.findings} - {"spike"})
                         for s in summaries})
        assert {s.environment.mlx_lm for s in summaries} == {"0.31.3"}
    assert verdicts[0] == verdicts[1]
    assert verdicts[0]["cache_memory"] == ["gc_deferred"]
    assert verdicts[0]["trie_stream"] == ["overclaimed"]


@pytest.mark.slow
def test_a_mlx_lm_version_pair_is_one_report(tmp_path: Path) -> None:
    with tagged() as token:
        summaries = run_variants(load_variants(SCENARIOS / "mlx_lm_versions.yaml"), tmp_path)
    assert {s.variant: s.environment.mlx_lm for s in summaries} == {
        "mlx_lm_0_31_3": "0.31.3", "mlx_lm_0_32_2": "0.32.2"}
    assert all(s.passed for s in summaries)
    assert (tmp_path / "mlx_lm_versions" / "memory.png").exists()  # both, overlaid
    assert not started_under(token, *SERVERS)
