"""The metric registry: one entry in harness/metrics.py computes, records, gates and renders a
metric; nothing else changes when one is added."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from harness.common.units import Size
from harness.gate import compare as cmp
from harness.gate import history
from harness.gate.formats import render_json
from harness.gate.render import render_markdown, render_text
from harness.judge import metrics
from harness.judge.metrics import EXACT_KIND, HIGHER, METRICS, Gate, Metric
from harness.judge.summary import parse
from tests.conftest import make_spec, serve
from tests.summaries import MiB, summary

# MLX's buffer cache at the last sample: a metric no summary carried before.
CACHE_AT_END = Metric(lambda s: int(s.frame["cache"].iloc[-1]), gate=Gate(rel=0.0, abs=64 * 1024),
                      kind=EXACT_KIND)


def test_a_registered_metric_is_computed_in_registry_order(monkeypatch):
    monkeypatch.setitem(METRICS, "cache_at_end", CACHE_AT_END)
    frame, _, figures = serve(make_spec(workload={"requests": [{"prompt": 64, "decode": 4}]}))
    # Every metric in registry order, but a synthetic run's missing fact: it served no weights.
    assert list(figures) == [name for name in METRICS if name != "weights"]
    assert figures["cache_at_end"] == int(frame["cache"].iloc[-1])


def test_a_registered_metric_is_compared_and_rendered(monkeypatch):
    monkeypatch.setitem(METRICS, "cache_at_end", CACHE_AT_END)
    base = parse(Path("b"), summary("s", "v", cache_at_end=1 * MiB))
    head = parse(Path("h"), summary("s", "v", cache_at_end=3 * MiB))
    comparison = cmp.compare([base], [head])
    (entry,) = comparison.regressions
    assert [(d.metric, d.base, d.head, d.verdict) for d in entry.changed] == [
        ("cache_at_end", 1 * MiB, 3 * MiB, "regression")]
    assert "cache_at_end" in render_text(comparison)
    assert "| `s/v` | cache_at_end | 1 MiB | 3 MiB | **+2 MiB** (+2,097,152 B) | +200.0% | 64 KiB |" \
        in render_markdown(comparison)
    assert json.loads(render_json(comparison))["entries"][0]["metrics"]["cache_at_end"]["verdict"] \
        == "regression"
    feed = history.benchmark_entries([head])
    assert {"name": "s/v cache_at_end", "unit": "bytes", "value": 3 * MiB} \
        .items() <= next(e for e in feed if e["name"] == "s/v cache_at_end").items()


def test_a_registered_metric_is_shown_and_bounded(tmp_path, monkeypatch, capsys):
    """With a column, `kvmem show` (and `run`) shows it; with a budget (and its field in
    ExpectSpec), a scenario bounds it under `expect:`, checked in the registry's order after
    the others."""
    from harness.cli import main
    from harness.judge.expect import ExpectSpec, check

    class BoundedExpect(ExpectSpec):
        cache_at_end: Size | None = None

    monkeypatch.setitem(METRICS, "cache_at_end", replace(CACHE_AT_END, column=True,
                                                         budget="cache_at_end"))
    spec = make_spec(workload={"requests": [{"prompt": 64, "decode": 4}]}).model_copy(
        update={"expect": BoundedExpect.model_validate({"cache_at_end": "1 B"})})
    _, findings, figures = serve(spec)
    (bound,) = [e for e in check(spec.expect, findings, figures) if e.name == "cache_at_end"]
    assert (bound.expected, bound.ok) == ("<= 1 B", figures["cache_at_end"] <= 1)
    path = tmp_path / "s" / "v" / "summary.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(summary("s", "v", cache_at_end=3 * MiB)))
    assert main(["show", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    (header,) = [line for line in lines if "┃ scenario" in line]
    (row,) = [line for line in lines if line.startswith("│ s ")]
    columns = [cell.strip() for cell in header.strip("┃").split("┃")]
    assert [cell.strip() for cell in row.strip("│").split("│")][columns.index(
        "cache_at_end MiB")] == "3.0"


def test_a_metric_missing_from_an_older_summary_is_not_compared(monkeypatch):
    """A metric added later is not required of the summaries recorded before it."""
    monkeypatch.setitem(METRICS, "cache_at_end", CACHE_AT_END)
    old = parse(Path("b"), summary("s", "v"))
    assert old.incomplete is None
    entry = cmp.compare([old], [parse(Path("h"), summary("s", "v", cache_at_end=MiB))]).entries[0]
    assert "cache_at_end" not in {d.metric for d in entry.deltas}


def test_direction_decides_which_change_is_a_regression(monkeypatch):
    monkeypatch.setitem(METRICS, "hit_rate", Metric(lambda s: 0, unit=metrics.RATIO,
                                                    gate=Gate(rel=0.0, abs=0.01), direction=HIGHER))
    base = parse(Path("b"), summary("s", "v", hit_rate=0.9))
    lower = cmp.compare([base], [parse(Path("h"), summary("s", "v", hit_rate=0.5))])
    higher = cmp.compare([base], [parse(Path("h"), summary("s", "v", hit_rate=0.95))])
    assert (lower.verdict, higher.verdict) == ("regression", "improvement")
    assert "0.500×" in render_text(lower)


def test_the_gated_metrics_are_the_eight_every_summary_carries_buffers_and_host_rate():
    """buffers and host_rate came later: a summary recorded before them lacks them, so they are
    not required."""
    assert metrics.gated() == ["peak", "steady", "final", "largest_spike", "leak_rate", "retained",
                               "buffers", "rss_peak", "host_rate", "overhead_ratio"]
    assert [n for n, m in METRICS.items() if m.required] == [
        n for n in metrics.gated() if n not in ("buffers", "host_rate")]
    assert (metrics.noisy(), metrics.exact()) == (
        ["peak", "largest_spike"], ["steady", "final", "leak_rate", "retained", "buffers"])
