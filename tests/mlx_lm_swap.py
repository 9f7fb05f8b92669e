"""Run one of mlx-lm's own test files with mlx-lm's rotating caches, or kvmem's in their place.

`python -m tests.mlx_lm_swap TESTS FILE MODEL {mlx_lm,reference} OUT [SKIP...]` runs the
`unittest` cases of `TESTS/FILE` but the `SKIP`ped ones (`Class.method`), with the model folder
`MODEL` loaded wherever the file loads its Hub model, and writes to `OUT` a JSON object:
`outcomes`, each test's "passed", "skipped", or "failed: " and the failure's last line, and
`swapped`, the modules in which the swap replaced a class.

It is a process of its own: the swap must be in place in every module before a test runs, and
these files change process-wide state they leave changed (test_generate points
`mlx_lm.generate.generation_stream` at a worker thread's stream, after which the interpreter
aborts at exit, so this one exits at once once `OUT` is written).

The swap finds mlx-lm's `RotatingKVCache` and `BatchRotatingKVCache` by identity wherever they
are bound (mlx-lm's modules, every model module among them, imported first since tests import
some later, and the test file) and binds subclasses of the reference caches carrying mlx-lm's
names in their place, so `save_prompt_cache` writes a name `load_prompt_cache` resolves.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import os
import pkgutil
import sys
import unittest
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx_lm.models
from mlx_lm.models import cache as mlx_cache
from mlx_lm.utils import load as load_folder

from reference_impl.rotating import PreallocatedRotatingKVCache
from reference_impl.rotating_batch import PreallocatedBatchRotatingKVCache


class RotatingKVCache(PreallocatedRotatingKVCache):
    """The reference single-sequence cache under mlx-lm's class name."""


class BatchRotatingKVCache(PreallocatedBatchRotatingKVCache, single=RotatingKVCache):
    """The reference batch cache under mlx-lm's class name; it extracts `RotatingKVCache`s."""


def import_models() -> None:
    """Every mlx-lm model module, so each binds its classes before the swap replaces them."""
    for info in pkgutil.iter_modules(mlx_lm.models.__path__, "mlx_lm.models."):
        # A few need packages kvmem does not install (olmo exits without ai2-olmo).
        with contextlib.suppress(Exception, SystemExit):
            importlib.import_module(info.name)


def swap(test_file: ModuleType) -> list[str]:
    """The modules whose bindings of mlx-lm's rotating classes now name the reference's."""
    replace: dict[Any, type] = {mlx_cache.RotatingKVCache: RotatingKVCache,
                                mlx_cache.BatchRotatingKVCache: BatchRotatingKVCache}
    modules = [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "mlx_lm"]
    swapped = []
    for module in [*modules, test_file]:
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value in replace:
                setattr(module, attr, replace[value])
                swapped.append(module.__name__)
    return sorted(set(swapped))


class Outcomes(unittest.TestResult):
    """Each test's outcome by `Class.method`."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, str] = {}

    @staticmethod
    def _name(test: unittest.TestCase) -> str:
        return ".".join(test.id().rsplit(".", 2)[-2:])

    def addSuccess(self, test: unittest.TestCase) -> None:
        self.outcomes[self._name(test)] = "passed"

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self.outcomes[self._name(test)] = "skipped"

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._failed(test, self.failures[-1][1])

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._failed(test, self.errors[-1][1])

    def _failed(self, test: unittest.TestCase, trace: str) -> None:
        last = trace.strip().splitlines()[-1] if trace.strip() else "?"
        self.outcomes[self._name(test)] = f"failed: {last}"


def run(tests: Path, file: str, model: Path, caches: str, skip: set[str]) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location(f"mlx_lm_tests.{Path(file).stem}", tests / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.load = lambda path, **kwargs: load_folder(str(model), **kwargs)
    import_models()
    swapped = swap(module) if caches == "reference" else []
    cases = [c for c in vars(module).values()
             if isinstance(c, type) and issubclass(c, unittest.TestCase) and c.__module__ == module.__name__]
    names = [f"{case.__name__}.{method}" for case in cases
             for method in unittest.defaultTestLoader.getTestCaseNames(case)]
    unknown = skip - set(names)
    if unknown:
        raise SystemExit(f"no such tests in {file}: {sorted(unknown)}")
    suite = unittest.TestSuite(getattr(module, name.split(".")[0])(name.split(".")[1])
                               for name in names if name not in skip)
    result = Outcomes()
    with contextlib.redirect_stdout(io.StringIO()):
        suite.run(result)
    return {"outcomes": result.outcomes, "swapped": swapped}


def main() -> None:
    tests, file, model, caches, out, *skip = sys.argv[1:]
    assert caches in ("mlx_lm", "reference"), caches
    ran = run(Path(tests), file, Path(model), caches, set(skip))
    Path(out).write_text(json.dumps(ran, indent=1, sort_keys=True))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
