"""The code under test is measured but cannot choose how: a component that replaces one of MLX's
counters fails its variant, naming what replaced it, while its clean twin passes; a repository's
own `harness/` or `reference_impl/` never stands in for kvmem's, in kvmem's process or in a
variant's, and the repository's components are still found by their import paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from harness.agent import kvmem_agent
from harness.common.child import kvmem_first
from harness.common.units import MiB
from harness.run.server_engine import ServerError
from tests.conftest import make_spec, serve_with_engine
from tests.test_gate_pr import branch, commit, edit, gate, recorded  # noqa: F401 (fixtures)
from tests.test_serve import FIXTURES, fake

# A layer cache by import path, and twins of it that replace `mx.get_active_memory` with a
# function hiding 4 KiB: one when its module is imported, one in its first update.
COUNTERS = """\
import mlx.core as mx
from mlx_lm.models.cache import KVCache

_real = mx.get_active_memory


def fewer_bytes() -> int:
    return _real() - 4096


class Clean(KVCache):
    def __init__(self, spec):
        super().__init__()


class DuringUpdate(Clean):
    def update_and_fetch(self, keys, values):
        mx.get_active_memory = fewer_bytes
        return super().update_and_fetch(keys, values)
"""
AT_IMPORT = """\
import mlx.core as mx

from counters import Clean, fewer_bytes

mx.get_active_memory = fewer_bytes


class AtImport(Clean):
    pass
"""
SCENARIO = """\
name: counters
model: {dtype: float16, vocab: 256, layers: [{count: 2, kind: full, kv_heads: 2, head_dim: 32}]}
cache:
  layer: {component: "counters:Clean"}
  store: {component: reference.prefix_cache}
workload:
  prefill_chunk: 16
  requests: [{prompt: 32, decode: 4}]
variants:
  clean: {}
  at_import: {cache: {layer: {component: "at_import:AtImport"}}}
  during_update: {cache: {layer: {component: "counters:DuringUpdate"}}}
"""
# A package named like one of kvmem's, at the repository's root: it leaves a mark if imported.
SHADOW = 'open({marker!r}, "w").close()\nraise ImportError("the repository\'s own {name}")\n'


def replaced(where: str) -> str:
    return (f"mlx.core.get_active_memory was replaced by counters.fewer_bytes in {where}: kvmem "
            "reads MLX's memory through it, and the code it measures may not change it")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A repository with the components above and its own `harness/` and `reference_impl/`,
    after `kvmem run scenarios` there (the console script, as CI runs it); its exit status."""
    root = tmp_path_factory.mktemp("repository")
    for name in ("harness", "reference_impl"):
        (root / name).mkdir()
        (root / name / "__init__.py").write_text(SHADOW.format(marker=str(root / f"{name}.mark"),
                                                               name=name))
    (root / "counters.py").write_text(COUNTERS)
    (root / "at_import.py").write_text(AT_IMPORT)
    (root / "scenarios").mkdir()
    (root / "scenarios" / "counters.yaml").write_text(SCENARIO)
    kvmem = Path(sys.executable).with_name("kvmem")
    done = subprocess.run([str(kvmem), "run", "scenarios", "--out", "reports", "--jobs", "2"],
                          cwd=root, capture_output=True, text=True, timeout=300)
    return root, done.returncode


def summary(root: Path, variant: str) -> dict:
    return json.loads((root / "reports" / "counters" / variant / "summary.json").read_text())


def test_a_component_that_replaces_a_counter_fails_its_variant_naming_it(repository) -> None:
    root, code = repository
    assert code == 2  # a run that did not complete
    at_import, during_update = summary(root, "at_import"), summary(root, "during_update")
    assert (at_import["status"], at_import["error"]) == ("failed", replaced("the variant's process"))
    assert (during_update["status"], during_update["error"]) == (
        "failed", replaced("the variant's process"))
    assert (at_import["last_step"], during_update["last_step"]) == (0, 2)


def test_its_clean_twin_passes(repository) -> None:
    clean = summary(repository[0], "clean")
    assert (clean["status"], clean["error"], clean["passed"]) == ("ok", None, True)


def test_a_repository_of_its_own_harness_and_reference_impl_does_not_replace_kvmem(
        repository) -> None:
    """kvmem's process resolved `reference.prefix_cache`, the checking child and each variant's
    imported kvmem, all from kvmem's installation: neither package of the repository ran, and
    its `counters:Clean` was still found from the working directory."""
    root, _ = repository
    assert sorted(p.name for p in root.glob("*.mark")) == []
    assert summary(root, "clean")["metrics"]["steady"] > 0


def test_kvmem_first_takes_the_working_directory_off_the_path_for_a_while(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    before = list(sys.path)
    with kvmem_first():
        assert str(tmp_path) not in sys.path and "" not in sys.path
        assert os.environ["PYTHONSAFEPATH"] == "1"
    assert sys.path == before and "PYTHONSAFEPATH" not in os.environ


def test_the_agent_reads_past_a_replaced_counter_and_names_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    agent = kvmem_agent.Agent(60.0, None)
    assert agent.handle({"op": "rows"})["replaced"] is None
    keep = mx.zeros((2**18,), dtype=mx.float32)
    mx.eval(keep)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 0)
    answer = agent.handle({"op": "mark", "request": 0, "turn": -1})
    assert answer["rows"][0][5] >= MiB  # MLX's own count, not the replacement's
    assert answer["replaced"] == (
        "mlx.core.get_active_memory was replaced by tests.test_measuring_child."
        "test_the_agent_reads_past_a_replaced_counter_and_names_it.<locals>.<lambda> in the "
        "server: kvmem reads MLX's memory through it, and the code it measures may not change it")


def test_a_server_whose_code_replaces_a_counter_fails_its_variant(
        tmp_path: Path, model_path: str) -> None:
    """The agent binds MLX's counters before the server's code (here a plugin) is imported."""
    (tmp_path / "counters.py").write_text(COUNTERS + "\nmx.get_active_memory = fewer_bytes\n")
    spec = fake(model_path, requests=1, plugins=["counters"],
                env={"PYTHONPATH": os.pathsep.join([str(FIXTURES), str(tmp_path)])})
    with pytest.raises(ServerError) as failed:
        serve_with_engine(make_spec(**spec))
    assert str(failed.value) == replaced("the server")


def test_the_gate_fails_a_branch_whose_component_replaces_a_counter(branch) -> None:  # noqa: F811
    Path("counters.py").write_text(COUNTERS + "\nmx.get_active_memory = fewer_bytes\n")
    edit("layer: {component: mlx_lm.KVCache}", 'layer: {component: "counters:Clean"}')
    commit("a layer cache that hides 4 KiB from the counter")
    code, comment, result = gate()
    assert code == 2
    assert result["verdict"] == "regression"
    failure = "failed: " + replaced("the variant's process")
    assert [e["failure"] for e in result["entries"]] == [failure] * 2
    assert replaced("the variant's process") in comment
