"""`kvmem gate pr --base main`: on a scratch repository, each way a pull request could turn the
gate green by editing what it is judged against fails the check, with its reason in the
comment; an unchanged branch passes, and a re-recorded baseline passes only with a reason and
the maintainers' acceptance, listed among the accepted changes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness.cli import main
from harness.common.units import format_bytes
from tests.summaries import TRIM_SCENARIO

# The gate's small prefix-store scenario, with its bug as a canary beside the fix.
SCENARIO = TRIM_SCENARIO.replace("name: gate_trim", "name: gate_pr") + """\
  before:                          # the canary: slices keep whole buffers alive
    cache: {store: {options: {trim: slice}}}
    expect: {retained: detected}
"""
FILE = Path("scenarios/gate_pr.yaml")
AFTER = Path("baselines/cpu/gate_pr/after.json")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def init_repository() -> None:
    """A new git repository here, on `main`, committing as the maintainers."""
    git("init", "-q", "-b", "main")
    git("config", "user.name", "Maintainer")
    git("config", "user.email", "maintainer@example.org")


def commit(message: str) -> None:
    git("add", "-A")
    git("commit", "-qm", message)


def cli(*argv: str) -> int:
    try:
        return main(list(argv))
    except SystemExit as exc:  # argparse's refusals
        return exc.code if isinstance(exc.code, int) else 2


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A repository whose main branch holds the scenario and its recorded baselines, and the
    reports of that run (to judge branches that change no scenario)."""
    root = tmp_path_factory.mktemp("main")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        init_repository()
        FILE.parent.mkdir()
        FILE.write_text(SCENARIO)
        Path(".gitignore").write_text("reports*/\nkvmem-gate/\n")
        assert cli("run", "scenarios", "--out", "reports-main", "--jobs", "2") == 0
        assert cli("baseline", "update", "--reason", "first record", "--from",
                   "reports-main") == 0
        commit("scenario and baselines")
    return root


@pytest.fixture
def branch(recorded, tmp_path, monkeypatch) -> Path:
    """A clone of the recorded repository, on a pull request's branch, as the working folder."""
    repo = tmp_path / "repo"
    shutil.copytree(recorded, repo)
    monkeypatch.chdir(repo)
    git("checkout", "-q", "-b", "pr")
    return repo


def gate(*options: str) -> tuple[int, str, dict]:
    """`kvmem gate pr --base main`: its exit status, the comment and the JSON it wrote."""
    code = cli("gate", "pr", "--base", "main", "--jobs", "2", "--reports", "reports-pr",
               *options)
    out = Path("kvmem-gate")
    return (code, (out / "memory-delta.md").read_text(),
            json.loads((out / "memory-delta.json").read_text()))


def edit(old: str, new: str) -> None:
    text = FILE.read_text()
    assert old in text
    FILE.write_text(text.replace(old, new))


def failing(comment: str) -> list[str]:
    """The rows of the comment's section of changes that fail the check."""
    section = comment.partition("Changes to the yardstick that fail the check\n\n")[2]
    table = section.partition("\n\n")[0].splitlines()
    return table[2:]                                    # after the header and its rule


def test_an_unchanged_branch_passes(branch, capsys):
    code, comment, result = gate()
    assert code == 0
    assert comment.splitlines()[1] == "### ✅ kvmem: no change (2 variants compared)"
    assert (result["verdict"], result["changes"]) == ("no change", [])
    assert "comment, JSON and JUnit written under kvmem-gate/" in capsys.readouterr().out


def test_a_real_regression_fails(branch):
    edit("{prompt: 300, decode: 8}", "{prompt: 1200, decode: 8}")
    commit("a longer last request")
    code, comment, _ = gate()
    assert code == 1
    assert comment.splitlines()[1].startswith("### 🔴 kvmem: memory regression in 2 of 2 variants")
    assert re.search(r"^\| 🔴 \| `gate_pr/after` \| peak \|", comment, re.M)


