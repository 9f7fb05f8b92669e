"""The regression gate on summaries written in the report schema: verdicts, tolerances, outputs."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.cli import main
from harness.common.units import GiB, format_bytes
from harness.gate import compare as cmp
from harness.gate import tolerance
from harness.gate.render import COMMENT_LIMIT, MARKER, render_markdown, sparkline
from harness.gate.tolerance import SMALL_LEAST, Tolerance
from harness.judge.summary import Noise, parse
from harness.store.summaries import summaries_under
from tests.summaries import TRIM_SCENARIO, MiB, summary, write


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["compare", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def why_lines(markdown: str) -> list[str]:
    """The lines under the comment's "Why" heading up to the next blank line after the first:
    one regressed variant's explanation."""
    lines = markdown.splitlines()
    why = lines.index("Why, in the head run's own words:")
    end = lines.index("", why + 2)
    return lines[why + 1:end + 1]


def suites(tmp_path, base: list[dict], head: list[dict]) -> tuple[str, str]:
    for root, items in (("base", base), ("head", head)):
        (tmp_path / root).mkdir()
        for item in items:
            write(tmp_path / root, item)
    return str(tmp_path / "base"), str(tmp_path / "head")


def pair(base: dict, head: dict) -> cmp.Comparison:
    from pathlib import Path
    return cmp.compare([parse(Path("base.json"), base)],
                       [parse(Path("head.json"), head)])


def verdicts(comparison: cmp.Comparison) -> dict[str, str]:
    return {d.metric: d.verdict for e in comparison.entries for d in e.deltas}


def test_identical_suites_say_no_change(tmp_path, capsys):
    items = [summary("trim", "before", retained=8 * MiB), summary("trim", "after")]
    base, head = suites(tmp_path, items, items)
    code, out, _ = run([base, head, "--format", "markdown"], capsys)
    assert code == 0
    assert out.splitlines()[0] == MARKER
    assert out.splitlines()[1] == "### ✅ kvmem: no change (2 variants compared)"
    assert "<details><summary>2 variants unchanged</summary>" in out
    assert "| 🔴" not in out and "| 🟢" not in out


def test_peak_noise_is_absorbed_and_no_more():
    base = summary("s", "v", peak=100 * MiB)
    assert verdicts(pair(base, summary("s", "v", peak=100 * MiB + 4 * MiB)))["peak"] == "unchanged"
    assert verdicts(pair(base, summary("s", "v", peak=100 * MiB + 4 * MiB + 1)))["peak"] == "regression"
    assert verdicts(pair(base, summary("s", "v", peak=95 * MiB)))["peak"] == "improvement"


def test_active_byte_metrics_are_exact():
    base = summary("s", "v", steady=8 * MiB, retained=0, leak_rate=0)
    head = summary("s", "v", steady=8 * MiB + 512, retained=256, leak_rate=300)
    result = verdicts(pair(base, head))
    assert result["steady"] == "regression"      # one token of a 2x64 fp16 layer: 512 B
    assert result["retained"] == "unchanged"     # within the 256 B floor
    assert result["leak_rate"] == "regression"
    delta = next(d for d in pair(base, head).entries[0].deltas if d.metric == "steady")
    assert (delta.delta, delta.relative) == (512, 512 / (8 * MiB))


def test_rss_is_generous():
    base = summary("s", "v", rss_peak=400 * MiB)
    assert verdicts(pair(base, summary("s", "v", rss_peak=460 * MiB)))["rss_peak"] == "unchanged"
    assert verdicts(pair(base, summary("s", "v", rss_peak=480 * MiB)))["rss_peak"] == "regression"


def test_scenario_tolerance_then_command_line_override(tmp_path, capsys):
    loose = {"peak": {"rel": 0.5, "abs": "8 MiB"}}
    base, head = suites(tmp_path, [summary("s", "v", peak=20 * MiB, compare=loose)],
                        [summary("s", "v", peak=29 * MiB, compare=loose)])
    code, out, _ = run([base, head], capsys)
    assert (code, out) == (0, "✅ kvmem: no change (1 variant compared)\n")   # +9 < 50% of 20
    code, out, _ = run([base, head, "--rel", "peak=0.25"], capsys)
    assert code == 1 and "+9 MiB" in out and "+45.0%" in out
    code, out, _ = run([base, head, "--rel", "peak=0", "--abs", "peak=10 MiB"], capsys)
    assert code == 0


def test_tolerances_come_from_the_base_and_a_changed_policy_is_said(tmp_path, capsys):
    """A head that loosens its own tolerances is still judged by the base's, and the comment
    says in its first lines that the head changes them."""
    loose = {"peak": {"rel": 0.5, "abs": "8 MiB"}}
    grown = summary("s", "v", peak=29 * MiB, compare=loose)
    grown["expectations"] = [{"name": "retained", "expected": "detected", "actual": "none",
                              "ok": True, "message": "no retained finding"}]
    other = summary("t", "w", steady=4 * MiB, compare={"steady": {"abs": "1 MiB"}})
    base, head = suites(tmp_path, [summary("s", "v", peak=20 * MiB), summary("t", "w")],
                        [grown, other])
    code, out, _ = run([base, head], capsys)
    assert code == 1                                  # the base's 4 MiB floor judges +9 MiB
    assert out.splitlines() == [
        "🔴 kvmem: memory regression in 1 of 2 variants",
        "⚠️ The head changes tolerances or expectations of 2 variants: s/v (compare.peak, "
        "expect.retained), t/w (compare.steady); the base's apply",
        ("  regression  s/v                                      peak                 20 MiB -> "
         "      29 MiB  +9 MiB (+45.0%)  tolerance 4 MiB"),
        ("  improvement t/w                                      steady                8 MiB -> "
         "       4 MiB  -4 MiB (-50.0%)  tolerance 256 B")]
    code, out, _ = run([base, head, "--format", "markdown"], capsys)
    assert out.splitlines()[:4] == [
        MARKER, "### 🔴 kvmem: memory regression in 1 of 2 variants", "",
        "> ⚠️ The head changes tolerances or expectations of 2 variants: `s/v` (compare.peak, "
        "expect.retained), `t/w` (compare.steady); the base's apply"]
    code, out, _ = run([base, head, "--format", "json"], capsys)
    assert json.loads(out)["policy_changes"] == {"s/v": ["compare.peak", "expect.retained"],
                                                 "t/w": ["compare.steady"]}
    # The command line still overrides the base's.
    code, out, _ = run([base, head, "--abs", "peak=10 MiB"], capsys)
    assert code == 0 and out.startswith("🟢 kvmem: memory improved in 1 variant, no regression\n"
                                        "⚠️ The head changes tolerances")


