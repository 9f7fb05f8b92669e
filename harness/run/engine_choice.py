"""The engine a scenario names (`engine:`, one of `harness.scenario.engines.EngineName`, which
the schema checks a scenario against): its module is imported here alone, only when a variant
names it, so mlx-lm's model code is imported for `engine: mlx_lm` alone.

Apart from the protocol (`harness.run.engines`), which every engine imports, so that the
engines and the choice among them do not import each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..scenario import ScenarioSpec
    from ..scenario.engines import EngineName
    from .engines import Engine, Progress
    from .probe import Probe


def engine_class(name: EngineName) -> type[Engine]:
    """The class serving `engine: name`, its module imported now (the one place engines are
    imported, each where it is named)."""
    if name == "mlx_lm":
        from .model_engine import ModelEngine
        return ModelEngine
    if name == "server":
        from .server_engine import ServerEngine
        return ServerEngine
    assert name == "synthetic", name
    from .synthetic_engine import SyntheticEngine
    return SyntheticEngine


def create(spec: ScenarioSpec, probe: Probe,
           progress: Progress | None = None) -> Engine:
    """The engine the scenario names (`engine:`), ready to serve in this process."""
    return engine_class(spec.engine)(spec, probe, progress)
