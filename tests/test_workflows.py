"""The GitHub workflows: valid against the vendored workflow schema, wired as the gate needs, and
shown in docs/gate.md exactly as they are."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from harness.gate.render import MARKER

WORKFLOWS = Path(__file__).resolve().parents[1] / ".github" / "workflows"
FILES = ("memory-pr.yml", "memory-comment.yml", "memory-nightly.yml")
ROOT = WORKFLOWS.parents[1]
GATE_DOC = ROOT / "docs" / "gate.md"
# A workflow shown in the docs: its path as a heading, then its YAML in one fenced block.
SHOWN = re.compile(rb"^### `\.github/workflows/([^`]+)`\n\n```yaml\n(.*?)^```$", re.M | re.S)


def check_schema(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
         *map(str, paths)], capture_output=True, text=True)


def workflow(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True)            # YAML 1.1 reads the bare key `on` as true
    return data


def steps(data: dict) -> list[dict]:
    return [step for job in data["jobs"].values() for step in job["steps"]]


def scripts(data: dict) -> str:
    return "\n".join(step.get("run", "") for step in steps(data))


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


def test_pull_request_workflow_runs_base_and_head_without_a_write_token():
    data = workflow("memory-pr.yml")
    assert list(data["on"]) == ["pull_request"]
    assert data["permissions"] == {"contents": "read"}
    assert len(data["jobs"]) == 1
    run = scripts(data)
    assert "merge-base" in run and "worktree add" in run
    assert "-m harness run scenarios --out ../reports/base" in run
    assert "-m harness run scenarios --out ../reports/head" in run
    assert "-m harness compare reports/base reports/head" in run
    uploads = [s for s in steps(data) if s.get("uses", "").startswith("actions/upload-artifact")]
    assert {s["with"]["name"] for s in uploads} == {"memory-delta", "memory-reports"}
    assert all(s["if"] == "always()" for s in uploads)


def test_comment_workflow_posts_with_a_write_token_and_runs_no_pull_request_code():
    data, pr = workflow("memory-comment.yml"), workflow("memory-pr.yml")
    assert data["on"] == {"workflow_run": {"workflows": [pr["name"]], "types": ["completed"]}}
    assert data["permissions"] == {"actions": "read", "pull-requests": "write"}
    uses = [s.get("uses", "") for s in steps(data)]
    assert not any(u.startswith("actions/checkout") for u in uses)
    assert not any("run" in s for s in steps(data))
    download = next(s for s in steps(data) if s.get("uses", "").startswith("actions/download"))
    assert download["with"]["name"] == "memory-delta"
    script = next(s for s in steps(data) if "script" in s.get("with", {}))["with"]["script"]
    assert f"const marker = '{MARKER}';" in script
    assert "updateComment" in script and "createComment" in script


def test_nightly_workflow_checks_the_baselines_and_uploads_plots():
    data = workflow("memory-nightly.yml")
    assert data["on"]["schedule"] == [{"cron": "17 3 * * *"}]
    assert data["permissions"] == {"contents": "read"}
    assert "-m harness baseline check --dir baselines" in scripts(data)
    upload = next(s for s in steps(data) if s.get("uses", "").startswith("actions/upload"))
    assert upload["if"] == "always()" and "reports/nightly/**/*.png" in upload["with"]["path"]


def shown_workflows(doc: bytes) -> dict[str, bytes]:
    """Each workflow file the document shows, by name, as the bytes of its fenced block."""
    found = [(name.decode(), body) for name, body in SHOWN.findall(doc)]
    names = [name for name, _ in found]
    assert len(names) == len(set(names)), f"a workflow is shown twice: {names}"
    return dict(found)


def test_documentation_shows_the_workflow_files_as_they_are():
    shown = shown_workflows(GATE_DOC.read_bytes())
    assert sorted(shown) == sorted(p.name for p in WORKFLOWS.glob("*.yml")) == sorted(FILES)
    for name in FILES:
        assert shown[name] == (WORKFLOWS / name).read_bytes(), name


def test_a_changed_byte_in_a_shown_workflow_is_caught():
    doc = GATE_DOC.read_bytes()
    original = (WORKFLOWS / "memory-nightly.yml").read_bytes()
    changed = doc.replace(b'cron: "17 3 * * *"', b'cron: "17 4 * * *"')
    assert changed != doc
    assert shown_workflows(changed)["memory-nightly.yml"] != original


def test_readme_links_the_gate_documentation():
    assert "(docs/gate.md)" in (ROOT / "README.md").read_text()