def test_re_recording_a_regression_needs_a_reason_and_the_acceptance(branch):
    edit("{prompt: 300, decode: 8}", "{prompt: 1200, decode: 8}")
    assert cli("run", "scenarios", "--out", "reports-new", "--jobs", "2") == 0
    assert cli("baseline", "update", "--reason", "a longer last request", "--from",
               "reports-new") == 0
    commit("a longer last request, re-recorded")
    code, comment, result = gate("--from", "reports-new")
    assert code == 1                                     # the PR's own baselines do not judge it
    # The commit that re-recorded it, as git has it; who, only from the pull request's event.
    sha = git("log", "-1", "--format=%H").strip()[:12]
    assert (f"its baseline is re-recorded here ({sha}: a longer last request): a maintainer "
            "accepts it with the memory-accepted label") in comment
    assert re.search(r"^\| 🔴 \| `gate_pr/after` \| peak \|", comment, re.M)
    # Each figure re-recorded beyond tolerance is the row of its variant, listed once: not
    # again as a change. What changed in the scenario is listed, and needs the acceptance.
    rows = {c["what"] for c in result["changes"] if c["variant"] == "gate_pr/after"}
    assert not rows & {"baseline peak", "baseline steady", "baseline final"}
    assert "scenario workload.requests[2].prompt" in rows

    code, comment, result = gate("--from", "reports-new", "--accept")
    assert code == 0
    # The workload's longer prompt in each variant, and whichever figures the re-record moved up
    # inside their tolerance (rss_peak, a spike: how many depends on the run) are accepted.
    assert re.fullmatch(r"### ✅ kvmem: memory change accepted in 2 of 2 variants; \d+ accepted "
                        r"changes", comment.splitlines()[1])
    assert re.search(r"^\| ✅ \| `gate_pr/after` \| peak \|", comment, re.M)
    assert (f"- ✅ `gate_pr/after`: accepted: the pull request re-records its baseline ({sha}: "
            "a longer last request)") in comment.splitlines()
    old = json.loads(AFTER.read_text())["metrics"]["peak"]
    assert old > 0 and [e["accepted"] for e in result["entries"]] == [True, True]


def test_a_baseline_of_a_failing_run_is_refused_even_with_the_acceptance(branch):
    data = json.loads(AFTER.read_text())
    data["passed"] = False                              # as --allow-failed once recorded it
    data["recorded"] = {"by": "someone", "at": "2026-01-01T00:00:00Z", "reason": "flaky"}
    AFTER.write_text(json.dumps(data, indent=2) + "\n")
    commit("record a failing run")
    code, comment, _ = gate("--from", "reports-main", "--accept")
    assert code == 1
    # The commit that changed the file, not the name the file gives itself, nor git's author.
    sha = git("log", "-1", "--format=%H").strip()[:12]
    assert failing(comment) == [
        "| `gate_pr/after` | baseline | recorded | rewritten | refused: a baseline must be a "
        f"run that completed and met its expectations: its expectations fail | `{sha}` | flaky |"]


def test_a_loosened_tolerance_fails_without_the_acceptance(branch):
    edit("  after: {}", "  after:\n    expect: {compare: {peak: {abs: 64 MiB}}}")
    commit("loosen the peak's tolerance")
    code, comment, _ = gate()
    assert code == 1
    assert comment.splitlines()[1] == ("### 🔴 kvmem: 1 change to what this pull request is "
                                       "judged against cannot pass as it is")
    # The old tolerance as it was applied: the 4 MiB default, scaled to half the base's peak
    # (1.31 MiB here, give or take the step's noise when the baseline was recorded).
    applied = format_bytes(json.loads(AFTER.read_text())["metrics"]["peak"] / 2)
    assert failing(comment) == [
        f"| `gate_pr/after` | compare.peak | {applied} | 64 MiB | loosens the check: needs the "
        "`memory-accepted` label |  |  |"]
    assert gate("--from", "reports-pr", "--accept")[0] == 0


def test_a_new_variant_that_fails_its_expectations_fails(branch):
    edit("variants:\n", "variants:\n  copy_canary:\n    expect: {retained: detected}\n")
    commit("a canary that does not detect")
    code, comment, result = gate("--accept")                # nothing accepts a failing run
    assert code == 1
    assert "🆕 New (1): `gate_pr/copy_canary`" in comment
    assert "expectation `retained` fails: expected detected, got none" in comment
    entry = next(e for e in result["entries"] if e["variant"] == "copy_canary")
    assert entry["failure"] == "fails its own expectations (retained: expected detected, got none)"


def test_a_blinded_canary_fails(branch):
    edit("    expect: {retained: detected}",
         "    detect: {retained: {min_bytes: 64 MiB}}\n    expect: {retained: detected}")
    commit("raise the canary's threshold")
    code, comment, _ = gate("--accept")
    assert code == 1
    assert comment.splitlines()[1].startswith("### 🔴 kvmem: memory regression in 1 of 2")
    assert "expectation `retained` fails: expected detected, got none (it held in the base)" \
        in comment


def test_a_deleted_variant_fails_without_the_acceptance(branch):
    edit("  before:                          # the canary: slices keep whole buffers alive\n"
         "    cache: {store: {options: {trim: slice}}}\n    expect: {retained: detected}\n", "")
    commit("drop the canary")
    code, comment, _ = gate()
    assert code == 1
    assert failing(comment) == [
        "| `gate_pr/before` | variant | in the suite | removed | loosens the check: needs the "
        "`memory-accepted` label |  |  |"]
    assert gate("--from", "reports-pr", "--accept")[0] == 0


def test_an_unknown_base_is_bad_input(branch, capsys):
    assert cli("gate", "pr", "--base", "no-such-branch", "--from", "reports-main") == 2
    assert capsys.readouterr().err.startswith(
        "error: --base 'no-such-branch': no such commit in ")
