"""Baselines: recorded per backend, written atomically, checked against a new run of the suite."""

from __future__ import annotations

import json
import os
import re
from importlib import metadata

import pytest

from harness.cli import main
from harness.gate import baseline
from tests.summaries import TRIM_SCENARIO, MiB, summary, write

UPDATE = ["baseline", "update", "--reason", "test"]


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of one command (argparse's refusals included)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def reports(tmp_path):
    root = tmp_path / "reports"
    for item in (summary("trim", "before", retained=8 * MiB), summary("trim", "after"),
                 summary("rotating", "after", environment={"backend": "metal"}),
                 summary("crash", "v", status="failed")):
        write(root, item)
    return root


def test_update_writes_one_file_per_backend_scenario_variant(reports, tmp_path, capsys):
    code, out, err = cli([*UPDATE, "--from", str(reports),
                          "--dir", str(tmp_path / "baselines")], capsys)
    assert code == 2                                  # a failed run cannot be a baseline
    assert err == ("error: crash/v on cpu: failed (child died with signal 11): no baseline "
                   "written\n")
    files = sorted(p.relative_to(tmp_path / "baselines").as_posix()
                   for p in (tmp_path / "baselines").rglob("*"))
    assert files == ["cpu", "cpu/trim", "cpu/trim/after.json", "cpu/trim/before.json",
                     "metal", "metal/rotating", "metal/rotating/after.json"]
    assert out.splitlines() == ["added rotating/after on metal", "added trim/after on cpu",
                                "added trim/before on cpu"]
    stored = json.loads((tmp_path / "baselines/cpu/trim/before.json").read_text())
    recorded = stored.pop("recorded")               # who, when and why, beside the run's own
    assert stored == json.loads((reports / "trim/before/summary.json").read_text())
    assert (recorded["reason"], recorded["by"]) == ("test", baseline.recorder())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", recorded["at"])


def test_update_replaces_atomically(reports, tmp_path, capsys, monkeypatch):
    target = tmp_path / "baselines/cpu/trim/after.json"
    target.parent.mkdir(parents=True)
    target.write_text("old")
    real_replace = os.replace

    def full_disk(src, dst):                          # the rename never happens
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    code, _, err = cli([*UPDATE, "--from", str(reports / "trim"),
                        "--dir", str(tmp_path / "baselines")], capsys)
    assert code == 2 and "cannot write: No space left on device" in err
    assert target.read_text() == "old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["after.json"]   # no temp left

    monkeypatch.setattr(os, "replace", real_replace)
    code, _, _ = cli([*UPDATE, "--from", str(reports / "trim"),
                      "--dir", str(tmp_path / "baselines")], capsys)
    assert code == 0 and json.loads(target.read_text())["variant"] == "after"
    assert sorted(p.name for p in target.parent.iterdir()) == ["after.json", "before.json"]


def test_check_against_stored_baselines(reports, tmp_path, capsys):
    baselines = str(tmp_path / "baselines")
    write(reports, summary("grow", "kv"))
    cli([*UPDATE, "--from", str(reports), "--dir", baselines], capsys)
    code, out, _ = cli(["baseline", "check", "--from", str(reports / "trim"), "--dir", baselines],
                       capsys)
    # Reports given with --from stand for the whole suite: grow/kv, which they lack, is listed.
    assert (code, out) == (0, "✅ kvmem: no change (2 variants compared); 1 removed\n"
                              "  🗑️ Removed (1): grow/kv\n")

    head = tmp_path / "head"
    write(head, summary("trim", "before", retained=8 * MiB))
    write(head, summary("trim", "after", steady=8 * MiB + 4096))
    code, out, _ = cli(["baseline", "check", "--from", str(head), "--dir", baselines], capsys)
    assert code == 1
    assert out.splitlines()[:2] == [
        "🔴 kvmem: memory regression in 1 of 3 variants; 1 removed",
        "  regression  trim/after                               steady          8,388,608 B -> "
        " 8,392,704 B  +4 KiB (+0.049%)  tolerance 256 B"]


def test_check_without_baselines_for_the_backend(reports, tmp_path, capsys):
    code, out, err = cli(["baseline", "check", "--from", str(reports / "trim"),
                          "--dir", str(tmp_path / "none")], capsys)
    assert (code, out) == (2, "")
    assert err == (f"error: {tmp_path / 'none' / 'cpu'}: no baselines for backend cpu "
                   "(record them with `python -m harness baseline update`)\n")


def test_update_then_check_runs_the_suite(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)                       # the default suite is ./scenarios
    fixed, buggy = tmp_path / "scenarios" / "gate_trim.yaml", tmp_path / "buggy" / "gate_trim.yaml"
    for path, text in ((fixed, TRIM_SCENARIO),
                       (buggy, TRIM_SCENARIO.replace("trim: copy", "trim: slice"))):
        path.parent.mkdir()
        path.write_text(text)
    code, out, _ = cli(UPDATE, capsys)
    assert (code, out) == (0, "added gate_trim/after\n")
    assert (tmp_path / "baselines" / "cpu" / "gate_trim" / "after.json").is_file()

    stale = tmp_path / "baselines" / "cpu" / "stale" / "v.json"     # its scenario is gone
    stale.parent.mkdir()
    installed = {"mlx": metadata.version("mlx"), "mlx_lm": metadata.version("mlx-lm")}
    stale.write_text(json.dumps(summary("stale", "v", environment=installed)))  # one version
    code, out, _ = cli(["baseline", "check"], capsys)
    assert (code, out) == (0, "✅ kvmem: no change (1 variant compared); 1 removed\n"
                              "  🗑️ Removed (1): stale/v\n")

    code, out, _ = cli(["baseline", "check", str(buggy), "--format", "markdown",
                        "--out", "delta.md"], capsys)
    assert code == 1 and out.startswith("🔴 kvmem: memory regression in 1 of 1 variant\n")
    assert "| 🔴 | `gate_trim/after` | retained | 0 B | 560 KiB | **+560 KiB** (+573,440 B) |" \
        in (tmp_path / "delta.md").read_text()


def test_committed_baselines_are_valid_and_where_update_puts_them():
    from pathlib import Path

    from harness.gate.baseline import baseline_path
    from harness.store.summaries import summaries_under as load

    root = Path(__file__).resolve().parents[1] / "baselines"
    summaries = load(root)
    assert summaries and all(s.ok for s in summaries)
    assert all(baseline_path(root, s) == s.path for s in summaries)


@pytest.mark.parametrize("field, value, reason", [
    ("variant", "../../evil", "contains a path separator"),
    ("variant", "..", "is a relative folder"),
    ("scenario", ".", "is a relative folder"),
    ("scenario", "", "is empty"),
    ("scenario", "a\\b", "contains a path separator"),
    ("variant", "/tmp/evil", "contains a path separator"),
    ("variant", "C:evil", "is an absolute path"),
    ("variant", "ev\nil", "contains a control character"),
    ("environment.backend", "../cpu", "contains a path separator"),
])
def test_update_never_writes_outside_its_folder(tmp_path, capsys, field, value, reason):
    data = summary("s", "v")
    if field == "environment.backend":
        data["environment"]["backend"] = value
    else:
        data[field] = value
    reports = tmp_path / "deep" / "reports"
    write(reports, summary("good", "v"))
    bad = reports / "hand" / "written" / "summary.json"      # placed by hand, not by its names
    bad.parent.mkdir(parents=True)
    bad.write_text(json.dumps(data))
    code, out, err = cli([*UPDATE, "--from", str(reports),
                          "--dir", str(tmp_path / "deep" / "baselines")], capsys)
    assert (code, out) == (2, "")
    assert err == (f"error: {bad}: {field} {value!r} {reason}: it must be one plain name to "
                   "place a baseline\n")
    # Checked before anything is written: not even the good summary's baseline.
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")
                  if p.is_file()) == ["deep/reports/good/v/summary.json",
                                      "deep/reports/hand/written/summary.json"]


