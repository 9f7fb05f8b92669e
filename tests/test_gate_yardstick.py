"""`kvmem gate pr`, round three: what a variant is measured with beside its scenario is part of
the yardstick. On a scratch repository whose scenario loads a model folder by path, other bytes
in that folder, another runner class, or code that runs before kvmem binds MLX's counters (a
`sitecustomize`, a `usercustomize`, a `.pth` that executes, a package of the repository named
`mlx_lm`) is listed as a change that fails the check without the acceptance; a folder moved
with its bytes, and an unchanged branch, list nothing."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import mlx.core as mx
import pytest

from harness.common.digest import tree_digest
from harness.run import preloaded as start_up
from tests import test_gate_pr as scratch
from tests import test_gate_speed as speed
from tests.test_gate_pr import cli, commit, gate, git, init_repository
from tests.test_model_engine import tiny_llama_folder

branch = scratch.branch  # a pull request's branch of this module's `recorded` repository

SCENARIO = """\
name: folder
description: A local model folder, loaded by path.
engine: mlx_lm
model: {path: models/tiny}
cache: {layer: {component: mlx_lm.KVCache}}
workload:
  prefill_chunk: 8
  requests:
    - {prompt: 12, decode: 3}
"""
FILE = Path("scenarios/folder.yaml")
BASELINE = Path("baselines/cpu/folder/default.json")
LABEL = "folder/default"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """A repository whose main branch holds a small llama folder, the scenario that loads it,
    its baseline, and the reports of that run."""
    root = tmp_path_factory.mktemp("main")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        init_repository()
        Path("models/tiny").mkdir(parents=True)
        tiny_llama_folder(Path("models/tiny"))
        FILE.parent.mkdir()
        FILE.write_text(SCENARIO)
        Path(".gitignore").write_text("reports*/\nkvmem-gate/\n")
        assert cli("run", "scenarios", "--out", "reports-main") == 0
        assert cli("baseline", "update", "--reason", "first record", "--from",
                   "reports-main") == 0
        commit("a model folder, its scenario and baseline")
    return root


def changes(result: dict) -> dict[str, tuple[str, str, str]]:
    """Each change the JSON lists, by what it is: (old, new, status)."""
    return {c["what"]: (c["old"], c["new"], c["status"]) for c in result["changes"]}


def head_reports(change) -> str:
    """The main branch's reports as the head's, each summary's environment through `change`."""
    shutil.copytree("reports-main", "reports-head")
    for path in Path("reports-head").rglob("summary.json"):
        data = json.loads(path.read_text())
        change(data["environment"])
        path.write_text(json.dumps(data, indent=1))
    return "reports-head"


def regenerate(folder: Path) -> None:
    """The folder's weights written again with other values, in the same shapes and dtype."""
    file = folder / "model.safetensors"
    weights = mx.load(str(file))
    mx.save_safetensors(str(file), {name: value * 2 for name, value in weights.items()})


def test_the_summary_records_the_folder_runner_and_start_up_code(recorded):
    environment = json.loads((recorded / BASELINE).read_text())["environment"]
    digest = tree_digest(recorded / "models/tiny")  # config, weights and their index
    assert environment["model_folder"] == {"path": "models/tiny", "sha256": digest.sha256,
                                           "files": 3, "bytes": digest.bytes}
    assert set(environment["runner"]) == {"backend", "machine", "cpus", "memory_gib", "os"}
    assert environment["runner"]["backend"] == "cpu"
    # Named relative to site-packages: the same on every run and every checkout.
    assert all(not p["path"].startswith("/") for p in environment["preloaded"])


def test_an_unchanged_branch_lists_nothing(branch):
    code, _, result = gate("--from", "reports-main")
    assert (code, result["changes"]) == (0, [])


def test_other_weights_and_a_sitecustomize_are_changes_needing_the_acceptance(branch, tmp_path,
                                                                               monkeypatch):
    """Measured: the head runs with regenerated weights (the scenario untouched) and with a
    `sitecustomize` imported at start-up."""
    regenerate(Path("models/tiny"))
    commit("regenerate the weights")
    hook = tmp_path / "sitecustomize.py"
    hook.write_text("import mlx.core\n")
    monkeypatch.setitem(sys.modules, "sitecustomize",
                        types.SimpleNamespace(__file__=str(hook)))
    code, _, result = gate()
    assert code == 1
    old = json.loads(BASELINE.read_text())["environment"]["model_folder"]["sha256"]
    new = tree_digest(Path("models/tiny")).sha256
    found = changes(result)
    assert found["model folder models/tiny"] == (f"digest {old[:12]}…", f"digest {new[:12]}…",
                                                 "needs acceptance")
    hooked = found[f"sitecustomize {hook.resolve().as_posix()}"]
    assert hooked[0] == "(none)" and hooked[2] == "needs acceptance"
    assert gate("--from", "reports-pr", "--accept")[0] == 0


