"""A wheel carries the bundled scenarios, the example stores some of them name by import path,
and `kvmem init`'s templates; outside a checkout `kvmem list` falls back to the scenarios, and
every one of them is valid there.

The wheel is built by pip from a copy of the sources (a build in the tree would leave `build/`
there) and installed, without its dependencies, into a fresh virtual environment that reads
them from the one running the tests: a `.pth` file names this environment's site-packages.
(`--system-site-packages` would name the base interpreter's, which has no MLX on a fresh CI
machine.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from harness import adopt
from harness.cli import main
from harness.scenario import packaged

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "harness", "reference_impl", "scenarios",
           "examples")
SCENARIOS = sorted(p.relative_to(ROOT / "scenarios").as_posix()
                   for p in (ROOT / "scenarios").rglob("*.yaml"))
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def build_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout, built by pip from a copy of its sources."""
    tree, out = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("dist")
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, tree / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                            "--wheel-dir", str(out), str(tree)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    return next(out.glob("kvmem-*.whl"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory)


def fresh_environment(folder: Path) -> Path:
    """A new virtual environment in `folder` that reads this one's packages through a `.pth`
    file, so pip finds kvmem's dependencies installed and needs no index; its site-packages."""
    venv.create(folder, with_pip=False)
    paths = {"base": str(folder), "platbase": str(folder)}
    site = Path(sysconfig.get_path("purelib", vars=paths))
    outer = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "outer.pth").write_text("\n".join(sorted(outer)) + "\n")
    return site


def test_the_wheel_holds_every_scenario_the_examples_and_what_init_writes(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"harness/bundled/{name}" for name in SCENARIOS} <= names
    assert {f"harness/shipped/examples/{name}" for name in EXAMPLES} <= names
    assert not any(name.startswith("examples/") for name in names)  # no top-level `examples`
    assert {f"harness/adopt/templates/{name}" for name in adopt.templates()} <= names
    assert {"harness/py.typed", "reference_impl/py.typed"} <= names  # docs/api.md's types
    assert "harness/bundled/kvmem-scenario.schema.json" in names  # the bundled files' $schema


def test_kvmem_list_in_an_empty_folder_shows_the_installed_wheels_scenarios(wheel, tmp_path):
    env = tmp_path / "venv"
    site = fresh_environment(env)
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install",
         "--quiet", "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-2000:]
    empty = tmp_path / "empty"
    empty.mkdir()
    listed = subprocess.run([str(env / "bin" / "kvmem"), "list"], cwd=empty, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert f"bundled with kvmem, in {site / 'harness' / 'bundled'}/" in listed.stdout
    assert "qwen3_8b_growth.yaml" in listed.stdout
    # canaries.yaml and import_path_leak.yaml name the shipped example stores by import path.
    assert "import_path_leak.yaml" in listed.stdout and "invalid" not in listed.stdout
    ran = subprocess.run([str(env / "bin" / "kvmem"), "run", "scenarios/import_path_leak.yaml",
                          "--variant", "leaky", "--out", "out"], cwd=empty, capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert (empty / "out" / "import_path_leak" / "leaky" / "summary.json").exists()


def test_an_editable_install_lists_the_scenarios_through_the_link(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "using the scenarios bundled with kvmem" in out
    assert all(Path(name).name in out for name in SCENARIOS if "/" not in name)


def test_only_a_missing_scenarios_folder_falls_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found, note = packaged.fallback(["scenarios/a.yaml", "mine.yaml"])
    assert found == [packaged.BUNDLED / "a.yaml", Path("mine.yaml")] and note
    assert packaged.fallback(["other"]) == ([Path("other")], None)
    (tmp_path / "scenarios").mkdir()
    assert packaged.fallback(["scenarios/a.yaml"]) == ([Path("scenarios/a.yaml")], None)
