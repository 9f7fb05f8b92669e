"""The judge recomputes the head's summaries from the rows of their report folders
(harness.gate.rejudge): an untampered report recomputes to its summary.json field by field,
and a summary.json that its rows contradict (a lowered peak, a finding deleted, an expectation
passed that the rows break) fails its variant with where it disagrees; rows missing or
unreadable fail the variant as a run that did not complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.common.units import MiB, format_bytes
from harness.gate.definition import HeadFiles
from harness.gate.rejudge import recomputed
from harness.store.summaries import summaries_under
from tests import test_gate_pr as scratch
from tests import test_gate_speed as speed
from tests.test_gate_bypasses import head_reports
from tests.test_gate_pr import commit, edit, gate

# The scratch repository, a pull request's branch of it, and a repository `kvmem init` made.
recorded, branch, adopted = scratch.recorded, scratch.branch, speed.adopted
# How a summary its rows contradict is judged, after where they disagree.
WHY = (": judged from the rows. The summary was rewritten, or written by other judging code "
       "than the judge's (a pull request that changes kvmem's detectors or metrics): it needs "
       "the `memory-accepted` label")

ROOT = Path(__file__).resolve().parent.parent
# Bundled variants whose rows hold what a CSV could lose: holders walked with pending arrays
# (buffers), cycle garbage (gc_deferred), a slice retaining its buffer, float ratios.
BUNDLED = {"canaries": ["slice", "cyclic"], "arrays_cache_advance": ["lazy"]}


@pytest.fixture(scope="module")
def bundled(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundled")
    for name, variants in BUNDLED.items():
        chosen = [arg for v in variants for arg in ("--variant", v)]
        assert scratch.cli("run", str(ROOT / "scenarios" / f"{name}.yaml"), *chosen,
                           "--out", str(out), "--jobs", "2") == 0
    return out


def fields(summary) -> dict:
    return json.loads(summary.to_json())


def recomputed_equal(reports: Path, paths: list[str]) -> None:
    written = summaries_under(reports)
    again = recomputed(written, HeadFiles(Path.cwd(), paths).spec)
    assert again.refused == {}
    assert len(again.summaries) == len(written) > 0
    for old, new in zip(written, again.summaries, strict=True):
        before, after = fields(old), fields(new)
        assert list(after) == list(before), old.label
        for key in before:
            assert after[key] == before[key], f"{old.label}: {key}"


def test_untampered_scratch_reports_recompute_to_their_summaries(recorded, monkeypatch):
    monkeypatch.chdir(recorded)
    recomputed_equal(Path("reports-main"), ["scenarios"])


def test_untampered_bundled_reports_recompute_to_their_summaries(bundled, monkeypatch):
    monkeypatch.chdir(ROOT)
    recomputed_equal(bundled, ["scenarios"])
    holders = fields(summaries_under(bundled / "arrays_cache_advance")[0])["holders"]
    assert holders["pending"]                           # what the round trip had to keep


def failed_entry(result: dict, variant: str) -> dict:
    entry = next(e for e in result["entries"] if e["variant"] == variant)
    assert entry["state"] == "failed"
    return entry


@pytest.mark.parametrize("repository", ["scratch", "kvmem init"])
def test_a_lowered_peak_fails_and_is_judged_from_the_rows(repository, request, tmp_path,
                                                          monkeypatch):
    """On this repository's scratch scenario and on the starter `kvmem init` writes."""
    source = request.getfixturevalue("recorded" if repository == "scratch" else "adopted")
    shutil.copytree(source, tmp_path / "repo")
    monkeypatch.chdir(tmp_path / "repo")
    scratch.git("checkout", "-q", "-b", "pr")
    label = "gate_pr/after" if repository == "scratch" else "kvmem_starter/preallocated"
    said: dict[str, int] = {}

    def lowered(data: dict) -> None:
        if f"{data['scenario']}/{data['variant']}" == label:
            said["rows"] = data["metrics"]["peak"]
            data["metrics"]["peak"] -= MiB

    code, comment, result = gate("--from", str(head_reports(lowered)))
    assert code == 1
    why = (f"summary.json says peak {format_bytes(said['rows'] - MiB)}; its rows give "
           f"{format_bytes(said['rows'])}{WHY}")
    assert f"💥 Failed (1): `{label}` ({why})" in comment.replace("\\`", "`")
    entry = failed_entry(result, label.partition("/")[2])
    assert entry["failure"] == why
    assert entry["metrics"]["peak"]["head"] == said["rows"]
    # Accepted (the head's kvmem judges otherwise): said in a note, and still judged from the
    # rows, so the acceptance cannot hide what they hold.
    code, comment, result = gate("--from", "reports-head", "--accept")
    assert code == 0
    assert f"{label}: {why}: accepted" in comment.replace("\\`", "`")
    assert all(e["state"] != "failed" for e in result["entries"])


