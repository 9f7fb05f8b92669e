"""mlx-lm's caches without mlx-lm's start-up: 0.2 s instead of 2 s in each of kvmem's processes.

`import mlx_lm.models.cache` runs `mlx_lm/__init__.py` first, which imports mlx-lm's converter,
generator and loader, and through them transformers: 1.8 of the 2 s on the 2-core CPU machine.
kvmem's command line and every variant's process paid it, though most of them use mlx-lm's cache
classes alone.

`defer_init()` imports `mlx_lm.models.cache` under the package without running its `__init__`,
then takes the package out of `sys.modules`, so that whatever needs the package itself brings
it in by the import system's usual path: `import mlx_lm`, `from mlx_lm import load`, `import
mlx_lm.generate`, a model file's `from ..utils import ...`. That import runs the real `__init__`
into the same module object (`_Resume`), which already holds `models`: afterwards everything is
as if `__init__` had run first. `from mlx_lm.models.cache import KVCache` and new model files
under `mlx_lm.models` never need it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

PACKAGE = "mlx_lm"


class _Resume(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `mlx_lm` while its `__init__` waits: the package object that holds `models`
    already, into which the real `__init__` then runs."""

    def __init__(self, package: ModuleType, spec: ModuleSpec) -> None:
        self.package = package
        self.spec = spec

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != PACKAGE:
            return None
        spec = importlib.util.spec_from_loader(PACKAGE, self, origin=self.spec.origin,
                                               is_package=True)
        assert spec is not None
        spec.submodule_search_locations = self.spec.submodule_search_locations
        return spec

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        return self.package

    def exec_module(self, module: ModuleType) -> None:
        sys.meta_path.remove(self)
        assert self.spec.loader is not None
        self.spec.loader.exec_module(module)
        module.__spec__ = self.spec


def defer_init() -> None:
    """Import mlx-lm's cache module now and the rest of mlx-lm when something first needs it.
    Does nothing where mlx-lm is imported already, deferred already, or not importable."""
    if PACKAGE in sys.modules or any(isinstance(f, _Resume) for f in sys.meta_path):
        return
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        return
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    try:
        importlib.import_module(f"{PACKAGE}.models.cache")
    except ImportError:  # the usual import will say what is wrong, where it is needed
        for name in [n for n in sys.modules if n.startswith(f"{PACKAGE}.")]:
            del sys.modules[name]
        return
    finally:
        del sys.modules[PACKAGE]
    sys.meta_path.insert(0, _Resume(package, spec))
