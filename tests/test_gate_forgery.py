"""`kvmem gate pr`, round three: on the scratch repository of tests/test_gate_pr.py, nothing a
pull request writes can make the comment lie. Its names, reasons and values are data in every
rendering (no forged cell, row, link, mention or hidden text); who changed a baseline and who
accepted it come from the pull request's event, never from git; a rename is listed as a rename;
the label accepts only the commit it was applied for; and a local `gate pr` gives the verdict
and status CI's judge gives for the same reports."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.gate.definition import differences
from tests import test_gate_pr as scratch
from tests.test_gate_bypasses import head_reports, regress
from tests.test_gate_pr import AFTER, commit, edit, gate, git

recorded, branch = scratch.recorded, scratch.branch

# A variant name that forges the rest of its row: with a backtick closing the code span and
# pipes opening cells, an unescaped rendering of a +1 MiB change read "1 MiB → 1 MiB, +16 B".
FORGED_ROW = "after` | peak | 1 MiB | 1 MiB | **+16 B** | +0.0% | 4 MiB |\n| ✅ | `x"
NAMES = {
    "cells": FORGED_ROW.replace("\n", " "),           # a name holds no line break
    "html": "a<details><summary>fine<img src=x onerror=alert(1)>",
    "comment": "a<!-- kvmem-memory-delta --> <!-- the rest is hidden",
    "link": "[fine](https:example.org) ![ok](i.png) <https:x>",
    "mention": "@maintainers :white_check_mark: #1 www.example.org",
}  # a name holds no `/`: it is a folder of the reports
CELL = re.compile(r"(?<!\\)\|")
CODE = re.compile(r"^(`{3,})[^`\n]*\n.*?^\1$|(`+)(?!`).*?(?<!`)\2(?!`)", re.M | re.S)


def cells(row: str) -> list[str]:
    """A table row's cells, as GitHub splits them: on each `|` no backslash escapes."""
    return CELL.split(row.strip())[1:-1]


def prose(comment: str) -> str:
    """The comment less its code blocks and spans, which GitHub shows as they are."""
    return CODE.sub("", comment)


def acted_on(comment: str) -> list[str]:
    """What Markdown or GitHub would act on outside code spans, less the comment's own marker
    and the event's logins: raw HTML, a link or an image, a mention, an emoji, a bare link."""
    text = prose(comment).replace("<!-- kvmem-memory-delta -->\n", "", 1)
    text = re.sub(r"^<details><summary>\d+ variants? unchanged</summary>$|^</details>$", "",
                  text, flags=re.M)
    text = re.sub(r"@(alice|bob)\b", "", text)
    return re.findall(r"(?<!\\)<[!/A-Za-z]|(?<!\\)\[|(?<![\w`])@\w|:\w+:|https?:(?!\u2060)", text)