def test_new_removed_and_failed_are_listed(tmp_path, capsys):
    base, head = suites(
        tmp_path,
        [summary("old", "v"), summary("kept", "v"), summary("crash", "v")],
        [summary("kept", "v"), summary("fresh", "v"), summary("crash", "v", status="failed")])
    code, out, _ = run([base, head], capsys)
    assert code == 1                                   # the head run died where the base ran
    assert "🆕 New (1): fresh/v" in out
    assert "🗑️ Removed (1): old/v" in out
    assert "💥 Failed (1): crash/v (head failed: child died with signal 11)" in out
    assert out.startswith("🔴 kvmem: memory regression in 1 of 4 variants; 1 new, 1 removed, 1 failed")


def test_a_head_that_did_not_complete_fails_even_where_the_base_failed_too():
    """A failure cannot be recorded away: a base that failed the same way does not excuse it."""
    failed = summary("s", "v", status="refused")
    failed["error"] = "estimated footprint 30.00 GiB exceeds the 20.00 GiB available\nTraceback"
    comparison = pair(failed, failed)
    assert comparison.entries[0].state == cmp.FAILED
    assert comparison.entries[0].note == (
        "base refused: estimated footprint 30.00 GiB exceeds the 20.00 GiB available; "
        "head refused: estimated footprint 30.00 GiB exceeds the 20.00 GiB available")
    assert comparison.entries[0].failure == (
        "refused: estimated footprint 30.00 GiB exceeds the 20.00 GiB available")
    assert comparison.exit_code == 1


def test_a_head_that_breaks_its_own_expectations_is_a_regression_whatever_its_figures():
    """A canary whose detector was blinded has lower figures than its base: it still fails."""
    base = summary("s", "v", peak=20 * MiB)
    blinded = summary("s", "v", peak=10 * MiB)
    blinded["expectations"] = [{"name": "leak", "expected": "detected", "actual": "none",
                                "ok": False, "message": "no leak finding"}]
    blinded["passed"] = False
    entry = pair(base, blinded).entries[0]
    assert [d.verdict for d in entry.changed] == ["improvement"]
    assert entry.failure == "fails its own expectations (leak: expected detected, got none)"
    assert entry.verdict == "regression"
    comparison = cmp.compare([], [parse(Path("head.json"), blinded)])
    assert (comparison.entries[0].state, comparison.exit_code) == (cmp.NEW, 1)


def test_backend_mismatch_is_said_and_never_a_regression(tmp_path, capsys):
    base, head = suites(tmp_path, [summary("s", "v", environment={"backend": "metal"})],
                        [summary("s", "v", peak=100 * MiB)])
    code, out, _ = run([base, head, "--format", "markdown"], capsys)
    assert code == 0
    assert "> ⚠️ backends differ (base metal, head cpu): results across backends are not compared" in out
    assert "⛔ Not compared (1): `s/v` (backend metal vs cpu: not compared)" in out
    assert "kvmem: nothing compared" in out


def test_mlx_version_mismatch_is_said():
    comparison = pair(summary("s", "v"), summary("s", "v", environment={"mlx": "0.33.0"}))
    assert comparison.entries[0].state == cmp.COMPARED
    assert comparison.notes == ("mlx/mlx-lm versions differ (base 0.32.4/0.32.2, head "
                                "0.33.0/0.32.2): deltas include MLX's own changes",)


@pytest.mark.parametrize("content, message", [
    ("{not json", "not a valid summary (corrupt JSON"),
    ("[1, 2]", "not a valid summary (expected a JSON object)"),
    ('{"schema": 7}', "unsupported summary schema 7, expected 1"),
    ('{"schema": 1, "scenario": "s", "variant": "v", "status": "ok"}',
     "metrics: expected an object of metrics, got nothing"),
    (b"\xff\xfe\x00", "not a valid summary"),
    ("1" * 5000, "not a valid summary (corrupt JSON: Exceeds the limit"),
    ("[" * 100_000 + "]" * 100_000, "not a valid summary (JSON nested too deeply"),
])
def test_corrupt_summary_is_a_clear_error(tmp_path, capsys, content, message):
    base, head = suites(tmp_path, [summary("s", "v")], [summary("s", "v")])
    bad = tmp_path / "head" / "s" / "v" / "summary.json"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, out, err = run([base, head], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"error: {bad}: ") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["missing", "head"], "missing: no such file or folder"),
    (["base", "head", "--rel", "pek=0.1"], "--rel pek=0.1: expected METRIC=VALUE"),
    (["base", "head", "--abs", "peak=lots"], "'lots': expected a size in bytes"),
    (["base", "head", "--rel", "peak=x"], "not a fraction: 'x'"),
    (["base", "head", "--rel", "peak=-0.1"], "not a fraction: '-0.1'"),
    (["base", "head", "--out", "head/s"], "error: head/s: cannot write: Is a directory"),
])
def test_bad_arguments_exit_2(tmp_path, capsys, monkeypatch, argv, message):
    suites(tmp_path, [summary("s", "v")], [summary("s", "v")])
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    code, _, err = run(argv, capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_two_summaries_for_one_variant_are_ambiguous(tmp_path, capsys):
    base, head = suites(tmp_path, [summary("s", "v")], [summary("s", "v")])
    write(tmp_path / "head" / "again", summary("s", "v"))
    code, _, err = run([base, head], capsys)
    assert code == 2
    assert err == (f"error: two summaries for s/v on backend cpu: {head}/again/s/v/summary.json "
                   f"and {head}/s/v/summary.json\n")


def test_markdown_shows_changed_rows_with_bytes_percent_and_sparklines(tmp_path, capsys):
    base, head = suites(
        tmp_path,
        [summary("trim", "after", retained=0, steady=8 * MiB), summary("grow", "kv")],
        [summary("trim", "after", retained=8 * MiB, steady=16 * MiB), summary("grow", "kv")])
    code, out, _ = run([base, head, "--format", "markdown"], capsys)
    assert code == 1
    lines = out.splitlines()
    assert lines[:2] == [MARKER, "### 🔴 kvmem: memory regression in 1 of 2 variants"]
    assert ("| 🔴 | `trim/after` | steady | 8 MiB | 16 MiB | **+8 MiB** (+8,388,608 B) | +100.0% "
            "| 256 B |" in lines)
    assert ("| 🔴 | `trim/after` | retained | 0 B | 8 MiB | **+8 MiB** (+8,388,608 B) | new "
            "| 256 B |" in lines)
    assert not any(line.startswith("| ⚪") for line in lines)
    spark = [line.split() for line in lines if line.startswith(("trim/after base", "  "))]
    assert [(row[-5], row[-2]) for row in spark] == [("base", "8"), ("head", "16")]
    base_blocks, head_blocks = spark[0][-4], spark[1][-4]    # one scale: 128 KiB .. 16 MiB
    assert len(base_blocks) == len(head_blocks) == 64
    assert base_blocks[0] == head_blocks[0] == "▁" and base_blocks[-1] == "▄" and head_blocks[-1] == "█"
    assert "<details><summary>1 variant unchanged</summary>" in out and "`grow/kv`" in out


def test_sparkline_scale():
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7, 8], 0, 8) == "▁▂▃▄▅▆▇██"
    assert sparkline([5, 5], 5, 5) == "▁▁"