def test_a_folder_moved_with_its_bytes_is_no_change(branch):
    git("mv", "models/tiny", "models/small")
    FILE.write_text(SCENARIO.replace("models/tiny", "models/small"))
    commit("move the model folder")

    def moved(environment: dict) -> None:
        environment["model_folder"]["path"] = "models/small"

    code, comment, result = gate("--from", head_reports(moved))
    # The base's scenario names a folder this checkout no longer has: it is still read, and
    # its variant judged by the digest its baseline recorded.
    assert (code, result["changes"]) == (0, [])
    assert "base:" not in comment


def test_a_baseline_without_a_digest_lists_no_change(branch):
    data = json.loads(BASELINE.read_text())
    del data["environment"]["model_folder"], data["environment"]["runner"]
    BASELINE.write_text(json.dumps(data, indent=2) + "\n")
    commit("a baseline recorded before the digest")
    git("branch", "old")

    def other(environment: dict) -> None:
        environment["model_folder"]["sha256"] = "0" * 64
        environment["runner"]["cpus"] += 1

    assert cli("gate", "pr", "--base", "old", "--from", head_reports(other)) == 0
    result = json.loads(Path("kvmem-gate/memory-delta.json").read_text())
    assert result["changes"] == []
    assert [e["not_recorded"] for e in result["entries"]] == [["model_folder", "runner"]]


def test_another_runner_class_needs_the_acceptance(branch):
    def bigger(environment: dict) -> None:
        environment["runner"]["cpus"] += 14

    head = head_reports(bigger)
    code, _, result = gate("--from", head)
    runner = json.loads(BASELINE.read_text())["environment"]["runner"]
    was = (f"cpu, {runner['machine']}, {runner['cpus']} CPUs, {runner['memory_gib']} GiB, "
           f"{runner['os']}")
    assert code == 1
    assert changes(result) == {"runner class": (
        was, was.replace(f"{runner['cpus']} CPUs", f"{runner['cpus'] + 14} CPUs"),
        "needs acceptance")}
    assert gate("--from", head, "--accept")[0] == 0


@pytest.mark.parametrize("entry", [
    {"kind": "usercustomize", "path": "site-packages/usercustomize.py"},
    {"kind": "pth", "path": "site-packages/zz-hook.pth"},
    {"kind": "shadow", "path": "./mlx_lm"},
])
def test_start_up_code_added_by_the_head_needs_the_acceptance(branch, entry):
    def added(environment: dict) -> None:
        environment["preloaded"].append({**entry, "sha256": "ab" * 32})

    head = head_reports(added)
    code, _, result = gate("--from", head)
    assert code == 1
    assert changes(result) == {f"{entry['kind']} {entry['path']}": (
        "(none)", "digest abababababab…", "needs acceptance")}
    assert gate("--from", head, "--accept")[0] == 0


def test_changed_start_up_code_needs_the_acceptance_and_removed_tightens(branch):
    def edited(environment: dict) -> None:
        found = environment["preloaded"]
        assert found, "the virtual environment has a .pth file that executes"
        found[0]["sha256"] = "cd" * 32

    main = json.loads(BASELINE.read_text())["environment"]["preloaded"]
    data = json.loads(BASELINE.read_text())
    data["environment"]["preloaded"].append(
        {"kind": "pth", "path": "site-packages/old.pth", "sha256": "12" * 32})
    BASELINE.write_text(json.dumps(data, indent=2) + "\n")
    commit("a baseline measured with one more .pth")
    git("branch", "-f", "main")                     # as if main had recorded it so
    code, _, result = gate("--from", head_reports(edited))
    assert code == 1
    found = changes(result)
    first = f"{main[0]['kind']} {main[0]['path']}"
    assert found[first] == (f"digest {main[0]['sha256'][:12]}…", "digest cdcdcdcdcdcd…",
                            "needs acceptance")
    assert found["pth site-packages/old.pth"] == ("digest 121212121212…", "(removed)",
                                                  "tightens")


adopted = speed.adopted  # a repository made by `kvmem init`, its starter recorded on main


def test_an_adopters_own_mlx_lm_package_needs_the_acceptance(adopted, tmp_path, monkeypatch):
    """In a repository that adopted kvmem, a root `mlx_lm/` (which every measuring child would
    import) is listed with its files' digest, as the head's runs record it."""
    # kvmem puts the working folder on this process's path for `module:Class` components: put
    # it back after, or every later child of this worker would import the repository's mlx_lm.
    monkeypatch.setattr(sys, "path", list(sys.path))
    repo = tmp_path / "repo"
    shutil.copytree(adopted, repo)
    monkeypatch.chdir(repo)
    git("checkout", "-q", "-b", "pr")
    Path("mlx_lm").mkdir()
    Path("mlx_lm/__init__.py").write_text("from mlx.core import *\n")
    commit("ship our own mlx_lm")
    listed = [e for e in start_up.preloaded(repo) if e["kind"] == "shadow"]
    assert listed == [{"kind": "shadow", "path": "./mlx_lm",
                       "sha256": tree_digest(repo / "mlx_lm").sha256}]

    def shadowed(environment: dict) -> None:
        environment["preloaded"] += listed

    head = head_reports(shadowed)
    code, _, result = gate("--from", head)
    assert code == 1
    assert {what for what, (_, _, status) in changes(result).items()
            if status == "needs acceptance"} == {"shadow ./mlx_lm"}
    assert gate("--from", head, "--accept")[0] == 0


