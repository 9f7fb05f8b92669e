"""Run-to-run noise: the median run, the spread it records, and a recorded spread in the gate."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from harness.cli import main
from harness.judge.summary import Summary, parse
from harness.pipeline.repeat import block, combine, warnings
from harness.report.console import noise as table
from tests.summaries import MiB, summary

# One layer, one short request: a run takes about a second, most of it the child's imports.
TINY_SCENARIO = """\
name: tiny
model: {dtype: float16, vocab: 256, layers: [{count: 1, kind: full, kv_heads: 1, head_dim: 32}]}
cache: {layer: {component: mlx_lm.KVCache}}
workload: {prefill_chunk: 32, requests: [{prompt: 64, decode: 4}]}
variants: {only: {}}
"""


def runs(*peaks: int, **metrics) -> list[Summary]:
    return typed([summary("s", "v", peak=p, **metrics) for p in peaks])


def typed(measured: list[dict]) -> list[Summary]:
    """Each run's summary as run_variants gives it: run i's report is under run{i}/."""
    return [parse(Path(f"run{i}"), data) for i, data in enumerate(measured)]


def data(summary: Summary) -> dict:
    """The summary as its file holds it."""
    return json.loads(summary.to_json())


def chosen(result: Summary) -> int:
    return int(result.path.name.removeprefix("run"))


def test_the_median_run_stands_for_the_variant_with_the_spread():
    measured = runs(312 * MiB, 304 * MiB, 312 * MiB, 313 * MiB, 312 * MiB)
    result = combine(measured)
    assert chosen(result) == 2  # peaks in order: 304 (run 1), 312 (runs 0, 2, 4), 313 (run 3)
    assert result.metrics["peak"] == 312 * MiB
    assert data(result)["noise"] == {
        "runs": 5,
        "peak": {"min": 304 * MiB, "max": 313 * MiB, "spread": 9 * MiB,
                 "values": [312 * MiB, 304 * MiB, 312 * MiB, 313 * MiB, 312 * MiB]},
        "largest_spike": {"min": MiB, "max": MiB, "spread": 0, "values": [MiB] * 5},
        "nondeterministic": {}, "passed": 5}
    assert {k: v for k, v in data(result).items() if k != "noise"} == data(measured[2])
    assert chosen(combine(runs(12 * MiB, 10 * MiB))) == 1     # even count: the lower middle


def test_a_run_that_did_not_complete_fails_the_measurement():
    measured = [summary("s", "v", peak=10 * MiB) for _ in range(3)]
    measured[1] = summary("s", "v", status="failed")
    result = combine(typed(measured))
    assert (chosen(result), result.status, result.error) == (
        1, "failed", "run 2 of 3: child died with signal 11")
    assert "noise" not in data(result)
    measured[1] = {**summary("s", "v"), "metrics": {"wall_s": 0.2, "estimate": 1}}
    result = combine(typed(measured))
    assert (chosen(result), result.status, result.passed) == (1, "failed", False)
    assert result.error.startswith("run 2 of 3: status ok but metrics lack peak, steady")


def test_exact_metrics_that_differ_are_said_loudly():
    measured = [summary("s", "v", peak=10 * MiB) for _ in range(3)]
    measured[2] = summary("s", "v", peak=10 * MiB, steady=8 * MiB + 512)
    measured[0]["passed"] = False
    result = combine(typed(measured))
    assert data(result)["noise"]["nondeterministic"] == {"steady": {
        "min": 8 * MiB, "max": 8 * MiB + 512, "spread": 512,
        "values": [8 * MiB, 8 * MiB, 8 * MiB + 512]}}
    assert warnings([result]) == [
        ("s/v: steady differed across 3 runs (8,388,608 to 8,389,120 B): active bytes must be "
         "identical run to run; this is a real nondeterminism, not noise"),
        "s/v: expectations held in 2 of 3 runs"]
    text = io.StringIO()
    failed = parse(Path("w"), summary("s", "w", status="failed"))
    Console(file=text, width=200).print(table([result, failed]))
    assert "DIFFER: steady" in text.getvalue()
    assert "failed: child died with signal 11" in text.getvalue()
    assert warnings([combine(runs(MiB, MiB))]) == []
    assert block(runs(MiB, 3 * MiB)).spreads["peak"].spread == 2 * MiB


def test_noise_then_baseline_update_then_compare(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY_SCENARIO)
    code = main(["noise", "tiny.yaml", "--runs", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "kvmem run-to-run noise" in out and "identical" in out
    assert "record them with `kvmem baseline update --from reports-noise`" in out
    files = sorted(p.relative_to(tmp_path / "reports-noise").as_posix()
                   for p in (tmp_path / "reports-noise").rglob("*")
                   if p.is_file() and not p.name.startswith("."))
    assert files == ["tiny/only/holders.csv", "tiny/only/memory.png", "tiny/only/samples.csv",
                     "tiny/only/summary.json"]
    report = json.loads((tmp_path / "reports-noise/tiny/only/summary.json").read_text())
    noise = report["noise"]
    assert (noise["runs"], noise["nondeterministic"], noise["passed"]) == (2, {}, 2)
    peaks = noise["peak"]["values"]
    assert report["metrics"]["peak"] == min(peaks)                  # the lower of two
    assert noise["peak"] == {"min": min(peaks), "max": max(peaks),
                             "spread": max(peaks) - min(peaks), "values": peaks}
    assert len(noise["largest_spike"]["values"]) == 2

    code = main(["baseline", "update", "--reason", "test", "--from", "reports-noise"])
    assert (code, capsys.readouterr().out) == (0, "added tiny/only\n")
    stored = json.loads((tmp_path / "baselines/cpu/tiny/only.json").read_text())
    assert stored["noise"] == noise

    # The peak as the other run measured it is within the recorded spread: no change.
    other = {**report, "metrics": {**report["metrics"], "peak": max(peaks)}}
    other.pop("noise")
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "summary.json").write_text(json.dumps(other))
    code = main(["compare", "baselines", "head/summary.json", "--format", "json"])
    entry = json.loads(capsys.readouterr().out)["entries"][0]
    assert code == 0 and entry["verdict"] == "unchanged"
    assert entry["metrics"]["peak"]["noise"] == {
        "base": {"spread": max(peaks) - min(peaks), "runs": 2}, "head": None}