def test_a_deleted_finding_fails(branch):
    def deleted(data: dict) -> None:
        if data["variant"] == "before":
            data["findings"] = []

    code, comment, result = gate("--from", str(head_reports(deleted)))
    assert code == 1
    failure = failed_entry(result, "before")["failure"]
    assert failure.startswith("summary.json says no finding; its rows give findings retained "
                              "(info: allocator holds ")
    assert "`gate_pr/before` (summary.json says no finding" in comment


def test_an_expectation_passed_that_the_rows_break_fails(branch):
    edit("  after: {}", "  after:\n    expect: {steady: 1 KiB}")
    commit("a budget the run breaks")

    def passed(data: dict) -> None:
        if data["variant"] == "after":
            data["expectations"].append({"name": "steady", "expected": "<= 1,024 B",
                                         "actual": "1,000 B", "ok": True,
                                         "message": "steady 1,000 B within 1,024 B"})

    code, _, result = gate("--from", str(head_reports(passed)))
    assert code == 1
    steady = json.loads(Path("reports-main/gate_pr/after/summary.json").read_text())[
        "metrics"]["steady"]
    assert failed_entry(result, "after")["failure"] == (
        "summary.json says 12 expectations held; its rows give 11 expectations held, failed: "
        f"steady: expected <= 1,024 B, got {steady:,} B; summary.json says it passed; its rows "
        "give a failure" + WHY)


@pytest.mark.parametrize("rows, problem", [
    (None, "samples.csv: missing: the report has no rows to judge"),
    ("step,phase,active\n0,idle,lots\n", "samples.csv: unreadable rows (column 'active' is not "
                                         "numeric)"),
])
def test_rows_missing_or_unreadable_fail_the_variant(branch, rows, problem):
    reports = head_reports(lambda data: None)
    samples = reports / "gate_pr/after/samples.csv"
    if rows is None:
        samples.unlink()
    else:
        samples.write_text(rows)
    code, comment, result = gate("--from", str(reports))
    assert code == 2
    why = f"the judge cannot recompute it: {samples}".removesuffix("samples.csv")
    assert f"{why}{problem}" in failed_entry(result, "after")["failure"]
    assert "💥 Failed (1): `gate_pr/after`" in comment


def test_a_summary_of_a_variant_no_scenario_file_defines_fails(branch):
    def ghost(data: dict) -> None:
        if data["variant"] == "after":
            data["scenario"] = "ghost"

    code, comment, result = gate("--from", str(head_reports(ghost)))
    assert code == 2
    failures = {(e["scenario"], e["variant"]): e["failure"] for e in result["entries"]}
    assert failures == {
        ("gate_pr", "after"): "the head still defines this variant, but its run left no "
                              "summary to judge",
        ("gate_pr", "before"): None,
        ("ghost", "after"): "failed: the judge cannot recompute it: no scenario file defines "
                            "ghost/after (its summary names scenarios/gate_pr.yaml)"}
    assert "`ghost/after` (head failed: the judge cannot recompute it" in comment