def test_format_bytes():
    assert [format_bytes(v) for v in (0, 512, 1536, 8 * MiB, 5 * GiB)] == \
        ["0 B", "512 B", "1.5 KiB", "8 MiB", "5 GiB"]
    assert format_bytes(-3 * MiB, signed=True) == "-3 MiB"


def test_comment_for_many_changed_rows_stays_under_the_cap():
    from pathlib import Path
    base = [parse(Path(f"b{i}"), summary(f"scenario_{i:03d}", "variant_with_a_long_name"))
            for i in range(400)]
    head = [parse(Path(f"h{i}"), summary(
        f"scenario_{i:03d}", "variant_with_a_long_name", peak=50 * MiB, steady=9 * MiB,
        final=2 * MiB, retained=1 * MiB, leak_rate=4096, largest_spike=9 * MiB,
        rss_peak=900 * MiB, overhead_ratio=2.0)) for i in range(400)]
    text = render_markdown(cmp.compare(base, head))
    assert len(text) <= COMMENT_LIMIT < 65_536
    assert text.startswith(MARKER + "\n### 🔴 kvmem: memory regression in 400 of 400 variants")
    truncated = [line for line in text.splitlines() if line.startswith("_Truncated: ")]
    shown = sum(line.startswith("| 🔴") for line in text.splitlines())
    assert len(truncated) == 1 and 100 < shown < 3200
    assert text.count("```") % 2 == 0 and text.count("<details>") == text.count("</details>")


def test_a_first_run_lists_new_variants_in_one_short_line():
    from pathlib import Path
    head = [parse(Path(f"h{i}"), summary(f"s{i:02d}", "v")) for i in range(30)]
    text = render_markdown(cmp.compare([], head))
    assert text.splitlines()[1:4] == ["### ⚠️ kvmem: nothing compared; 30 new", "",
                                      "> ⚠️ the base has no summaries: every variant is new"]
    new = next(line for line in text.splitlines() if line.startswith("- 🆕"))
    assert new == "- 🆕 New (30): " + ", ".join(f"`s{i:02d}/v`" for i in range(20)) + " and 10 more"


