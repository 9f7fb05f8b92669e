"""The public API as docs/api.md states it: every path on the page imports, `harness` exports
exactly the names listed from it, each old path warns and still works, and the gate and the
judge run where MLX is not installed."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import pytest

import harness
from harness.components import protocols
from harness.gate import definition
from tests.summaries import MiB, summary, write

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "api.md").read_text()
IMPORT = re.compile(r"`from ([\w.]+) import (\w+)`")


def _section(heading: str) -> str:
    return PAGE.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


DOCUMENTED = IMPORT.findall(_section("Import paths"))
MOVED = [(*row[0], row[1][0]) for row in (IMPORT.findall(line) for line in
         _section("Deprecation").splitlines() if line.startswith("| `from "))]


def test_the_page_lists_paths_and_moves():
    assert len(DOCUMENTED) == 25 and len(MOVED) == 6


def test_harness_exports_exactly_the_names_the_page_lists_from_it():
    assert sorted(name for module, name in DOCUMENTED if module == "harness") == harness.__all__


def test_harness_exports_every_protocol_and_base():
    """So `harness.protocols`, which forwards to `harness`, still holds all it held."""
    defined = {name for name, value in vars(protocols).items()
               if not name.startswith("_") and getattr(value, "__module__", None) == protocols.__name__}
    assert defined <= set(harness.__all__)


@pytest.mark.parametrize(("module", "name"), DOCUMENTED, ids=lambda part: part)
def test_a_documented_path_imports_without_a_warning(module, name):
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(f"from {module} import {name}", namespace)
    assert namespace[name] is not None


def test_a_name_of_harness_is_the_object_its_module_defines():
    assert harness.StoreBase is protocols.StoreBase
    with pytest.raises(AttributeError, match="module 'harness' has no attribute 'Nothing'"):
        _ = harness.Nothing


@pytest.mark.parametrize(("old", "name", "new"), MOVED, ids=lambda part: part)
def test_a_moved_name_works_from_its_old_path_and_warns_naming_the_new(old, name, new):
    namespace: dict = {}
    with pytest.warns(DeprecationWarning) as caught:
        exec(f"from {old} import {name}", namespace)
    (warning,) = caught
    assert str(warning.message) == (f"{old}.{name} has moved: import it from {new} "
                                    f"({old} is removed in kvmem 0.3.0)")
    assert warning.filename == "<string>"  # the importing line, not kvmem's own
    assert namespace[name] is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize(("old", "name"), [("harness.protocols", "Nothing"),
                                           ("harness.geometry", "build"),
                                           ("reference_impl.rotating", "KVCache")])
def test_an_old_path_holds_no_name_that_did_not_move(old, name):
    with pytest.raises(ImportError, match=re.escape(f"cannot import name {name!r} from {old!r}")):
        exec(f"from {old} import {name}", {})


# Run in an interpreter whose packages are this environment's but MLX's and mlx-lm's: the gate's
# modules and the judge's, a comparison on the command line and the scenario files read as the
# gate reads them (harness.gate.definition).
WITHOUT_MLX = """
import importlib, importlib.util, json, pkgutil, runpy, site, sys
site.addsitedir(sys.argv[1])
sys.path.insert(1, sys.argv[2])
assert importlib.util.find_spec("mlx") is None and importlib.util.find_spec("mlx_lm") is None
import harness, harness.gate, harness.judge
modules = [f"{package.__name__}.{found.name}" for package in (harness.gate, harness.judge)
           for found in pkgutil.iter_modules(package.__path__)]
for module in modules:
    importlib.import_module(module)
from pathlib import Path, PurePosixPath
from harness.gate import definition
root = Path(sys.argv[2])
files = [PurePosixPath(p.relative_to(root).as_posix()) for p in root.glob("scenarios/*.yaml")]
notes = []
found = definition.read(files, lambda f: (root / f).read_bytes(), notes, "head")
print(json.dumps({"modules": modules, "variants": sorted(map(list, found)), "notes": notes}))
sys.stdout.flush()
sys.argv = ["kvmem", "compare", "base", "head"]
try:
    runpy.run_module("harness", run_name="__main__")
finally:
    assert not [name for name in sys.modules if name.split(".")[0] in ("mlx", "mlx_lm")]
"""


@pytest.fixture
def site_without_mlx(tmp_path) -> Path:
    """This environment's installed packages, MLX's and mlx-lm's left out, as links."""
    site = tmp_path / "site"
    site.mkdir()
    for root in {Path(sysconfig.get_paths()["purelib"]), Path(sysconfig.get_paths()["platlib"])}:
        for entry in root.iterdir():
            if not entry.name.lower().startswith("mlx") and not (site / entry.name).exists():
                (site / entry.name).symlink_to(entry)
    return site


def test_the_gate_and_the_judge_run_where_mlx_is_not_installed(tmp_path, site_without_mlx):
    write(tmp_path / "base", summary("s", "v"))
    write(tmp_path / "head", summary("s", "v", steady=9 * MiB))
    done = subprocess.run([sys.executable, "-S", "-c", WITHOUT_MLX, str(site_without_mlx),
                           str(ROOT)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr  # the regression, judged
    report, verdict = done.stdout.split("\n", 1)
    read = json.loads(report)
    assert "harness.gate.definition" in read["modules"] and "harness.judge.detectors" in read["modules"]
    notes: list[str] = []
    files = [p.relative_to(ROOT) for p in ROOT.glob("scenarios/*.yaml")]
    expected = definition.read(files, lambda f: (ROOT / f).read_bytes(), notes, "head")
    assert read["variants"] == sorted(map(list, expected)) and read["notes"] == notes == []
    assert "memory regression in 1 of 1 variant" in verdict and "s/v" in verdict