def test_update_refuses_an_ok_run_without_metrics(reports, tmp_path, capsys):
    empty = {**summary("trim", "after"), "metrics": {}}     # a child that stopped early
    (reports / "trim" / "after" / "summary.json").write_text(json.dumps(empty))
    code, out, err = cli([*UPDATE, "--from", str(reports / "trim"),
                          "--dir", str(tmp_path / "baselines")], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {reports / 'trim' / 'after' / 'summary.json'}: not a valid "
                          "summary (status ok but metrics lack peak, ")
    assert not (tmp_path / "baselines").exists()


def test_check_never_reads_interrupted_writes(reports, tmp_path, capsys):
    baselines = tmp_path / "baselines"
    cli([*UPDATE, "--from", str(reports / "trim"), "--dir", str(baselines)], capsys)
    folder = baselines / "cpu" / "trim"
    (folder / ".after.json.x7c2b1.json").write_text('{"schema": 1, "scenario": "tr')
    (folder / ".before.json.9f8e7d.json").write_text(json.dumps(summary("trim", "before",
                                                                      retained=64 * MiB)))
    code, out, err = cli(["baseline", "check", "--from", str(reports / "trim"),
                          "--dir", str(baselines)], capsys)
    assert (code, out, err) == (0, "✅ kvmem: no change (2 variants compared)\n", "")