def test_the_start_up_code_is_found_where_python_finds_it(tmp_path, monkeypatch):
    """`sitecustomize`/`usercustomize` as imported (kvmem's own agent left out), `.pth` files
    that execute a line, and top-level `mlx`, `mlx_lm` or `harness` of the repository."""
    site_packages = tmp_path / "site-packages"
    site_packages.mkdir()
    (site_packages / "hook.pth").write_text("/some/folder\nimport os; os.environ\n")
    (site_packages / "paths.pth").write_text("/some/folder\nimporter\n")
    monkeypatch.setattr(start_up, "_site_folders", lambda: [site_packages])
    (site_packages / "usercustomize.py").write_text("x = 1\n")
    monkeypatch.setitem(sys.modules, "usercustomize",
                        types.SimpleNamespace(__file__=str(site_packages / "usercustomize.py")))
    monkeypatch.setitem(sys.modules, "sitecustomize",
                        types.SimpleNamespace(__file__=str(start_up.AGENT)))
    repo = tmp_path / "repo"
    (repo / "mlx_lm").mkdir(parents=True)
    (repo / "mlx_lm" / "__init__.py").write_text("")
    (repo / "harness.py").write_text("")
    found = [(e["kind"], e["path"]) for e in start_up.preloaded(repo)]
    assert found == [("pth", "site-packages/hook.pth"), ("shadow", "./harness.py"),
                     ("shadow", "./mlx_lm"), ("usercustomize", "site-packages/usercustomize.py")]
    assert start_up.preloaded(repo) == start_up.preloaded(repo)
    # kvmem's own `harness`, in its own repository, shadows nothing.
    assert not [e for e in start_up.preloaded(start_up.KVMEM.parent) if e["kind"] == "shadow"]


def test_the_pth_file_of_kvmems_own_installation_is_not_start_up_code(tmp_path, monkeypatch):
    """An editable kvmem's `.pth` (its name carries the version) is the measuring tool, which
    the summary records by version: a version bump is no change to the yardstick."""
    site_packages = tmp_path / "site-packages"
    info = site_packages / "kvmem-9.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvmem\nVersion: 9.9\n")
    (info / "RECORD").write_text("__editable__.kvmem-9.9.pth,,\nkvmem-9.9.dist-info/METADATA,,\n")
    (site_packages / "__editable__.kvmem-9.9.pth").write_text("import kvmem_finder\n")
    (site_packages / "other.pth").write_text("import other_finder\n")
    monkeypatch.setattr(start_up, "_site_folders", lambda: [site_packages])
    assert [(e["kind"], e["path"]) for e in start_up.preloaded(tmp_path / "repo")
            if e["kind"] == "pth"] == [("pth", "site-packages/other.pth")]


def test_a_sitecustomize_that_hides_itself_is_still_found(tmp_path, monkeypatch):
    """Out of `sys.modules`, its folder out of `sys.path`: the `.pth` file that put it there
    still names it."""
    site_packages = tmp_path / "site-packages"
    (site_packages / "hidden").mkdir(parents=True)
    (site_packages / "hidden" / "sitecustomize.py").write_text("import sys\n")
    (site_packages / "project.pth").write_text("hidden\n")
    monkeypatch.setattr(start_up, "_site_folders", lambda: [site_packages])
    monkeypatch.delitem(sys.modules, "sitecustomize", raising=False)
    monkeypatch.delitem(sys.modules, "usercustomize", raising=False)
    monkeypatch.setattr(sys, "path", sys.path[:1])  # none of this machine's own
    assert [(e["kind"], e["path"]) for e in start_up.preloaded(tmp_path / "repo")] == [
        ("sitecustomize", "site-packages/hidden/sitecustomize.py")]


def test_a_folder_digest_is_its_bytes_not_its_path(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for folder in (one, two):
        (folder / "sub").mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "sub" / "weights").write_bytes(b"\1" * 3000)
    (two / "__pycache__").mkdir()
    (two / "__pycache__" / "x.pyc").write_bytes(b"cached")
    (two / ".hidden").write_text("not the model's")
    assert tree_digest(one) == tree_digest(two)
    assert (tree_digest(one).files, tree_digest(one).bytes) == (2, 3002)
    (two / "sub" / "weights").write_bytes(b"\2" * 3000)
    assert tree_digest(one).sha256 != tree_digest(two).sha256
    (two / "sub" / "weights").rename(two / "weights")     # the same bytes under another name
    assert tree_digest(one).sha256 != tree_digest(two).sha256