def test_json_and_junit(tmp_path, capsys):
    base, head = suites(tmp_path, [summary("s", "a"), summary("s", "b"), summary("s", "gone")],
                        [summary("s", "a", final=2 * MiB), summary("s", "b")])
    code, out, _ = run([base, head, "--format", "json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["verdict"] == "regression"
    final = data["entries"][0]["metrics"]["final"]
    assert (final["base"], final["head"], final["delta"], final["verdict"]) == \
        (MiB, 2 * MiB, MiB, "regression")
    assert [e["state"] for e in data["entries"]] == ["compared", "compared", "removed"]

    out_file = tmp_path / "out" / "junit.xml"
    code, out, _ = run([base, head, "--format", "junit", "--out", str(out_file)], capsys)
    suite = ET.parse(out_file).getroot().find("testsuite")
    assert code == 1 and out.startswith("🔴")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"),
            suite.get("skipped")) == ("3", "1", "0", "1")
    failure = suite.find("testcase[@name='a']/failure")
    assert failure.get("message") == "final: 1 MiB -> 2 MiB (+1 MiB, +100.0%)"
    assert junit_problems(out_file.read_text()) == []


# End to end: real runs of a small prefix-store scenario through the engine.

RUNS = 10


def run_trim(root: Path, runs: int, scenario: str = TRIM_SCENARIO) -> list[Path]:
    """`runs` report folders of one scenario file, each run in turn."""
    import io

    from rich.console import Console

    from harness.pipeline.suite import run_variants
    from harness.scenario import load_variants as load

    path = root / "scenario.yaml"
    path.write_text(scenario)
    quiet = Console(file=io.StringIO())
    folders = [root / f"run{i}" for i in range(runs)]
    for out in folders:
        run_variants(load(path), out, quiet)
    return folders


@pytest.fixture(scope="module")
def trim_runs(tmp_path_factory):
    """Two runs of the fixed store (trim: copy) and one with its buggy value (trim: slice)."""
    runs = run_trim(tmp_path_factory.mktemp("gate"), 2)
    (bug,) = run_trim(tmp_path_factory.mktemp("bug"), 1,
                      TRIM_SCENARIO.replace("trim: copy", "trim: slice"))
    return runs, bug


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from harness.cli import main

    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_buggy_option_is_a_regression_naming_variant_and_bytes(trim_runs):
    import subprocess
    import sys

    runs, bug = trim_runs
    result = subprocess.run([sys.executable, "-m", "harness", "compare", str(runs[0]), str(bug),
                             "--format", "markdown"], capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1] == "### 🔴 kvmem: memory regression in 1 of 1 variant"
    # Slicing keeps each stored request's whole KVCache buffer: (256-108) + (356-148) +
    # (512-308) = 560 unused slots of 2 layers x 512 B.
    assert ("| 🔴 | `gate_trim/after` | retained | 0 B | 560 KiB | **+560 KiB** (+573,440 B) "
            "| new | 256 B |") in lines
    assert any(line.startswith("| 🔴 | `gate_trim/after` | final |") and "+573,440 B" in line
               for line in lines)
    # Not asserted: peak, +356 KiB against a floor of half the ~1.2 MiB base peak. Beside the
    # suite's other processes a single run's peak moved past it once in four suites.


def test_the_trim_regression_is_explained_by_its_finding_and_expectation(trim_runs, capsys):
    runs, bug = trim_runs
    url = "https://github.com/o/r/actions/runs/1/artifacts/2"
    code, out, _ = cli(["compare", str(runs[0]), str(bug), "--format", "markdown",
                        "--artifact-url", url], capsys)
    assert code == 1
    # The scenario's retained threshold (256 KiB) sees the 560 KiB the slices keep alive.
    assert why_lines(out) == [
        "", "- `gate_trim/after`",
        "  - finding `retained` (new): allocator holds 0.55 MiB beyond the 0.55 MiB the "
        "components report, at step 41 (idle); held by "
        "`reference_impl.prefix_cache:PrefixCache._entries[*][*].keys` (280 KiB, 6 arrays) and "
        "1 more",
        "  - grew most at rest: `reference_impl.prefix_cache:PrefixCache._entries[*][*].keys` "
        "(+280 KiB since the base)",
        "  - expectation `retained` fails: expected none, got detected (it held in the base)",
        f"  - plots: {url}", ""]
    code, out, _ = cli(["compare", str(runs[0]), str(bug)], capsys)
    assert "    finding retained (new): allocator holds 0.55 MiB beyond the 0.55 MiB the " \
        "components report, at step 41 (idle); held by " \
        "reference_impl.prefix_cache:PrefixCache._entries[*][*].keys (280 KiB, 6 arrays) and " \
        "1 more" in out.splitlines()


def test_a_run_compared_with_itself_says_no_change(trim_runs, capsys):
    runs, _ = trim_runs
    code, out, _ = cli(["compare", str(runs[0]), str(runs[0])], capsys)
    assert (code, out) == (0, "✅ kvmem: no change (1 variant compared)\n")


def no_change_pairwise(runs: list[Path], capsys) -> None:
    """Every pair of runs compares as no change; the exact metrics are equal in all."""
    loaded = [summaries_under(run)[0] for run in runs]
    for metric in ("steady", "final", "retained", "leak_rate"):       # exact on one backend
        assert len({s.metric(metric) for s in loaded}) == 1, metric
    peaks = [s.metric("peak") for s in loaded]
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            code, out, err = cli(["compare", str(runs[i]), str(runs[j])], capsys)
            assert (code, err) == (0, ""), f"runs {i} and {j}, peaks {peaks}: {out}"
            assert out == "✅ kvmem: no change (1 variant compared)\n"


def test_two_runs_compared_raise_no_regression(trim_runs, capsys):
    no_change_pairwise(trim_runs[0], capsys)


@pytest.mark.slow
def test_ten_runs_compared_pairwise_raise_no_regression(tmp_path, capsys):
    no_change_pairwise(run_trim(tmp_path, RUNS), capsys)


def test_real_reports_removed_new_backend_and_corrupt(trim_runs, tmp_path, capsys):
    import shutil

    runs, _ = trim_runs
    summary_file = runs[0] / "gate_trim" / "after" / "summary.json"
    data = json.loads(summary_file.read_text())
    renamed = tmp_path / "renamed"
    write(renamed, {**data, "scenario": "gate_trim_v2"})
    code, out, _ = cli(["compare", str(runs[0]), str(renamed)], capsys)
    assert code == 0
    assert out.splitlines() == ["⚠️ kvmem: nothing compared; 1 new, 1 removed",
                                "  🆕 New (1): gate_trim_v2/after",
                                "  🗑️ Removed (1): gate_trim/after"]

    metal = tmp_path / "metal"
    write(metal, {**data, "environment": {**data["environment"], "backend": "metal"},
                  "metrics": {**data["metrics"], "retained": 10 * MiB}})
    code, out, _ = cli(["compare", str(runs[0]), str(metal)], capsys)
    assert code == 0
    assert "note: backends differ (base cpu, head metal): results across backends are not compared" in out
    assert "⛔ Not compared (1): gate_trim/after (backend cpu vs metal: not compared)" in out

    corrupt = tmp_path / "corrupt"
    shutil.copytree(runs[0], corrupt)
    bad = corrupt / "gate_trim" / "after" / "summary.json"
    bad.write_text(summary_file.read_text()[:200])
    code, out, err = cli(["compare", str(runs[0]), str(corrupt)], capsys)
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {bad}: not a valid summary (corrupt JSON: ")
    assert "Traceback" not in err


# Measured run-to-run noise (`kvmem noise`, `baseline update --runs N`) and hardening.

def noisy(data: dict, runs: int = 5, **spreads: int) -> dict:
    """`data` with a noise block recording the given spreads (peak=..., largest_spike=...)."""
    block = {"runs": runs, "nondeterministic": {}, "passed": runs}
    for name, spread in spreads.items():
        value = data["metrics"][name]
        block[name] = {"min": value - spread, "max": value, "spread": spread,
                       "values": [value] * (runs - 1) + [value - spread]}
    return {**data, "noise": block}


def test_measured_spread_widens_the_peak_floor_by_half_again():
    # mlx-lm's rotating `before`: 312 MiB in most runs, 304 MiB once: 8 MiB apart.
    base = noisy(summary("s", "v", peak=312 * MiB), peak=8 * MiB)
    peak = lambda head: next(d for d in pair(base, head).entries[0].deltas if d.metric == "peak")
    low = peak(summary("s", "v", peak=304 * MiB))
    assert (low.verdict, low.tolerance.abs) == ("unchanged", 12 * MiB)
    assert low.tolerance.noise == Noise(8 * MiB, 5)
    assert (low.base_noise, low.head_noise) == (Noise(8 * MiB, 5), None)
    assert peak(summary("s", "v", peak=324 * MiB)).verdict == "unchanged"
    assert peak(summary("s", "v", peak=324 * MiB + 1)).verdict == "regression"
    assert peak(summary("s", "v", peak=300 * MiB - 1)).verdict == "improvement"
    # Without the recorded spread the same low run is outside the 4 MiB floor.
    assert verdicts(pair(summary("s", "v", peak=312 * MiB),
                         summary("s", "v", peak=304 * MiB)))["peak"] == "improvement"


def test_the_base_spread_and_the_configured_floor_win_never_the_head_spread():
    base = noisy(summary("s", "v", peak=100 * MiB, largest_spike=20 * MiB, compare={
        "largest_spike": {"abs": "16 MiB"}}), peak=4 * MiB, largest_spike=6 * MiB)
    head = noisy(summary("s", "v", peak=100 * MiB, largest_spike=20 * MiB, compare={
        "largest_spike": {"abs": "16 MiB"}}), runs=3, peak=8 * MiB)
    deltas = {d.metric: d for d in pair(base, head).entries[0].deltas}
    # The base's 4 MiB spread widens the floor to 6 MiB; the head's 8 MiB would give 12 MiB,
    # a tolerance the head chose for itself.
    assert deltas["peak"].tolerance == Tolerance(0.0, 6 * MiB, Noise(4 * MiB, 5),
                                                     least=SMALL_LEAST)
    assert deltas["largest_spike"].tolerance == Tolerance(0.0, 16 * MiB)   # 9 < 16 MiB
    assert deltas["steady"].tolerance == Tolerance(0.0, 256)                # exact: never


def test_where_a_tolerance_came_from_is_shown(tmp_path, capsys):
    base, head = suites(
        tmp_path,
        [noisy(summary("rot", "before", peak=312 * MiB), peak=8 * MiB),
         noisy(summary("rot", "after", peak=432 * MiB), peak=8 * MiB)],
        [summary("rot", "before", peak=304 * MiB), summary("rot", "after", peak=445 * MiB)])
    code, out, _ = run([base, head], capsys)
    assert code == 1
    assert out.splitlines() == [
        "🔴 kvmem: memory regression in 1 of 2 variants",
        ("  regression  rot/after                                peak                432 MiB -> "
         "     445 MiB  +13 MiB (+3.0%)  tolerance 12 MiB (measured spread 8 MiB over 5 runs)"),
        ("  📏 Tolerance from measured noise (2): rot/after peak 12 MiB (measured spread 8 MiB "
         "over 5 runs), rot/before peak 12 MiB (measured spread 8 MiB over 5 runs)")]

    code, out, _ = run([base, head, "--format", "markdown"], capsys)
    assert ("| 🔴 | `rot/after` | peak | 432 MiB | 445 MiB | **+13 MiB** (+13,631,488 B) | +3.0% "
            "| 12 MiB (measured spread 8 MiB over 5 runs) |") in out.splitlines()
    assert ("- 📏 Tolerance from measured noise (2): `rot/after` peak 12 MiB (measured spread "
            "8 MiB over 5 runs), `rot/before` peak 12 MiB (measured spread 8 MiB over 5 runs)"
            in out.splitlines())

    code, out, _ = run([base, head, "--format", "json"], capsys)
    before = json.loads(out)["entries"][1]
    assert before["variant"] == "before" and before["verdict"] == "unchanged"
    assert before["metrics"]["peak"]["tolerance"] == {
        "rel": 0.0, "abs": 12 * MiB, "source": "measured noise",
        "noise": {"spread": 8 * MiB, "runs": 5}, "size": None,
        "text": "12 MiB (measured spread 8 MiB over 5 runs)"}
    assert before["metrics"]["peak"]["noise"] == {"base": {"spread": 8 * MiB, "runs": 5},
                                                  "head": None}
    assert before["metrics"]["steady"]["tolerance"] == {
        "rel": 0.0, "abs": 256, "source": "configured", "noise": None, "size": None,
        "text": "256 B"}


def test_configured_tolerances_are_shown_as_configured(tmp_path, capsys):
    base, head = suites(tmp_path, [summary("s", "v", rss_peak=400 * MiB)],
                        [summary("s", "v", rss_peak=500 * MiB)])
    code, out, _ = run([base, head], capsys)
    assert code == 1 and out.splitlines()[1].endswith("tolerance 8 MiB and 15%")
    assert "📏" not in out


def _with_metric(name: str, value) -> dict:
    data = summary("s", "v")
    data["metrics"][name] = value
    return data


def _bad_input(tmp_path, capsys, data: dict) -> tuple[str, str]:
    """Compare a sound base with a head holding `data`: exit 2, nothing on stdout."""
    base, head = suites(tmp_path, [summary("s", "v")], [summary("s", "v")])
    bad = tmp_path / "head" / "s" / "v" / "summary.json"
    bad.write_text(json.dumps(data))
    code, out, err = run([base, head], capsys)
    assert (code, out) == (2, "") and "Traceback" not in err
    return str(bad), err


@pytest.mark.parametrize("data, message", [
    ({**summary("s", "v"), "metrics": {}},
     "status ok but metrics lack peak, steady, final, largest_spike, leak_rate, retained, "
     "rss_peak, overhead_ratio)"),
    ({**summary("s", "v"), "metrics": {"wall_s": 0.1, "estimate": 1}},
     "status ok but metrics lack peak, "),
    ({k: v for k, v in summary("s", "v").items() if k != "metrics"},
     "metrics: expected an object of metrics, got nothing)"),
    ({**summary("s", "v"), "environment": ["cpu"]},
     "environment: expected an object of the run's backend and versions, got [\"cpu\"])"),
    ({**summary("s", "v"), "noise": {"runs": "5"}},
     'noise.runs: expected a count of runs, got "5")'),
    ({**summary("s", "v"), "noise": {"runs": 5, "peak": {"spread": -1}}},
     "noise.peak.spread: expected a size of zero or more bytes, got -1)"),
])
def test_ok_summary_without_its_metrics_is_bad_input(tmp_path, capsys, data, message):
    bad, err = _bad_input(tmp_path, capsys, data)
    assert err.startswith(f"error: {bad}: not a valid summary ({message}")


@pytest.mark.parametrize("metric, value, shown", [
    ("peak", "12 MiB", '"12 MiB"'),
    ("steady", True, "true"),
    ("final", [1], "[1]"),
    ("retained", None, "null"),
    ("largest_spike", float("nan"), "NaN"),
    ("rss_peak", float("inf"), "Infinity"),
    ("leak_rate", 2**53 + 1, "9007199254740993"),
    ("leak_rate", 10**400, "a huge integer"),
    ("peak", {"MiB": 12}, '{"MiB": 12}'),
])
def test_non_numeric_metric_is_bad_input(tmp_path, capsys, metric, value, shown):
    bad, err = _bad_input(tmp_path, capsys, _with_metric(metric, value))
    assert err == (f"error: {bad}: not a valid summary (metrics.{metric}: expected a finite "
                   f"number, got {shown})\n")


def test_null_overhead_ratio_is_a_ratio_without_minimum(tmp_path, capsys):
    items = [_with_metric("overhead_ratio", None)]
    code, out, _ = run(list(suites(tmp_path, items, items)), capsys)
    assert (code, out) == (0, "✅ kvmem: no change (1 variant compared)\n")


def test_temporary_and_staged_files_are_never_read(tmp_path, capsys):
    base, head = suites(tmp_path, [summary("s", "v")], [summary("s", "v")])
    variant = tmp_path / "head" / "s" / "v"
    (variant / ".summary.json.abc123.json").write_text('{"schema": 1, "scen')   # interrupted
    (variant / ".samples.csv.x").write_text("step,ph")
    staged = tmp_path / "head" / "s" / ".v.new.k2j3" / "summary.json"         # a staged report
    staged.parent.mkdir()
    staged.write_text(json.dumps(summary("s", "v", steady=99 * MiB)))
    code, out, _ = run([base, head], capsys)
    assert (code, out) == (0, "✅ kvmem: no change (1 variant compared)\n")

    # A baselines folder (every *.json a summary) with an interrupted write beside a baseline.
    baselines = tmp_path / "baselines" / "cpu" / "s"
    baselines.mkdir(parents=True)
    (baselines / "v.json").write_text(json.dumps(summary("s", "v")))
    (baselines / ".v.json.q8w7e6.json").write_text("{")
    code, out, _ = run([str(tmp_path / "baselines"), head], capsys)
    assert (code, out) == (0, "✅ kvmem: no change (1 variant compared)\n")
    assert [s.path.name for s in summaries_under(tmp_path / "baselines")] == ["v.json"]


@pytest.mark.parametrize("argv, message", [
    (["--abs", "peak=1e400GiB"], "'1e400GiB'"),
    (["--abs", "peak=" + "9" * 400], "'999999"),                      # float overflow
    (["--abs", "peak=99999999999999999999 TiB"], "'99999999999999999999 TiB'"),
    (["--abs", f"peak={2**63}"], f"'{2**63}'"),
    (["--rel", "peak=inf"], "not a fraction: 'inf'"),
    (["--rel", "peak=nan"], "not a fraction: 'nan'"),
])
def test_overflowing_options_are_bad_input(tmp_path, capsys, argv, message):
    base, head = suites(tmp_path, [summary("s", "v")], [summary("s", "v")])
    code, out, err = run([base, head, *argv], capsys)
    assert (code, out) == (2, "") and err.startswith("error: ") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("spec, message", [
    ({"peak": {"abs": 10**400}}, "compare.peak.abs: expected a size of at most 8 PiB"),
    ({"peak": {"abs": "1e400 GiB"}}, "compare.peak.abs: expected a size in bytes"),
    ({"peak": {"rel": "lots"}}, 'compare.peak.rel: expected a number, got "lots"'),
    ({"peak": {"rel": [0.1]}}, "compare.peak.rel: expected a number, got [0.1]"),
    ({"peak": {"rel": -0.1}}, "compare.peak.rel: expected a number of at least 0.0, got -0.1"),
    ({"peak": 4}, "compare.peak: expected an object, got 4"),
    ({"peek": {"rel": 0.1}}, "compare.peek: expected a metric compare gates on: peak, steady"),
    ([1], "compare: expected an object of metric tolerances, got [1]"),
])
def test_bad_tolerances_in_a_summary_are_bad_input(tmp_path, capsys, spec, message):
    base, head = suites(tmp_path, [summary("s", "v")], [summary("s", "v")])
    bad = tmp_path / "head" / "s" / "v" / "summary.json"
    bad.write_text(json.dumps({**summary("s", "v"), "compare": spec}))
    code, out, err = run([base, head], capsys)
    assert (code, out) == (2, "") and err.startswith(f"error: {bad}: not a valid summary ({message}")


def test_whatever_parse_size_raises_is_bad_input(tmp_path, capsys, monkeypatch):
    def overflow(value):
        raise OverflowError("cannot convert float infinity to integer")

    monkeypatch.setattr(tolerance, "parse_size", overflow)
    base, head = suites(tmp_path, [summary("s", "v")], [summary("s", "v")])
    code, _, err = run([base, head, "--abs", "peak=1e400GiB"], capsys)
    assert (code, err) == (2, "error: '1e400GiB': cannot convert float infinity to integer\n")


# Small scenarios: the default floor of peak and spike scales with the base peak.

def delta_of(base: dict, head: dict, metric: str) -> cmp.MetricDelta:
    return next(d for d in pair(base, head).entries[0].deltas if d.metric == metric)


def test_a_small_scenario_growing_threefold_is_a_regression(tmp_path, capsys):
    # The case: +3 MiB, +199% on a 1.5 MiB scenario passed under the fixed 4 MiB floor.
    base, head = suites(tmp_path, [summary("tiny", "v", peak=1536 * 1024)],
                        [summary("tiny", "v", peak=4581 * 1024)])
    code, out, _ = run([base, head], capsys)
    assert code == 1
    assert out.splitlines()[1] == (
        "  regression  tiny/v                                   peak                1.5 MiB -> "
        "    4.47 MiB  +2.97 MiB (+198.2%)  tolerance 768 KiB (50% of the 1.5 MiB base peak)")
    code, out, _ = run([base, head, "--format", "json"], capsys)
    assert json.loads(out)["entries"][0]["metrics"]["peak"]["tolerance"] == {
        "rel": 0.0, "abs": 768 * 1024, "source": "scenario size", "noise": None,
        "size": 1536 * 1024, "text": "768 KiB (50% of the 1.5 MiB base peak)"}


@pytest.mark.parametrize("base_peak, floor", [
    (100 * 1024, 256 * 1024),           # tiny: never under SMALL_LEAST
    (512 * 1024, 256 * 1024),
    (1536 * 1024, 768 * 1024),          # import_path_leak/clean
    (1377312, 688656),                  # gate_trim/after
    (6 * MiB, 3 * MiB),
    (8 * MiB, 4 * MiB),                 # from here on, the 4 MiB it always was
    (100 * MiB, 4 * MiB),
])
def test_the_floor_is_half_the_base_peak_between_256_kib_and_4_mib(base_peak, floor):
    base = summary("s", "v", peak=base_peak, largest_spike=4096)
    for metric in ("peak", "largest_spike"):
        at = delta_of(base, summary("s", "v", peak=base_peak + floor,
                                    largest_spike=4096 + floor), metric)
        assert (at.tolerance.abs, at.verdict) == (floor, "unchanged"), metric
        over = delta_of(base, summary("s", "v", peak=base_peak + floor + 1,
                                      largest_spike=4096 + floor + 1), metric)
        assert over.verdict == "regression", metric


@pytest.mark.parametrize("base_peak", [300 * 1024, 1377312, 1536 * 1024, 6 * MiB, 8 * MiB,
                                       100 * MiB])
def test_doubling_a_scenario_always_counts(base_peak):
    assert delta_of(summary("s", "v", peak=base_peak),
                    summary("s", "v", peak=2 * base_peak), "peak").verdict == "regression"


@pytest.mark.parametrize("low, high", [
    # Peaks measured in 8 runs each, two suites at once on 2 loaded cores (harness.gate.compare).
    (1245184, 1377312),                 # gate_trim/after: 1.19 .. 1.31 MiB
    (2363424, 2622528),                 # a 2-layer KVCache: 2.25 .. 2.5 MiB
    (8523936, 10489920),                # a 4-layer KVCache: 8.13 .. 10 MiB (23%)
    (100 * MiB, 102 * MiB),             # ~2 MiB of noise on a large scenario
    (312 * MiB, 316 * MiB),             # up to the 4 MiB floor
])
def test_measured_cpu_noise_never_fails_in_either_direction(low, high):
    for base, head in ((low, high), (high, low)):
        assert delta_of(summary("s", "v", peak=base), summary("s", "v", peak=head),
                        "peak").verdict == "unchanged"


def test_a_measured_spread_is_never_scaled_down_and_a_set_floor_is_used_as_written():
    small = 1536 * 1024
    noisy_base = noisy(summary("s", "v", peak=small), peak=MiB)
    widened = delta_of(noisy_base, summary("s", "v", peak=small + 1536 * 1024), "peak")
    assert (widened.tolerance.abs, widened.tolerance.noise, widened.verdict) == \
        (1536 * 1024, Noise(MiB, 5), "unchanged")                  # 1.5 x 1 MiB > 768 KiB
    assert delta_of(noisy_base, summary("s", "v", peak=small + 1536 * 1024 + 1),
                    "peak").verdict == "regression"
    # `expect.compare` (recorded in the base) and `--abs` floors are not scaled.
    exact = summary("s", "v", peak=small, compare={"peak": {"abs": "64 KiB"}})
    tight = delta_of(exact, summary("s", "v", peak=small + 65 * 1024), "peak")
    assert (tight.tolerance.abs, tight.tolerance.size, tight.verdict) == \
        (64 * 1024, None, "regression")
    from pathlib import Path
    flagged = cmp.compare([parse(Path("b"), summary("s", "v", peak=small))],
                          [parse(Path("h"), summary("s", "v", peak=small + 3 * MiB))],
                          abs_={"peak": 4 * MiB}).entries[0].deltas[0]
    assert (flagged.tolerance.abs, flagged.verdict) == (4 * MiB, "unchanged")


def test_a_metric_from_near_zero_shows_new_and_the_bytes(tmp_path, capsys):
    # qwen3_8b_rotating/after: a 16 KiB spike in the base, a 39.9 MiB one in the head.
    base, head = suites(tmp_path, [summary("rot", "after", peak=432 * MiB, largest_spike=16384)],
                        [summary("rot", "after", peak=432 * MiB, largest_spike=41838182)])
    code, out, _ = run([base, head], capsys)
    assert code == 1 and out.splitlines()[1] == (
        "  regression  rot/after                                largest_spike        16 KiB -> "
        "    39.9 MiB  +39.9 MiB (new)  tolerance 4 MiB")
    code, out, _ = run([base, head, "--format", "markdown"], capsys)
    assert ("| 🔴 | `rot/after` | largest_spike | 16 KiB | 39.9 MiB | **+39.9 MiB** "
            "(+41,821,798 B) | new | 4 MiB |") in out.splitlines()
    code, out, _ = run([base, head, "--format", "json"], capsys)
    spike = json.loads(out)["entries"][0]["metrics"]["largest_spike"]
    assert (spike["new"], spike["delta"], spike["relative"]) == (True, 41821798, 41821798 / 16384)
    # Above the floor, a percentage again.
    d = delta_of(summary("s", "v", largest_spike=5 * MiB), summary("s", "v", largest_spike=10 * MiB),
                 "largest_spike")
    assert (d.new, d.verdict) == (False, "regression")


# Explaining a regression: findings, failed expectations, plots.

def _retained(data: dict, held: bool) -> dict:
    message = "allocator holds 15.38 MiB beyond the 34.69 MiB the components report, at step 48 (idle)"
    data["findings"] = [] if held else [{"kind": "retained", "step": 48, "bytes": 16121856,
                                         "count": 2, "message": message}]
    data["expectations"] = [
        {"name": "leak", "expected": "none", "actual": "none", "ok": True, "message": "-"},
        {"name": "retained", "expected": "none", "actual": "none" if held else "detected",
         "ok": held, "message": "-"}]
    data["passed"] = held
    return data


def test_a_regression_is_explained_in_the_head_runs_words(tmp_path, capsys, monkeypatch):
    base, head = suites(tmp_path, [_retained(summary("cache", "slice"), True)],
                        [_retained(summary("cache", "slice", retained=16121856), False)])
    monkeypatch.setenv("KVMEM_ARTIFACT_URL", "https://ci.example/runs/7/artifacts/memory-reports")
    code, out, _ = run([base, head], capsys)
    assert code == 1 and out.splitlines()[2:] == [
        "  why cache/slice:",
        "    finding retained (new): allocator holds 15.38 MiB beyond the 34.69 MiB the "
        "components report, at step 48 (idle)",
        "    expectation retained fails: expected none, got detected (it held in the base)",
        "    plots: https://ci.example/runs/7/artifacts/memory-reports"]
    code, out, _ = run([base, head, "--format", "markdown", "--artifact-url", "https://x/y"],
                       capsys)
    assert why_lines(out) == [
        "", "- `cache/slice`",
        "  - finding `retained` (new): allocator holds 15.38 MiB beyond the 34.69 MiB the "
        "components report, at step 48 (idle)",
        "  - expectation `retained` fails: expected none, got detected (it held in the base)",
        "  - plots: https://x/y", ""]
    code, out, _ = run([base, head, "--format", "json"], capsys)
    data = json.loads(out)
    assert data["artifact_url"] == "https://ci.example/runs/7/artifacts/memory-reports"
    assert data["entries"][0]["findings"] == [{
        "kind": "retained", "new": True, "message": "allocator holds 15.38 MiB beyond the "
        "34.69 MiB the components report, at step 48 (idle)", "held_by": "", "holder": ""}]
    assert data["entries"][0]["failed_expectations"] == [
        {"name": "retained", "expected": "none", "actual": "detected", "held_in_base": True}]
    out_file = tmp_path / "junit.xml"
    run([base, head, "--format", "junit", "--out", str(out_file)], capsys)
    failure = ET.parse(out_file).getroot().find("testsuite/testcase/failure")
    assert failure.text.splitlines()[1:] == [
        "finding retained (new): allocator holds 15.38 MiB beyond the 34.69 MiB the components "
        "report, at step 48 (idle)",
        "expectation retained fails: expected none, got detected (it held in the base)",
        "plots: https://ci.example/runs/7/artifacts/memory-reports"]


def test_without_a_regression_the_plots_link_is_one_line(tmp_path, capsys):
    items = [summary("s", "v")]
    code, out, _ = run([*suites(tmp_path, items, items), "--artifact-url", "https://x/y"], capsys)
    assert (code, out) == (0, "✅ kvmem: no change (1 variant compared)\n  plots: https://x/y\n")


# A head that produced no summaries.

@pytest.mark.parametrize("options, headline", [
    ([], "🔴 kvmem: the head failed to run (no summaries)"),
    (["--head-error", "\nerror: scenarios/x.yaml: model.layers.0.count: must be >= 1\nmore"],
     "🔴 kvmem: the head failed to run (no summaries): error: scenarios/x.yaml: "
     "model.layers.0.count: must be >= 1"),
    (["--head-log", "LOG"], "🔴 kvmem: the head failed to run (no summaries): "
     "ImportError: cannot import name 'KVCache' from 'mlx_lm.models.cache'"),
    (["--head-log", "missing.log"], "🔴 kvmem: the head failed to run (no summaries): "
     "(cannot read missing.log: No such file or directory)"),
])
def test_a_head_without_summaries_is_a_regression_with_a_comment(tmp_path, capsys, monkeypatch,
                                                                options, headline):
    monkeypatch.chdir(tmp_path)
    base, head = suites(tmp_path, [summary("s", "a"), summary("s", "b")], [])
    (tmp_path / "LOG").write_text("Collecting mlx\nerror: first\nTraceback (most recent call "
                                  "last):\nImportError: cannot import name 'KVCache' from "
                                  "'mlx_lm.models.cache'\n\n  done\n")
    code, out, err = run([base, head, *options], capsys)
    assert (code, err) == (1, "")
    assert out.splitlines() == [
        headline, "  💥 Failed (2): s/a (the head produced no summary), s/b (the head produced "
        "no summary)"]
    code, out, _ = run([base, head, *options, "--format", "markdown"], capsys)
    assert code == 1 and out.splitlines()[:2] == [MARKER, f"### {headline}"]
    code, out, _ = run([base, head, *options, "--format", "json"], capsys)
    data = json.loads(out)
    assert (code, data["verdict"], data["exit_status"], data["headline"]) == \
        (1, "regression", 1, headline)
    assert [e["verdict"] for e in data["entries"]] == ["regression", "regression"]
    code, out, _ = run([base, head, *options, "--format", "junit"], capsys)
    assert code == 1 and junit_problems(out) == []
    suite = ET.fromstring(out).find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "0", "3")
    assert suite.find("testcase[@name='head']/error").get("message") == \
        headline.removeprefix("🔴 kvmem: ")


def test_a_head_without_summaries_and_no_base_still_fails(tmp_path, capsys):
    base, head = suites(tmp_path, [], [])
    code, out, _ = run([base, head, "--format", "json"], capsys)
    assert code == 1 and json.loads(out)["head_failure"] == ""


# JUnit: the junit-10 schema (Jenkins xUnit plugin's junit-10.xsd), its rules written out.

JUNIT_10 = {   # element: (required attributes, allowed attributes, allowed children)
    "testsuites": (set(), {"name", "time", "tests", "failures", "errors"}, {"testsuite"}),
    "testsuite": ({"name", "tests", "failures", "errors"},
                  {"name", "tests", "failures", "errors", "group", "time", "skipped",
                   "timestamp", "hostname", "id", "package", "file", "log", "url"},
                  {"testsuite", "properties", "testcase", "system-out", "system-err"}),
    "testcase": ({"name"}, {"name", "time", "classname", "group"},
                 {"skipped", "error", "failure", "system-out", "system-err"}),
    "failure": (set(), {"type", "message"}, set()),
    "error": (set(), {"type", "message"}, set()),
    "skipped": (set(), {"type", "message"}, set()),
}
SUREFIRE_TIME = r"(([0-9]{0,3},)*[0-9]{3}|[0-9]{0,3})*(\.[0-9]*)?"


def junit_problems(text: str) -> list[str]:
    """Where `text` breaks junit-10.xsd: unknown elements, missing or unknown attributes,
    misplaced children, a `time` that is not SUREFIRE_TIME, counts that disagree."""
    import re

    root = ET.fromstring(text)
    problems = [] if root.tag == "testsuites" else [f"root is {root.tag}"]

    def walk(element: ET.Element) -> None:
        if element.tag not in JUNIT_10:
            problems.append(f"unknown element {element.tag}")
            return
        required, allowed, children = JUNIT_10[element.tag]
        problems.extend(f"{element.tag} lacks {a}" for a in sorted(required - set(element.attrib)))
        problems.extend(f"{element.tag} has {a}" for a in sorted(set(element.attrib) - allowed))
        if element.tag in ("testsuites", "testsuite") and element.get("time") is not None \
                and not re.fullmatch(SUREFIRE_TIME, element.get("time")):
            problems.append(f"{element.tag} time {element.get('time')!r}")
        for child in element:
            if child.tag not in children:
                problems.append(f"{child.tag} inside {element.tag}")
            walk(child)

    walk(root)
    for suite in root.iter("testsuite"):
        cases = suite.findall("testcase")
        for attribute, kind in (("tests", None), ("failures", "failure"), ("errors", "error"),
                                ("skipped", "skipped")):
            count = len(cases) if kind is None else sum(c.find(kind) is not None for c in cases)
            if suite.get(attribute) != str(count):
                problems.append(f"testsuite {attribute}={suite.get(attribute)}, counted {count}")
        if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", suite.get("timestamp", "")):
            problems.append(f"timestamp {suite.get('timestamp')!r}")
        problems.extend(f"testcase {c.get('name')} lacks classname or time" for c in cases
                        if c.get("classname") is None or c.get("time") is None)
    return problems


def test_junit_is_valid_against_junit_10(tmp_path, capsys):
    base, head = suites(
        tmp_path,
        [summary("s", "grew"), summary("s", "same"), summary("s", "gone"), summary("s", "crash")],
        [summary("s", "grew", steady=9 * MiB), summary("s", "same"), summary("s", "fresh"),
         summary("s", "crash", status="failed")])
    code, out, _ = run([base, head, "--format", "junit"], capsys)
    assert code == 1 and junit_problems(out) == []
    suite = ET.fromstring(out).find("testsuite")
    assert {k: suite.get(k) for k in ("name", "tests", "failures", "errors", "skipped", "time")} \
        == {"name": "kvmem-memory", "tests": "5", "failures": "1", "errors": "1", "skipped": "2",
            "time": "2.000"}
    assert suite.find("testcase[@name='crash']/error").attrib == {
        "message": "head failed: child died with signal 11", "type": "run-failed"}
    assert suite.find("testcase[@name='same']").attrib == {
        "name": "same", "classname": "kvmem.s", "time": "0.500"}
    # The checker itself catches what the old output lacked.
    assert junit_problems('<testsuites><testsuite name="x" tests="0" failures="0" skipped="0">'
                          '</testsuite></testsuites>') == [
        "testsuite lacks errors", "testsuite errors=None, counted 0", "timestamp None"]


def test_json_carries_its_schema_and_the_verdict(tmp_path, capsys):
    items = [summary("s", "v")]
    code, out, _ = run([*suites(tmp_path, items, items), "--format", "json"], capsys)
    data = json.loads(out)
    assert (code, data["schema"], data["verdict"], data["exit_status"], data["head_failure"]) \
        == (0, 1, "no change", 0, None)
