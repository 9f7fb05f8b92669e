"""A server in an environment of its own: built once with uv from `server.requires`, cached by
its exact requirements and reused offline, or an interpreter the scenario names; the model
folder is built by that interpreter, so kvmem itself needs no mlx-lm. The fake server
(tests/fixtures/server) runs in it. Building an environment reads the package registry, as
`.ci/run`'s install does."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.judge.summary import Environment
from harness.pipeline.isolation import execute
from harness.pipeline.suite import summarize
from harness.run import server_env
from harness.scenario import load_variants
from harness.scenario.server import ServerSpec
from tests.test_serve import ENTRY, fake, servers

ROOT = Path(__file__).resolve().parents[1]
MLX = md.version("mlx")
# What the fake server and the model folder need in an environment of their own.
REQUIRES = [f"mlx-lm=={md.version('mlx-lm')}", f"mlx[cpu]=={MLX}; sys_platform == 'linux'",
            f"mlx=={MLX}; sys_platform == 'darwin'"]


def run_variant(tmp_path: Path, scenario: dict) -> dict:
    """The summary of the scenario's one variant, run in its own process."""
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    (variant,) = load_variants(path)
    outcome = execute(variant, timeout=300)
    _, _, summary = summarize(outcome, Environment(backend="cpu", mlx=MLX, mlx_lm="?"), tmp_path)
    return json.loads(summary.to_json())


def test_an_environment_is_keyed_by_its_exact_requirements() -> None:
    one = ServerSpec(requires=["vllm-mlx==0.6.0", "fastapi"])
    assert server_env.key(one) == server_env.key(ServerSpec(requires=["fastapi", "vllm-mlx==0.6.0"]))
    assert server_env.key(one) != server_env.key(ServerSpec(requires=["vllm-mlx==0.5.0", "fastapi"]))
    assert server_env.key(one) != server_env.key(
        ServerSpec(requires=["fastapi"], requires_no_deps=["vllm-mlx==0.6.0"]))


def test_a_complete_environment_is_reused_without_uv_and_a_partial_one_rebuilt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = ServerSpec(requires=["fastapi"], requires_no_deps=["vllm-mlx==0.6.0"])
    folder = tmp_path / "envs" / server_env.key(server)
    calls: list[tuple[str, ...]] = []

    def uv(asked: list[str], *args: str) -> str:
        calls.append(args)
        if args[0] == "venv":
            Path(args[-1]).mkdir(parents=True)
        return "fastapi==0.1\nvllm-mlx==0.6.0\n" if args[:2] == ("pip", "freeze") else ""

    monkeypatch.setattr(server_env, "_uv", uv)
    folder.mkdir(parents=True)
    (folder / "left-over").write_text("a build cut short")  # no record: incomplete
    assert server_env.environment(server, tmp_path) == folder / "bin" / "python"
    assert [c[:2] for c in calls] == [("venv", "--python"), ("pip", "install"),
                                      ("pip", "install"), ("pip", "freeze")]
    assert "--no-deps" in calls[2] and calls[2][-1] == "vllm-mlx==0.6.0"
    assert not (folder / "left-over").exists()
    assert server_env.installed(folder) == {"fastapi": "0.1", "vllm-mlx": "0.6.0"}
    calls.clear()
    server_env.environment(server, tmp_path)  # complete: offline, nothing run
    assert calls == []


def test_the_servers_interpreter_folder_comes_first_on_path() -> None:
    python = "/envs/abc/bin/python"
    assert server_env.activated(python, {"PATH": "/usr/bin:/bin", "HOME": "/h"}) == {
        "PATH": "/envs/abc/bin:/usr/bin:/bin", "HOME": "/h"}
    assert server_env.activated(python, {})["PATH"] == f"/envs/abc/bin:{os.defpath}"


