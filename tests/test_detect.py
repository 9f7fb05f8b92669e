"""The detector registry: one entry in harness/detect.py configures, runs, checks and draws a
detector; nothing else changes when one is added."""

from __future__ import annotations

import dataclasses
import pickle

import pandas as pd
import pytest
from matplotlib.axes import Axes

from harness import detect, expect, report
from harness.detect import DETECTORS, Detector, Finding, Marker, Thresholds, from_hits
from harness.scenario import ScenarioError, load_variants
from harness.units import Size, format_bytes
from tests.conftest import make_spec, serve

WORKLOAD = {"requests": [{"prompt": 64, "decode": 4}]}   # 64 tokens of 16 KiB: a 1 MiB prefill


class TinyRiseThresholds(Thresholds):
    min_bytes: Size = 2**20


def tiny_rise(frame: pd.DataFrame, t: TinyRiseThresholds, backend: str) -> Finding | None:
    """Any step whose active memory rose by more than `min_bytes`."""
    excess = frame["active"].diff()
    hits = frame[excess > t.min_bytes]
    return from_hits("tiny_rise", hits, excess,
                     lambda at: f"active rose {excess[at]:,.0f} B at step {frame['step'][at]}")


TINY_RISE = Detector(tiny_rise, TinyRiseThresholds, None, Marker("*", "tab:olive"))


def scenario(tmp_path, text: str):
    path = tmp_path / "s.yaml"
    path.write_text("model: qwen3-8b\nworkload: {requests: [{prompt: 16}]}\n" + text)
    return path


@pytest.mark.parametrize("text, message", [
    ("detect: {tiny_rise: {min_bytes: 1 KiB}}\n", "detect.tiny_rise: unknown field"),
    ("expect: {tiny_rise: detected}\n", "expect.tiny_rise: unknown field"),
])
def test_an_unregistered_detector_is_an_unknown_field(tmp_path, text, message):
    with pytest.raises(ScenarioError, match=message):
        load_variants(scenario(tmp_path, text))


@pytest.mark.parametrize("text, message", [
    ("detect: {tiny_rise: {min_bytes: 1.5}}\n", "detect.tiny_rise.min_bytes: expected a size in bytes"),
    ("detect: {tiny_rise: {slope: 1}}\n", "detect.tiny_rise.slope: unknown field"),
    ("expect: {tiny_rise: maybe}\n", "expect.tiny_rise: Input should be 'none' or 'detected'"),
])
def test_a_registered_detectors_fields_are_validated_by_its_own_schema(tmp_path, monkeypatch,
                                                                        text, message):
    monkeypatch.setitem(DETECTORS, "tiny_rise", TINY_RISE)
    with pytest.raises(ScenarioError, match=message):
        load_variants(scenario(tmp_path, text))


def test_one_registry_entry_is_configured_expected_checked_and_drawn(tmp_path, monkeypatch):
    monkeypatch.setitem(DETECTORS, "tiny_rise", TINY_RISE)
    spec = make_spec(workload=WORKLOAD, detect={"tiny_rise": {"min_bytes": "64 KiB"}},
                     expect={"tiny_rise": "detected"})
    assert spec.detect.tiny_rise == TinyRiseThresholds(min_bytes=64 * 2**10)
    assert spec.detect.leak == detect.LeakThresholds()           # detectors not named: defaults
    assert pickle.loads(pickle.dumps(spec)) == spec                # as sent to a variant's child

    frame, findings, figures = serve(spec)
    (found,) = [f for f in findings if f.kind == "tiny_rise"]
    checks = {c["name"]: c for c in expect.check(spec.expect, findings, figures)}
    assert checks["tiny_rise"] == {"name": "tiny_rise", "expected": "detected",
                                   "actual": "detected", "ok": True, "message": found.message}

    drawn = []
    monkeypatch.setattr(Axes, "scatter", lambda ax, *args, **kw: drawn.append(kw))
    report.plot_variant(frame, findings, "tiny", tmp_path / "memory.png")
    assert {"marker": "*", "color": "tab:olive", "zorder": 5,
            "label": f"tiny_rise ({found.count})"} in drawn


def test_each_detector_declares_what_is_expected_when_a_scenario_states_nothing(monkeypatch):
    spec = make_spec(workload=WORKLOAD)
    assert (spec.expect.leak, spec.expect.retained, spec.expect.host_memory) == ("none",) * 3
    assert spec.expect.growth is None and spec.expect.spike is None

    monkeypatch.setitem(DETECTORS, "tiny_rise", dataclasses.replace(TINY_RISE, expected="none"))
    spec = make_spec(workload=WORKLOAD)
    _, findings, figures = serve(spec)
    (check,) = [c for c in expect.check(spec.expect, findings, figures) if c["name"] == "tiny_rise"]
    assert check["expected"] == "none" and not check["ok"]
    unchecked = make_spec(workload=WORKLOAD, expect={"tiny_rise": None})
    assert all(c["name"] != "tiny_rise" for c in expect.check(unchecked.expect, findings, figures))


def test_a_finding_is_reported_at_its_largest_excess_listing_the_first_steps():
    frame = pd.DataFrame({"step": range(30)})
    excess = pd.Series([float(i % 7) for i in range(30)])
    finding = from_hits("k", frame[excess > 0], excess, lambda at: f"worst at {at}")
    assert (finding.step, finding.bytes, finding.count) == (6, 6, 25)
    assert finding.message == "worst at 6"
    assert finding.steps == [s for s in range(30) if s % 7][:detect.MAX_STEPS_LISTED]
    assert from_hits("k", frame[excess > 9], excess, str) is None


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_the_module_docstring_gives_each_detectors_defaults_beside_its_formula(name):
    entry = DETECTORS[name]
    defaults = detect.__doc__.split(f"\n{name} (", 1)[1].split(")", 1)[0]
    for field, value in entry.thresholds().model_dump().items():
        assert f"{field} {value}" in defaults or f"{field} {format_bytes(value)}" in defaults
    assert ("expected none" if entry.expected == "none" else "checked only when stated") in defaults
