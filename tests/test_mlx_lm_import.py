"""mlx-lm's package `__init__` deferred in kvmem's processes: the caches come without
transformers, and what needs the whole package gets it as if `__init__` had run first."""

from __future__ import annotations

import json
import subprocess
import sys
from multiprocessing.connection import Connection

import pytest

from harness.common.child import Child

PROBE = """
import json, sys, types
from harness.common.mlx_lm_import import defer_init

defer_init()
from mlx_lm.models.cache import KVCache
light = "transformers" in sys.modules
{first}
import mlx_lm
from mlx_lm import generate
print(json.dumps({{
    "light": light,
    "full": "transformers" in sys.modules,
    "generate": type(mlx_lm.generate).__name__,
    "convert": type(mlx_lm.convert).__name__,
    "from_generate": type(generate).__name__,
    "same_cache": mlx_lm.models.cache.KVCache is KVCache,
    "load": mlx_lm.load is mlx_lm.utils.load,
    "loader": type(mlx_lm.__spec__.loader).__name__,
    "version": mlx_lm.__version__ == mlx_lm._version.__version__,
}}))
"""


@pytest.mark.parametrize("first", [
    "import mlx_lm.generate",  # a submodule named like the function `__init__` binds over it
    "from mlx_lm.models import llama\nfrom mlx_lm.utils import load_model",
])
def test_the_whole_package_is_as_if_its_init_had_run_first(first):
    done = subprocess.run([sys.executable, "-c", PROBE.format(first=first)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout) == {
        "light": False, "full": True, "generate": "function", "convert": "function",
        "from_generate": "function", "same_cache": True, "load": True,
        "loader": "SourceFileLoader", "version": True}


def loaded(pipe: Connection) -> None:
    from mlx_lm.models.cache import KVCache  # noqa: F401

    pipe.send(sorted(name for name in sys.modules
                     if name.partition(".")[0] in ("mlx_lm", "transformers")))


def test_a_child_gets_mlx_lms_caches_without_transformers():
    with Child(loaded, grace=5) as child:
        modules = child.receive(timeout=60)
    assert "mlx_lm.models.cache" in modules
    assert "mlx_lm" not in modules  # the package itself waits for whatever needs it
    assert not [name for name in modules if name.startswith("transformers")]


HEALTHY = """
model:
  dtype: float16
  vocab: 256
  layers: [{count: 2, kind: full, kv_heads: 2, head_dim: 32}]
workload: {requests: [{prompt: 32, decode: 4}]}
cache: {layer: {component: mlx_lm.KVCache}}
variants: {kvcache: {}}
"""


def test_the_command_line_runs_a_scenario_on_mlx_lms_caches_without_transformers(tmp_path):
    path = tmp_path / "healthy.yaml"
    path.write_text(HEALTHY)
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print(sorted(m for m in ('mlx_lm.models.cache', 'transformers')"
            " if m in sys.modules)))\n"
            "from harness.__main__ import run\nrun()")
    done = subprocess.run([sys.executable, "-c", code, "run", str(path), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['mlx_lm.models.cache']", done.stdout[-2000:]
    assert json.loads((tmp_path / "out" / "healthy" / "kvcache" / "summary.json").read_text())[
        "status"] == "ok"