def test_update_runs_option(reports, tmp_path, capsys):
    code, out, err = cli([*UPDATE, "--runs", "3", "--from", str(reports),
                          "--dir", str(tmp_path / "baselines")], capsys)
    assert (code, out) == (2, "")
    assert err == ("error: --runs 3 measures by running the suite; it cannot be combined with "
                   "--from (record `kvmem noise` reports instead)\n")
    code, _, err = cli([*UPDATE, "--runs", "0"], capsys)
    assert code == 2
    assert "--runs: expected a whole number of runs from 1 to 1000, got '0'" in err


# Accepting an intended change: update rewrites only what changed, and the gate then passes.

def files(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.json"))}


def test_an_intended_change_is_recorded_and_then_passes(tmp_path, capsys):
    baselines, base, head = (str(tmp_path / name) for name in ("baselines", "base", "head"))
    for item in (summary("cache", "grow", peak=100 * MiB, steady=64 * MiB),
                 summary("cache", "same", peak=100 * MiB), summary("chat", "v")):
        write(tmp_path / "base", item)
    code, out, err = cli([*UPDATE, "--from", base, "--dir", baselines], capsys)
    assert (code, out, err) == (0, "added cache/grow\nadded cache/same\nadded chat/v\n", "")
    recorded = files(tmp_path / "baselines")

    # The pull request grows cache/grow on purpose; cache/same moves within its noise
    # (+2 MiB of peak under the 4 MiB floor); a variant is added.
    for item in (summary("cache", "grow", peak=112 * MiB, steady=64 * MiB + 4096),
                 summary("cache", "same", peak=102 * MiB), summary("chat", "v"),
                 summary("chat", "w")):
        write(tmp_path / "head", item)
    code, out, _ = cli(["baseline", "check", "--from", head, "--dir", baselines], capsys)
    assert code == 1 and out.splitlines()[0] == "🔴 kvmem: memory regression in 1 of 4 variants; 1 new"

    code, out, err = cli([*UPDATE, "--from", head, "--dir", baselines], capsys)
    assert (code, err) == (0, "")
    assert out.splitlines() == ["updated cache/grow (peak +12 MiB, steady +4 KiB)",
                                "added chat/w", "kept 2 unchanged"]
    now = files(tmp_path / "baselines")
    assert {k: v for k, v in now.items() if k != "cpu/cache/grow.json" and k in recorded} == \
        {k: v for k, v in recorded.items() if k != "cpu/cache/grow.json"}      # byte for byte
    assert json.loads(now["cpu/cache/grow.json"])["metrics"]["peak"] == 112 * MiB
    assert json.loads(now["cpu/cache/same.json"])["metrics"]["peak"] == 100 * MiB
    assert sorted(now) == ["cpu/cache/grow.json", "cpu/cache/same.json", "cpu/chat/v.json",
                           "cpu/chat/w.json"]

    code, out, _ = cli(["baseline", "check", "--from", head, "--dir", baselines], capsys)
    assert (code, out) == (0, "✅ kvmem: no change (4 variants compared)\n")
    code, out, _ = cli(["compare", baselines, head], capsys)
    assert (code, out) == (0, "✅ kvmem: no change (4 variants compared)\n")
    code, out, _ = cli([*UPDATE, "--from", head, "--dir", baselines], capsys)
    assert (code, out) == (0, "kept 4 unchanged\n")
    assert files(tmp_path / "baselines") == now


def test_update_records_changed_tolerances_and_a_wider_spread(tmp_path, capsys):
    baselines = str(tmp_path / "baselines")
    write(tmp_path / "one", summary("s", "v", peak=300 * MiB))
    cli([*UPDATE, "--from", str(tmp_path / "one"), "--dir", baselines], capsys)
    loose = summary("s", "v", peak=300 * MiB, compare={"peak": {"abs": "16 MiB"}})
    write(tmp_path / "two", loose)
    code, out, _ = cli([*UPDATE, "--from", str(tmp_path / "two"), "--dir", baselines],
                       capsys)
    assert (code, out) == (0, "updated s/v (compare.peak 4 MiB → 16 MiB)\n")

    def spread_of(size: int) -> dict:
        return {"runs": 5, "nondeterministic": {}, "passed": 5,
                "peak": {"min": 300 * MiB - size, "max": 300 * MiB, "spread": size, "values": []}}

    # 1.5 x 8 MiB is under the 16 MiB floor: the gate would apply the same tolerance
    write(tmp_path / "under", {**loose, "noise": spread_of(8 * MiB)})
    code, out, _ = cli([*UPDATE, "--from", str(tmp_path / "under"),
                        "--dir", baselines], capsys)
    assert (code, out) == (0, "kept 1 unchanged\n")
    spread = spread_of(16 * MiB)                        # 24 MiB: wider than the floor
    write(tmp_path / "three", {**loose, "noise": spread})
    code, out, _ = cli([*UPDATE, "--from", str(tmp_path / "three"), "--dir",
                        baselines], capsys)
    assert (code, out) == (0, "updated s/v (peak spread 16 MiB over 5 runs)\n")
    narrower = {**spread, "peak": {**spread["peak"], "spread": 2 * MiB}}
    write(tmp_path / "four", {**loose, "noise": narrower})
    code, out, _ = cli([*UPDATE, "--from", str(tmp_path / "four"), "--dir",
                        baselines], capsys)
    assert (code, out) == (0, "kept 1 unchanged\n")      # the recorded, wider spread stays


def test_re_recording_leaves_a_baseline_whose_spread_moved_by_a_few_bytes(tmp_path, capsys):
    """Three runs of one variant whose peak moved by 48 B: under every floor, so its file keeps
    its bytes (an update once rewrote five unrelated baselines for spreads of 4 to 48 B)."""
    baselines = tmp_path / "baselines"
    write(tmp_path / "one", summary("s", "v", peak=300 * MiB))
    cli([*UPDATE, "--from", str(tmp_path / "one"), "--dir", str(baselines)], capsys)
    before = (baselines / "cpu/s/v.json").read_bytes()
    moved = {"runs": 3, "nondeterministic": {}, "passed": 3,
             "peak": {"min": 300 * MiB - 48, "max": 300 * MiB, "spread": 48, "values": []}}
    write(tmp_path / "two", {**summary("s", "v", peak=300 * MiB), "noise": moved})
    code, out, _ = cli([*UPDATE, "--from", str(tmp_path / "two"), "--dir", str(baselines)], capsys)
    assert (code, out) == (0, "kept 1 unchanged\n")
    assert (baselines / "cpu/s/v.json").read_bytes() == before


def _failing(data: dict) -> dict:
    data["expectations"] = [{"name": "retained", "expected": "none", "actual": "detected",
                             "ok": False, "message": "allocator holds 8 MiB beyond ..."}]
    data["passed"] = False
    return data


def test_update_refuses_a_failed_run(tmp_path, capsys):
    reports, baselines = tmp_path / "reports", str(tmp_path / "baselines")
    write(reports, _failing(summary("trim", "after", retained=8 * MiB)))
    write(reports, summary("trim", "crash", status="refused"))
    write(reports, summary("trim", "fine"))
    code, out, err = cli([*UPDATE, "--from", str(reports), "--dir", baselines],
                         capsys)
    assert (code, out) == (2, "added trim/fine\n")
    assert err.splitlines() == [
        "error: trim/after: expectations failed (retained: expected none, got detected); a "
        "baseline records only a run that meets them: fix the run, or state what it should "
        "expect in its scenario: no baseline written",
        "error: trim/crash: refused (child died with signal 11): no baseline written"]
    assert sorted(files(tmp_path / "baselines")) == ["cpu/trim/fine.json"]
    code, _, err = cli([*UPDATE, "--from", str(reports), "--dir",
                        baselines, "--allow-failed"], capsys)  # no switch records it anyway
    assert (code, err) == (2, "error: kvmem: unrecognized arguments: --allow-failed\n")


@pytest.mark.parametrize("reason", ["", "   ", "two\nlines", "x" * 501])
def test_update_asks_for_a_reason_of_one_line(tmp_path, capsys, reason):
    code, _, err = cli(["baseline", "update", "--reason", reason, "--from", str(tmp_path)], capsys)
    assert code == 2
    assert err.startswith("error: kvmem baseline update: argument --reason: expected one line of "
                          "up to 500 characters saying why, got ")
