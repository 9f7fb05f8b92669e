"""Version bounds a component's package declares on mlx and mlx-lm: warned about once, never fatal."""

from __future__ import annotations

import json
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from harness.cli import main
from harness.components.registry import loaded_packages
from harness.components.requirements import bound_warnings
from harness.scenario import load_variants

STORE = '''
from harness.components.protocols import StoreBase


class Store(StoreBase):
    """Keeps nothing."""

    def store(self, tokens, caches):
        pass

    @property
    def nbytes(self):
        return 0
'''

REQUIRES = [
    "mlx-lm<0.1",                                   # violated: the one warning
    "mlx>=0.1",                                     # met
    'mlx-lm<0.2; sys_platform == "no-such-os"',     # another platform's bound
    'mlx<0.1; extra == "old"',                      # only with an extra
    "numpy<1",                                      # not a package kvmem watches
]


def _install(site: Path, name: str, requires: list[str]) -> None:
    """A package `name` as pip would leave it: the code and its dist-info metadata."""
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text("")
    (site / name / "store.py").write_text(STORE)
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0",
             *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    (info / "top_level.txt").write_text(f"{name}\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    _install(site, "oldstore", REQUIRES)
    _install(site, "newstore", ["mlx-lm>=0.30", "mlx>=0.30"])
    (site / "loose").mkdir()                        # a folder of code, no package metadata
    (site / "loose" / "store.py").write_text(STORE)
    monkeypatch.syspath_prepend(str(site))
    return site


def test_a_violated_bound_is_one_line_naming_package_loader_bound_and_installed(site):
    installed = metadata.version("mlx-lm")
    assert bound_warnings([("oldstore.store:Store", {"oldstore": "1.0"})]) == [
        f"oldstore.store:Store loads oldstore 1.0, which requires mlx-lm<0.1; "
        f"installed is {installed} (the run goes on)"]


def test_met_bounds_warn_nothing(site):
    assert bound_warnings([("newstore.store:Store", {"newstore": "1.0"})]) == []


def test_each_package_bound_is_warned_once(site):
    assert len(bound_warnings([("a:Store", {"oldstore": "1.0"}),
                               ("b:Store", {"oldstore": "1.0", "newstore": "1.0"})])) == 1


def test_the_packages_a_glue_module_loads_are_found_by_the_pre_run_check(site, tmp_path):
    (site / "loose" / "glue.py").write_text("from oldstore.store import Store\n")
    path = tmp_path / "glue.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"dtype": "float16", "vocab": 1024, "layers": [
            {"count": 1, "kind": "full", "kv_heads": 1, "head_dim": 64}]},
        "cache": {"store": {"component": "loose.glue:Store"}},
        "workload": {"requests": [{"prompt": 64}]}}))
    (variant,) = load_variants(path)
    assert variant.packages == {"oldstore": "1.0"}      # kvmem's own packages aside
    assert loaded_packages(["oldstore.store", "loose.glue", "harness.cli"]) == {"oldstore": "1.0"}


def test_run_warns_once_and_still_runs(site, tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({
        "name": "old", "model": {"dtype": "float16", "vocab": 1024, "layers": [
            {"count": 1, "kind": "full", "kv_heads": 1, "head_dim": 64}]},
        "cache": {"store": {"component": "oldstore.store:Store"}},
        "workload": {"prefill_chunk": 64, "requests": [{"prompt": 64, "decode": 2}]},
        "variants": {"a": {}, "b": {"workload": {"prefill_chunk": 32}}}}))
    assert main(["run", str(path), "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert output.count("requires mlx-lm<0.1") == 1, output
    summary = json.loads((tmp_path / "out" / "old" / "b" / "summary.json").read_text())
    assert summary["environment"]["packages"] == {"oldstore": "1.0"}
    kvmem = summary["environment"]["kvmem"]                 # kvmem's own, not the folder's
    harness = Path(__file__).resolve().parent.parent / "harness"
    revision = subprocess.run(["git", "-C", str(harness), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=False).stdout.strip()
    assert kvmem == {"version": metadata.version("kvmem"), "revision": revision or None}