def test_a_console_script_of_the_servers_environment_starts_it(tmp_path: Path,
                                                               model_path: str) -> None:
    """`command: "fake-serve ..."`: a script only the environment's `bin/` holds, run by name
    as `rapid-mlx serve` is. The environment here is a folder whose `python` runs this one."""
    bin_dir = tmp_path / "env" / "bin"
    bin_dir.mkdir(parents=True)
    scripts = {"python": f'#!/bin/sh\nexec "{sys.executable}" "$@"\n',
               "fake-serve": '#!/bin/sh\nexec python -m fake_server "$@"\n'}
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    scenario = fake(model_path, requests=1, python=str(bin_dir / "python"),
                    command=f"fake-serve --port {{port}} --entry {ENTRY}")
    summary = run_variant(tmp_path, scenario)
    assert summary["status"] == "ok", summary["error"]
    assert not servers()


def test_a_failed_build_fails_its_variant_naming_the_package_and_why(
        tmp_path: Path, model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
    missing = "kvmem-no-such-package-7f3a==1.0"
    summary = run_variant(tmp_path, fake(model_path, requires=[missing]))
    assert summary["status"] == "failed"
    assert summary["error"].startswith(f"cannot build the server's environment ({missing}): uv "
                                       "pip install failed:")
    assert "kvmem-no-such-package-7f3a" in summary["error"].split("failed:", 1)[1]
    assert "Traceback" not in summary["error"]
    assert [p.name for p in (tmp_path / "cache" / "envs").iterdir()] == [
        server_env.key(ServerSpec(requires=[missing])) + ".lock"]  # no half environment
    assert not servers()


def test_a_server_runs_in_the_environment_kvmem_builds_once(
        tmp_path: Path, model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
    note = tmp_path / "note.txt"
    scenario = fake(model_path, "--note", str(note), requests=2, requires=REQUIRES)
    summary = run_variant(tmp_path, scenario)
    assert summary["status"] == "ok", summary["error"]
    (env,) = [p for p in (tmp_path / "cache" / "envs").iterdir() if p.is_dir()]
    assert note.read_text().split()[2] == str(env / "bin" / "python")  # {python}: the server's
    packages = {"mlx": MLX, "mlx-lm": md.version("mlx-lm")}
    assert summary["model"]["packages"] == packages
    assert summary["environment"]["mlx_lm"] == md.version("mlx-lm")
    # Reused as it is: a second run runs no uv, so it works offline.
    monkeypatch.setattr(server_env, "uv", lambda: "/no/uv/offline")
    assert run_variant(tmp_path, scenario)["status"] == "ok"
    assert not servers()


def test_a_server_in_an_interpreter_the_scenario_names(tmp_path: Path,
                                                       model_path: str) -> None:
    note = tmp_path / "note.txt"
    python = str(Path(sys.executable))
    summary = run_variant(tmp_path, fake(model_path, "--note", str(note), requests=1,
                                            python=python))
    assert summary["status"] == "ok", summary["error"]
    assert note.read_text().split()[2] == python
    assert summary["model"]["packages"]["mlx-lm"] == md.version("mlx-lm")


def test_without_mlx_lm_kvmem_serves_a_server_of_its_own_and_names_the_extra_elsewhere(
        tmp_path: Path, model_path: str) -> None:
    """mlx-lm hidden from kvmem's processes (its import fails, as where it is not installed):
    the CLI, and a server with an interpreter of its own, work; an engine that needs mlx-lm in
    kvmem's process is bad input naming the extra, exit 2."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['mlx_lm'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(blocker)}

    def kvmem(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    listed = kvmem("list")
    assert listed.returncode == 0 and "qwen3_8b_growth" in listed.stdout
    assert "built by mlx-lm, which is not installed: pip install 'kvmem[mlx]'" in " ".join(
        listed.stdout.split())
    refused = kvmem("run", "scenarios/qwen3_8b_growth.yaml", "--out", str(tmp_path / "r"))
    assert refused.returncode == 2
    assert ("engine: synthetic runs mlx-lm in kvmem's own environment, and mlx-lm is not "
            "installed: pip install 'kvmem[mlx]'") in " ".join(refused.stderr.split())
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(fake(model_path, requests=2, python=sys.executable)))
    served = kvmem("run", str(path), "--out", str(tmp_path / "out"))
    assert served.returncode == 0, served.stdout + served.stderr
    assert not servers()
