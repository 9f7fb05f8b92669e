"""mlx-lm's own prompt-cache tests, run on kvmem's rotating caches.

The test file comes from the source distribution of the installed mlx-lm (never copied into this
repository): from the folder `KVMEM_MLX_LM_TESTS` names, else downloaded once with pip into
pytest's cache. Its module-level `RotatingKVCache` and `BatchRotatingKVCache`, and mlx-lm's own
(which `load_prompt_cache` looks classes up in), are swapped for empty subclasses of the
reference caches carrying those names. Offline with neither, the test is skipped.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import unittest
from pathlib import Path
from types import ModuleType

import pytest
from mlx_lm.models import cache as mlx_cache

from reference_impl.rotating import PreallocatedBatchRotatingKVCache, PreallocatedRotatingKVCache

VERSION = importlib.metadata.version("mlx-lm")
TEST_FILE = "test_prompt_cache.py"
# Tests that cannot run here, each with why; every other test in the file must pass.
EXCLUDED = {
    "test_cache_with_generate": "loads a model from the Hugging Face Hub (network, weights)",
    "test_trim_cache_with_generate": "loads a model from the Hugging Face Hub (network, weights)",
    "test_cache_to_quantized": "loads a model from the Hugging Face Hub (network, weights)",
}


class RotatingKVCache(PreallocatedRotatingKVCache):
    """The reference single-sequence cache under mlx-lm's class name."""


class BatchRotatingKVCache(PreallocatedBatchRotatingKVCache):
    """The reference batch cache under mlx-lm's class name."""


def _download(folder: Path) -> Path | None:
    """mlx-lm's tests folder from its source distribution, fetched with pip into `folder`."""
    tests = folder / f"mlx_lm-{VERSION}" / "tests"
    if (tests / TEST_FILE).exists():
        return tests
    fetched = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "--quiet", "--retries", "1", "--timeout", "30", "--dest", str(folder), f"mlx-lm=={VERSION}"],
        capture_output=True, text=True, timeout=300, check=False)
    archives = sorted(folder.glob(f"mlx_lm-{VERSION}.tar.gz"))
    if fetched.returncode != 0 or not archives:
        return None
    with tarfile.open(archives[0]) as archive:
        archive.extractall(folder, filter="data")
    return tests if (tests / TEST_FILE).exists() else None


@pytest.fixture(scope="module")
def mlx_lm_tests(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    named = os.environ.get("KVMEM_MLX_LM_TESTS")
    if named:
        folder = Path(named)
        if not (folder / TEST_FILE).exists():
            pytest.fail(f"KVMEM_MLX_LM_TESTS={named} holds no {TEST_FILE}")
        return folder
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    found = _download(Path(cache.mkdir("mlx_lm_sdist")) if cache else tmp_path_factory.mktemp("mlx_lm"))
    if found is None:
        pytest.skip(f"mlx-lm {VERSION}'s tests are not available: set KVMEM_MLX_LM_TESTS to a "
                    f"folder holding its {TEST_FILE}, or allow pip to download its sdist")
    return found


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("mlx_lm_test_prompt_cache", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_caches_pass_mlx_lm_prompt_cache_tests(mlx_lm_tests, monkeypatch):
    module = _load(mlx_lm_tests / TEST_FILE)
    for cls in (RotatingKVCache, BatchRotatingKVCache):
        monkeypatch.setattr(module, cls.__name__, cls)
        monkeypatch.setattr(mlx_cache, cls.__name__, cls)
    # The class set-up loads a model for the excluded tests only.
    monkeypatch.setattr(module, "load", lambda path: (None, None))
    names = unittest.defaultTestLoader.getTestCaseNames(module.TestPromptCache)
    assert set(EXCLUDED) <= set(names), "an excluded test is gone: update EXCLUDED"
    suite = unittest.TestSuite(module.TestPromptCache(n) for n in names if n not in EXCLUDED)
    result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(suite)
    failed = {test.id().rsplit(".", 1)[-1]: trace for test, trace in result.failures + result.errors}
    assert failed == {}, "\n".join(f"{name}:\n{trace}" for name, trace in failed.items())
    assert result.testsRun == len(names) - len(EXCLUDED) > 0
