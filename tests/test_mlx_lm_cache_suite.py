"""mlx-lm's own tests of its caches, generation and models, run on kvmem's rotating caches.

The test files come from the source distribution of the installed mlx-lm (never copied into this
repository): from the folder `KVMEM_MLX_LM_TESTS` names, else downloaded once with pip into
pytest's cache. Each file runs in a process of its own (`tests/mlx_lm_swap.py`) with the
reference caches bound wherever mlx-lm's `RotatingKVCache` and `BatchRotatingKVCache` are, and
must pass every test but those excluded below, which fail with mlx-lm's own classes too. Where
one fails, the file runs again with mlx-lm's classes: a test they fail as well is the
stand-in's or a new mlx-lm's to fix (or to exclude, with a reason), not the swap's. The files
load `mlx-community/Qwen1.5-0.5B-Chat-4bit` from the Hugging Face Hub; a generated `qwen2-tiny`
folder (random weights, a byte-level BPE tokenizer: `harness.models.folder`) loads in its place.
Offline with neither the folder nor pip, the test is skipped.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from packaging.version import Version

from harness.models.folder import folder
from harness.models.loading import ModelChoice

VERSION = importlib.metadata.version("mlx-lm")
REAL_WEIGHTS = "the real model's output: the stand-in's weights are random"
# Tests that cannot pass here, each with why; every other test in each file must pass with
# mlx-lm's classes and with the reference caches.
EXCLUDED: dict[str, dict[str, str]] = {
    "test_generate.py": {
        "TestGenerate.test_generate_with_logit_bias":
            "expects '!!!!!', token 0 in Qwen's vocabulary; the stand-in's token 0 is special",
        "TestGenerate.test_stream_generate_input_embeddings": REAL_WEIGHTS + " (expects 'TEST')",
        "TestGenerate.test_stream_generate_input_embeddings_prefill":
            REAL_WEIGHTS + " (expects 'TEST')",
    },
    "test_prompt_cache.py": {},
    "test_models.py": {
        "TestModels.test_bitnet": "a Metal kernel; MLX runs on its CPU backend here",
        "TestModels.test_gated_delta": "a Metal kernel; MLX runs on its CPU backend here",
        "TestModels.test_gated_delta_masked": "a Metal kernel; MLX runs on its CPU backend here",
    },
}
# mlx-lm 0.31: two of its own tests fail with its own classes on the CPU stand-in model, and
# its files hold a cache's state and meta_state apart, where the reference caches keep 0.32's
# single state (docs/reference_caches.md).
OWN_STATE = "mlx-lm before 0.32 saves state and meta_state apart; the reference caches keep one"
if Version(VERSION) < Version("0.32"):
    EXCLUDED["test_generate.py"] |= {
        "TestGenerate.test_generate_with_processor":
            "fails with mlx-lm 0.31's own classes here (6 != 8 tokens processed)",
        "TestGenerate.test_batch_continued_generation_ssm":
            "fails with mlx-lm 0.31's own classes here",
    }
    EXCLUDED["test_prompt_cache.py"] |= {
        "TestPromptCache.test_save_load_batch_caches": OWN_STATE,
        "TestPromptCache.test_save_load_cache_list": OWN_STATE,
        "TestPromptCache.test_save_load_mixed_cache": OWN_STATE,
        "TestPromptCache.test_save_load_rotating_cache": OWN_STATE,
    }


def _download(folder: Path) -> Path | None:
    """mlx-lm's tests folder from its source distribution, fetched with pip into `folder`."""
    tests = folder / f"mlx_lm-{VERSION}" / "tests"
    if all((tests / name).exists() for name in EXCLUDED):
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
    return tests if all((tests / name).exists() for name in EXCLUDED) else None


@pytest.fixture(scope="module")
def mlx_lm_tests(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    named = os.environ.get("KVMEM_MLX_LM_TESTS")
    if named:
        missing = [name for name in EXCLUDED if not (Path(named) / name).exists()]
        if missing:
            pytest.fail(f"KVMEM_MLX_LM_TESTS={named} holds no {', '.join(missing)}")
        return Path(named)
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    found = _download(Path(cache.mkdir("mlx_lm_sdist")) if cache else tmp_path_factory.mktemp("mlx_lm"))
    if found is None:
        pytest.skip(f"mlx-lm {VERSION}'s tests are not available: set KVMEM_MLX_LM_TESTS to a "
                    f"folder holding {', '.join(EXCLUDED)}, or allow pip to download its sdist")
    return found


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Hub model's stand-in: qwen2 like it, float32 as test_generate casts it."""
    choice = ModelChoice("qwen2-tiny", None, None, None, "float32", None, 64)
    return folder(choice, tmp_path_factory.mktemp("models"))


def run(tests: Path, file: str, model: Path, caches: str, out: Path) -> dict:
    """`file` run with mlx-lm's caches ("mlx_lm") or the reference caches ("reference"): each
    test's outcome, and the modules in which the swap replaced a class."""
    written = out / f"{caches}.json"
    child = subprocess.run(
        [sys.executable, "-m", "tests.mlx_lm_swap", str(tests), file, str(model), caches,
         str(written), *EXCLUDED[file]],
        cwd=Path(__file__).parent.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, timeout=300, check=False)
    assert child.returncode == 0 and written.exists(), f"{caches}: {child.stderr[-3000:]}"
    return json.loads(written.read_text())


def failed(outcomes: dict[str, str]) -> dict[str, str]:
    return {name: outcome for name, outcome in outcomes.items() if outcome.startswith("failed")}


@pytest.mark.parametrize("file", EXCLUDED)
def test_reference_caches_pass_what_mlx_lm_caches_pass(file, mlx_lm_tests, stand_in, tmp_path):
    ran = run(mlx_lm_tests, file, stand_in, "reference", tmp_path)
    ours = ran["outcomes"]
    swapped = {"mlx_lm.models.cache", f"mlx_lm_tests.{Path(file).stem}"}
    assert swapped <= set(ran["swapped"]), "the swap missed mlx-lm's classes"
    assert len(ours) > 0
    if failed(ours):  # whose failure is it? mlx-lm's own classes say
        theirs = run(mlx_lm_tests, file, stand_in, "mlx_lm", tmp_path)["outcomes"]
        assert failed(theirs) == {}, \
            "with mlx-lm's own classes: fix the stand-in or exclude with a reason"
    assert failed(ours) == {}, "the reference caches fail what mlx-lm's classes pass"
