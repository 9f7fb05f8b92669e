"""The GitHub workflows: valid against the vendored workflow schema, pinned, least-privileged, and
wired as the gate needs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.gate.render import MARKER

WORKFLOWS = Path(__file__).resolve().parents[1] / ".github" / "workflows"
FILES = ("memory-pr.yml", "memory-comment.yml", "memory-nightly.yml")
ROOT = WORKFLOWS.parents[1]
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
WRITERS = {("memory-comment.yml", "comment"): {"pull-requests"},
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
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True)            # YAML 1.1 reads the bare key `on` as true
    return data


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
    expected = {"memory-pr.yml": {"contents": "read"}, "memory-nightly.yml": {"contents": "read"},
                "memory-comment.yml": {}}
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


def assert_sharded(data: dict, job: str, merger: str, artifact: str) -> None:
    """`job` runs two shards and uploads each; `merger` downloads them all and merges them."""
    matrix = data["jobs"][job]["strategy"]
    assert matrix == {"fail-fast": False, "matrix": {"shard": [1, 2]}}
    upload = using(data, "actions/upload-artifact", job)
    assert [u["with"]["name"] for u in upload] == [f"{artifact}-${{{{ matrix.shard }}}}"]
    assert upload[0]["if"] == "always()"
    assert data["jobs"][merger]["needs"] == job
    assert data["jobs"][merger]["if"] == "${{ !cancelled() }}"
    later = steps(data, merger)
    download = using(data, "actions/download-artifact", merger)
    assert [d["with"]["pattern"] for d in download] == [f"{artifact}-*"]
    merge = next(s for s in later if MERGES.search(s.get("run", "")))
    assert later.index(download[0]) < later.index(merge)
    # The merge step looks for every shard of the matrix: a lost one is never merged away.
    assert "for shard in 1 2; do" in merge["run"]


def merge_step(data: dict, job: str) -> str:
    return next(s["run"] for s in steps(data, job) if MERGES.search(s.get("run", "")))


def test_pull_request_workflow_runs_the_head_and_lets_the_target_branch_judge():
    """The head's kvmem runs its scenarios; the target branch's kvmem gives the verdict with
    `gate pr`, against the target's commit, honouring every exit status; the label re-runs it."""
    data = workflow("memory-pr.yml")
    assert data["on"] == {"pull_request": {"types": ["opened", "synchronize", "reopened",
                                                     "labeled", "unlabeled"]}}
    assert list(data["jobs"]) == ["run", "judge"]
    assert_sharded(data, "run", "judge", "memory-reports-shard")
    run = next(s for s in steps(data, "run") if SHARD_FLAG in s.get("run", ""))
    assert run["run"] == f"python -m harness run scenarios {SHARD_FLAG} --out reports"
    # No step anywhere swallows a status: no continue-on-error, no `|| true`.
    assert not any("continue-on-error" in s for s in steps(data))
    assert "|| true" not in scripts(data)
    judge_out = using(data, "actions/checkout", "judge")
    assert [c["with"]["path"] for c in judge_out] == ["head", "judge"]
    assert judge_out[1]["with"]["ref"] == "${{ github.event.pull_request.base.sha }}"
    assert judge_out[0]["with"]["fetch-depth"] == 0
    assert "venv-judge/bin/pip install --quiet ./judge" in scripts(data, "judge")
    gate = next(s for s in steps(data, "judge") if "gate pr" in s.get("run", ""))
    assert gate["working-directory"] == "head"
    assert '../venv-judge/bin/kvmem gate pr --base "$BASE_SHA" --from ../reports' in gate["run"]
    assert gate["env"]["ACCEPTED"] == (
        "${{ contains(github.event.pull_request.labels.*.name, 'memory-accepted') }}")
    assert gate["env"]["KVMEM_ARTIFACT_URL"].endswith("/actions/runs/${{ github.run_id }}")
    assert 'exit "$status"' in gate["run"] and "${{" not in gate["run"]
    uploads = using(data, "actions/upload-artifact", "judge")
    assert {s["with"]["name"] for s in uploads} == {"memory-delta", "memory-reports"}
    assert all(s["if"] == "always()" for s in uploads)
    checkouts = using(data, "actions/checkout")
    assert all(c["with"]["persist-credentials"] is False for c in checkouts)


def test_the_judge_step_keeps_the_worst_status(tmp_path):
    """The step's script, run with a fake kvmem: the gate's status, else the merge's."""
    data = workflow("memory-pr.yml")
    script = next(s for s in steps(data, "judge") if "gate pr" in s.get("run", ""))["run"]
    (tmp_path / "venv-judge/bin").mkdir(parents=True)
    (tmp_path / "head").mkdir()
    kvmem = tmp_path / "venv-judge/bin/kvmem"
    kvmem.write_text('#!/bin/sh\necho "$@" > ../args\nexit "$GATE"\n')
    kvmem.chmod(0o755)
    for gate, merged, accepted, expected in ((0, 0, "false", 0), (1, 0, "true", 1),
                                             (0, 1, "false", 1), (2, 1, "false", 2)):
        env = {"PATH": "/usr/bin:/bin", "GATE": str(gate), "MERGED": str(merged),
               "ACCEPTED": accepted, "BASE_SHA": "abc"}
        done = subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=tmp_path / "head",
                              env=env)
        assert done.returncode == expected, (gate, merged)
        args = (tmp_path / "args").read_text().split()
        assert ("--accept" in args) == (accepted == "true")


def test_comment_workflow_posts_with_a_write_token_and_runs_no_pull_request_code():
    data, pr = workflow("memory-comment.yml"), workflow("memory-pr.yml")
    assert data["on"] == {"workflow_run": {"workflows": [pr["name"]], "types": ["completed"]}}
    assert data["jobs"]["comment"]["permissions"] == {"actions": "read", "pull-requests": "write"}
    assert not using(data, "actions/checkout")
    assert not any("run" in s for s in steps(data))
    download = using(data, "actions/download-artifact")[0]
    assert download["with"]["name"] == "memory-delta"
    script = script_of(data, "comment")
    assert f"const marker = '{MARKER}';" in script
    assert "updateComment" in script and "createComment" in script


def test_nightly_workflow_checks_merged_shards_and_uploads_plots_and_history():
    data = workflow("memory-nightly.yml")
    assert data["on"]["schedule"] == [{"cron": "17 3 * * *"}]
    assert list(data["jobs"]) == ["run", "baseline-check", "pages", "issue"]
    assert_sharded(data, "run", "baseline-check", "memory-nightly-shard")
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


def test_readme_links_the_gate_documentation():
    assert "(docs/gate.md)" in (ROOT / "README.md").read_text()
