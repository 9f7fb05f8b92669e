"""The typed summary: what a run writes and a reader parses is one pydantic model, which keeps
what its writer gave and refuses a schema other than its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.common.units import MiB
from harness.gate.policy import PolicyChange, policy_changes
from harness.judge.summary import SCHEMA, SummaryError, summary_from_bytes
from harness.store.summaries import read_summary
from tests.summaries import summary

ROOT = Path(__file__).resolve().parent.parent
BASELINES = sorted((ROOT / "baselines").rglob("*.json"))


def test_every_committed_baseline_is_written_back_byte_for_byte():
    """A baseline records a report as it is: read into the typed model and written again, each
    committed file (with its noise block, model facts, store statistics or none) is unchanged."""
    assert len(BASELINES) >= 40
    changed = [path.relative_to(ROOT).as_posix() for path in BASELINES
               if read_summary(path).to_json() != path.read_text()]
    assert changed == []


def test_a_key_absent_from_a_file_stays_absent_and_an_unknown_one_is_kept():
    data = {**summary("s", "v"), "mine": {"kept": True}}
    del data["scenario_file"]
    written = json.loads(summary_from_bytes(Path("s.json"), json.dumps(data).encode()).to_json())
    assert "scenario_file" not in written and "description" not in written
    assert written["mine"] == {"kept": True} and list(written)[-1] == "mine"


def test_the_detector_settings_are_typed_and_written_back_as_the_file_gave_them():
    """A summary older than a detector (or a threshold) lacks its block (or key): read as the
    thresholds' models, it is written back without them, and the gate still sees them absent;
    a detector this kvmem does not know is kept."""
    detect = {"leak": {"warmup": 2, "min_bytes": 4096}, "host_memory": {"min_bytes": 1},
              "unbounded": {"budget": 3 * MiB}, "future": {"x": 1}}
    data = {**summary("s", "v"), "detect": detect}
    read = summary_from_bytes(Path("s.json"), json.dumps(data).encode())
    assert read.detect is not None and read.detect.unbounded.budget == 3 * MiB
    assert (read.detect.leak.warmup, read.detect.leak.r2) == (2, 0.9)   # a default not given
    assert read.detect.given() == detect
    assert json.loads(read.to_json())["detect"] == detect


def test_a_threshold_newer_than_this_kvmem_is_kept_as_the_file_gave_it():
    """The judge reads summaries a pull request's kvmem wrote: a key it added to a known
    detector is read, shown by `given()` in the file's order, and written back byte for byte,
    while the typed thresholds hold the known ones."""
    detect = {"spike": {"new_knob": 3, "min_bytes": 1}, "leak": {"min_bytes": 4096}}
    data = {**summary("s", "v"), "detect": detect}
    text = summary_from_bytes(Path("s.json"), json.dumps(data).encode()).to_json()
    assert json.loads(text)["detect"] == detect     # the summary's own order for its fields
    read = summary_from_bytes(Path("s.json"), text.encode())
    assert read.detect is not None and read.detect.given() == detect
    assert list(read.detect.given()["spike"]) == ["new_knob", "min_bytes"]
    assert (read.detect.spike.min_bytes, read.detect.spike.min_ratio) == (1, 1.05)
    assert not hasattr(read.detect.spike, "new_knob")
    assert read.to_json() == text


def test_the_gate_lists_a_threshold_the_head_adds_to_a_known_detector():
    def read(detect):
        data = {**summary("s", "v"), "detect": detect}
        return summary_from_bytes(Path("s.json"), json.dumps(data).encode())

    base, head = read({"spike": {"min_bytes": 1}}), read({"spike": {"min_bytes": 1, "new_knob": 3}})
    assert policy_changes(base, head) == [PolicyChange("detect.spike.new_knob", None, 3, False)]


def test_a_threshold_of_the_wrong_type_is_bad_input_naming_it():
    data = {**summary("s", "v"), "detect": {"leak": {"min_bytes": "lots"}}}
    with pytest.raises(SummaryError, match=r"s.json: not a valid summary \(detect.leak.min_bytes: "
                                           r"expected a size in bytes"):
        summary_from_bytes(Path("s.json"), json.dumps(data).encode())


@pytest.mark.parametrize("schema", [0, 2, "1", True, None])
def test_a_schema_no_upgrade_leads_from_is_bad_input(schema):
    data = {**summary("s", "v"), "schema": schema}
    with pytest.raises(SummaryError, match=rf"unsupported summary schema {json.dumps(schema)}, "
                                           rf"expected {SCHEMA}"):
        summary_from_bytes(Path("s.json"), json.dumps(data).encode())
