"""Engines by name: what a scenario's `engine:` may say, and the class that serves it.

Each entry is `module:Class`, imported only when a variant names it, so mlx-lm's model code is
imported for `engine: mlx_lm` alone and the schema can take its choices from `ENGINES` without
importing any engine. A new engine is one module and one entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..scenario import ScenarioSpec
    from .engine import Engine
    from .probe import Probe

ENGINES: dict[str, str] = {
    "synthetic": "harness.run.engine:Engine",  # seeded K/V fed to the caches
    "mlx_lm": "harness.run.model_engine:ModelEngine",  # a real mlx-lm model, random weights
    "server": "harness.run.server_engine:ServerEngine",  # a real server under HTTP traffic
}


def create(spec: ScenarioSpec, probe: Probe,
           progress: Callable[[int], None] | None = None) -> Engine:
    """The engine the scenario names (`engine:`), ready to serve in this process."""
    module, _, name = ENGINES[spec.engine].partition(":")
    engine: type[Engine] = getattr(importlib.import_module(module), name)
    return engine(spec, probe, progress)
