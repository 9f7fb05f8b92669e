"""The results store (harness/store/) is the one reader of stored results: no other module
opens a summary, a report folder's rows, a baselines folder or the nightly record by its name,
asks git for a committed file, or turns stored bytes into a summary.

The scan sees what a module names where it reads: a read (`read_bytes`, `open`, `rglob`,
`read_csv`...) whose path or pattern spells a stored file's name (`"summary.json"`, `"*.json"`,
`SAMPLES`...), and git's commands that read a revision's files. A path built elsewhere and
passed in cannot be seen: reading it still goes through the store's functions, which the
planted examples below show the scan would otherwise catch."""

from __future__ import annotations

import ast
import json
from pathlib import Path, PurePosixPath

import pytest

from harness.store import StoreError
from harness.store import git as revision
from harness.store.summaries import baselines_at, baselines_in
from tests.summaries import MiB, summary
from tests.test_gate_pr import commit, git, init_repository

HARNESS = Path(__file__).resolve().parent.parent / "harness"
STORE = HARNESS / "store"

READS = {"read_bytes", "read_text", "open", "read_csv", "rglob", "glob", "iterdir", "load",
         "loads"}
STORED = {"summary.json", "samples.csv", "holders.csv", "requests.csv", "history.json",
          "*.json", "SAMPLES", "HOLDERS", "REQUESTS"}  # names of files, and report/writing.py's
GIT_READS = {"ls-tree", "cat-file"}  # git's commands that read a revision's files
PARSERS = {"summary_from_bytes"}  # stored bytes to a summary: the store's to call


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _spelled(node: ast.AST) -> set[str]:
    """Every string and name written anywhere inside `node`."""
    found = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
            found.add(inner.value)
        elif isinstance(inner, (ast.Name, ast.Attribute)):
            found.add(_name(inner))
    return found


def stored_reads(source: str) -> list[str]:
    """Where `source` reads a stored result itself: `line N: what`, in line order."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            called = _name(node.func)
            if called in READS and (named := _spelled(node) & STORED):
                found.append((node.lineno, f"{called} of {sorted(named)[0]}"))
            elif called in PARSERS:
                found.append((node.lineno, called))
        elif isinstance(node, ast.Constant) and node.value in GIT_READS:
            found.append((node.lineno, f"git {node.value}"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_no_module_outside_the_store_reads_stored_results():
    outside = [path for path in sorted(HARNESS.rglob("*.py")) if STORE not in path.parents]
    found = [f"{path.relative_to(HARNESS)} {hit}" for path in outside
             for hit in stored_reads(path.read_text())]
    assert found == []


def test_the_scan_sees_the_store_read_them():
    inside = "".join(path.read_text() for path in sorted(STORE.rglob("*.py")))
    assert {hit.partition(": ")[2] for hit in stored_reads(inside)} == {
        "git ls-tree", "git cat-file", "summary_from_bytes"}


PLANTED = '''
import json, subprocess
summary = json.loads((folder / "summary.json").read_text())
rows = pd.read_csv(folder / SAMPLES)
files = sorted(root.rglob("*.json"))
listing = subprocess.run(["git", "ls-tree", "-r", sha], capture_output=True)
parsed = summary_from_bytes(path, content)
(staging / "summary.json").write_text(summary.to_json())
frame.to_csv(staging / SAMPLES, index=False)
scenario = path.read_text()
'''


def test_the_scan_finds_each_way_of_reading_and_no_write():
    assert stored_reads(PLANTED) == [
        "line 3: loads of summary.json", "line 3: read_text of summary.json",
        "line 4: read_csv of SAMPLES", "line 5: rglob of *.json", "line 6: git ls-tree",
        "line 7: summary_from_bytes"]


def test_baselines_are_read_alike_from_a_revision_and_from_the_tree(tmp_path, monkeypatch):
    """The base's baselines come from the commit, whatever the tree holds now; the tree's
    leave out what an interrupted atomic write left (a hidden name)."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "baselines" / "cpu" / "s"
    folder.mkdir(parents=True)
    (folder / "v.json").write_text(json.dumps(summary("s", "v", peak=10 * MiB)))
    init_repository()
    commit("base")
    sha = git("rev-parse", "HEAD").strip()
    (folder / "v.json").write_text(json.dumps(summary("s", "v", peak=12 * MiB)))
    (folder / ".v.json.x1.json").write_text("half written")
    at = baselines_at(sha, tmp_path, PurePosixPath("baselines"), "main:baselines")
    tree = baselines_in(tmp_path / "baselines", "baselines")
    key = PurePosixPath("cpu/s/v.json")
    assert list(at) == list(tree) == [key]
    assert (at[key].metric("peak"), tree[key].metric("peak")) == (10 * MiB, 12 * MiB)
    assert str(at[key].path) == "main:baselines/cpu/s/v.json"
    assert baselines_at(sha, tmp_path, PurePosixPath("elsewhere"), "main:elsewhere") == {}
    assert baselines_in(tmp_path / "elsewhere", "elsewhere") == {}


def test_a_revision_git_does_not_know_is_bad_input_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    init_repository()
    with pytest.raises(StoreError, match=r"^--base 'nope': no such commit in "):
        revision.commit("nope", tmp_path)
    with pytest.raises(StoreError, match=r"^--base '-x': not a revision$"):
        revision.commit("-x", tmp_path)