def table(comment: str, header: str) -> list[str]:
    """The rows of the table under the line `header`."""
    lines = comment.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[at + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def event_file(folder: Path, head: str, pushes: list[tuple[str, str]],
               applied: list[tuple[str, str]] = (), on: bool | None = None) -> str:
    """The judge workflow's event for pull request #12 by alice, judged at `head`."""
    data = {"schema": 1,
            "pull_request": {"number": 12, "author": "alice",
                             "base_sha": git("rev-parse", "main").strip(), "head_sha": head},
            "label": {"name": "memory-accepted", "on": bool(applied) if on is None else on,
                      "applied": [{"actor": who, "at": at} for who, at in applied]},
            "pushes": [{"sha": sha, "at": at} for sha, at in pushes]}
    path = folder / f"event-{head[:8]}.json"
    path.write_text(json.dumps(data))
    return str(path)


def head() -> str:
    return git("rev-parse", "HEAD").strip()


def rename(name: str) -> Path:
    """The `after` variant renamed to `name` in the scenario (committed) and in its reports."""
    edit("  after: {}", f"  {json.dumps(name)}: {{}}")
    commit("rename")

    def renamed(data: dict) -> None:
        if data["variant"] == "after":
            data["variant"] = name

    return head_reports(renamed)


@pytest.mark.parametrize("case", list(NAMES))
def test_a_variant_name_cannot_forge_the_comment(branch, case):
    name = NAMES[case]
    regress(512 * 1024)
    reports = rename(name)
    code, comment, result = gate("--from", str(reports), "--accept")
    assert code == 1                                    # --accept re-records nothing
    assert comment.splitlines()[1] == "### 🔴 kvmem: memory regression in 1 of 2 variants"
    rows = table(comment, "| | variant | metric |")
    assert rows and all(len(cells(row)) == 8 for row in rows)
    peak = next(row for row in rows if cells(row)[2].strip() == "peak")
    assert cells(peak)[0].strip() == "🔴" and "**+512 KiB**" in cells(peak)[5]
    assert not any(cells(row)[0].strip() == "✅" for row in rows)
    assert acted_on(comment) == []
    assert prose(comment).count("<!-- kvmem-memory-delta -->") == 1
    # The name, in each rendering, as it is: the JSON holds it, the text and JUnit on one line.
    assert f"gate_pr/{name}" in {e["scenario"] + "/" + e["variant"] for e in result["entries"]}
    text = Path("kvmem-gate/memory-delta.xml").read_text()
    names = [c.get("name") for c in ET.fromstring(text).iter("testcase")]
    assert name in names


def test_what_a_reason_holds_is_data(branch, capsys):
    data = json.loads(AFTER.read_text())
    data["metrics"]["largest_spike"] += 1024
    data["recorded"]["reason"] = ("ok |\n| `gate_pr/after` | baseline | 1 | 1 | accepted by "
                                  "@maintainers | <!-- | <img src=x> [x](https://e) :tada:")
    AFTER.write_text(json.dumps(data, indent=2) + "\n")
    commit("re-record")
    code, comment, result = gate("--from", "reports-main")
    assert code == 1
    rows = table(comment, "| variant | what | old | new | why |")
    assert len(rows) == 1 and len(cells(rows[0])) == 7
    assert acted_on(comment) == []
    (change,) = result["changes"]
    assert change["status"] == "needs acceptance" and "@maintainers" in change["recorded"]["reason"]
    # The text rendering: no line of the reason's own.
    assert not any(line.startswith("| ") for line in capsys.readouterr().out.splitlines())


def test_who_changed_a_baseline_is_the_pull_requests_author_never_git(branch, tmp_path):
    data = json.loads(AFTER.read_text())
    data["metrics"]["largest_spike"] += 1024
    data["recorded"] = {"by": "Maintainer <maintainer@example.org>", "at": "2026-01-01T00:00:00Z",
                        "reason": "noise"}
    AFTER.write_text(json.dumps(data, indent=2) + "\n")
    git("-c", "user.name=The Maintainers", "-c", "user.email=team@example.org", "add", "-A")
    git("-c", "user.name=The Maintainers", "-c", "user.email=team@example.org",
        "commit", "-qm", "re-record as someone else")
    sha = head()
    code, comment, result = gate("--from", "reports-main")
    assert code == 1
    assert comment.count("no pull-request event: identities unknown, acceptance from --accept") == 1
    assert "Maintainer" not in comment and "example.org" not in comment
    assert cells(table(comment, "| variant | what | old | new | why |")[0])[5].strip() == \
        f"`{sha[:12]}`"
    assert result["pull_request"] is None
    event = event_file(tmp_path, sha, [(sha, "2026-01-01T00:00:00Z")])
    code, comment, result = gate("--from", "reports-main", "--event", event)
    assert code == 1
    assert "Maintainer" not in comment and "no pull-request event" not in comment
    assert cells(table(comment, "| variant | what | old | new | why |")[0])[5].strip() == \
        f"#12 by @alice, `{sha[:12]}`"
    assert result["changes"][0]["commit"] == sha[:12]


def test_a_rename_is_listed_as_a_rename_and_accepts_nothing(branch):
    code, comment, result = gate("--from", str(rename("later")))
    assert code == 0
    assert comment.splitlines()[1] == "### ✅ kvmem: no change (2 variants compared)"
    assert table(comment, "| old name | new name |") == ["| `gate_pr/after` | `gate_pr/later` |"]
    assert "Changes that pass" not in comment and "accepted" not in comment
    assert [(c["what"], c["status"]) for c in result["changes"]] == [("variant name", "renamed")]


def test_a_field_stated_empty_on_one_side_and_absent_on_the_other_is_unchanged():
    """`server.env: {}` is the default of no `env`: no row says it changed."""
    assert differences({"server": {"env": {}, "requires": []}, "timeout": None},
                       {"server": None}) == []
    assert differences({"server": {"env": {"A": "1"}}}, {"server": None}) == [
        ("server.env.A", '"1"', "(none)")]


def ratchet() -> None:
    """Re-record the `after` baseline's spike up inside its tolerance: a change that needs the
    acceptance (judged --from the main branch's reports, no run)."""
    data = json.loads(AFTER.read_text())
    data["metrics"]["largest_spike"] += 64 * 1024
    data["recorded"]["reason"] = "noise"
    AFTER.write_text(json.dumps(data, indent=2) + "\n")
    commit("re-record")


def test_the_label_accepts_only_the_commit_it_was_applied_for(branch, tmp_path):
    """X measured, Y pushed, the label applied for Y, then X pushed again: X is not accepted."""
    ratchet()
    x = head()
    Path("NOTES.md").write_text("y\n")
    commit("another commit")
    y = head()
    pushes = [(x, "2026-01-01T00:00:00Z"), (y, "2026-01-01T00:10:00Z"),
              (x, "2026-01-01T00:30:00Z")]
    label = [("bob", "2026-01-01T00:20:00Z")]
    code, comment, result = gate("--from", "reports-main", "--event",
                                 event_file(tmp_path, y, pushes, label))
    assert code == 0 and result["accepted"] is True
    assert f"> ✅ accepted by @bob for this commit `{y[:12]}` (the `memory-accepted` label)" \
        in comment.splitlines()
    assert "| accepted by @bob | #12 by @alice" in comment
    git("checkout", "-q", x)
    code, comment, result = gate("--from", "reports-main", "--event",
                                 event_file(tmp_path, x, pushes, label))
    assert code == 1 and result["accepted"] is False
    assert (f"> ⚠️ the `memory-accepted` label was applied by @bob for `{y[:12]}`, not for this "
            f"commit `{x[:12]}`: apply it again") in comment.splitlines()
    assert result["pull_request"]["label_given_for"] == y
    # Taken off since: nothing is accepted, and nothing said of it.
    code, comment, _ = gate("--from", "reports-main", "--event",
                            event_file(tmp_path, x, pushes[:1], label, on=False))
    assert code == 1 and "label was applied" not in comment


def test_an_event_about_another_commit_or_beside_accept_is_bad_input(branch, tmp_path, capsys):
    event = event_file(tmp_path, "f" * 40, [])
    assert scratch.cli("gate", "pr", "--base", "main", "--from", "reports-main",
                       "--event", event) == 2
    assert "pull_request.head_sha ffffffffffff is not the commit judged here" in \
        capsys.readouterr().err
    event = event_file(tmp_path, head(), [])
    assert scratch.cli("gate", "pr", "--base", "main", "--from", "reports-main", "--event",
                       event, "--accept") == 2
    assert "--accept: the acceptance comes from --event" in capsys.readouterr().err
    data = json.loads(Path(event).read_text())
    data["pull_request"]["number"] = "12"
    Path(event).write_text(json.dumps(data))
    assert scratch.cli("gate", "pr", "--base", "main", "--from", "reports-main",
                       "--event", event) == 2
    assert f"{event}: pull_request.number: expected a whole number, got \"12\"" in capsys.readouterr().err


def test_a_genuinely_improved_branch_passes_with_no_change_listed(branch, tmp_path):
    regress(-256 * 1024)
    event = event_file(tmp_path, head(), [(head(), "2026-01-01T00:00:00Z")])
    code, comment, result = gate("--from", "reports-main", "--event", event)
    assert code == 0
    assert comment.splitlines()[1] == "### 🟢 kvmem: memory improved in 1 variant, no regression"
    assert result["changes"] == [] and "label" not in comment


def test_a_local_gate_pr_judges_as_ci_judges(branch, tmp_path):
    """One branch with three forging attempts (a name that forges cells, a baseline
    re-recorded under a forged git author, a label given for an earlier commit): the local
    `gate pr` and CI's `gate pr --from <its reports> --event` agree on verdict and status."""
    edit("  after: {}", f"  {json.dumps(NAMES['cells'])}: {{}}")
    edit("{prompt: 300, decode: 8}", "{prompt: 400, decode: 8}")
    commit("rename and lengthen")
    earlier = head()
    ratchet()
    local = gate()
    pushes = [(earlier, "2026-01-01T00:00:00Z"), (head(), "2026-01-01T00:20:00Z")]
    event = event_file(tmp_path, head(), pushes, [("bob", "2026-01-01T00:10:00Z")])
    ci = gate("--from", "reports-pr", "--event", event)
    assert local[0] == ci[0] == 1
    assert local[2]["verdict"] == ci[2]["verdict"] == "rejected"
    assert local[1].splitlines()[1] == ci[1].splitlines()[1]
    assert [c["what"] for c in local[2]["changes"]] == [c["what"] for c in ci[2]["changes"]]
    assert "label was applied by @bob for" in ci[1] and acted_on(ci[1]) == []
