"""What every engine is: the protocol the synthetic, mlx_lm and server engines implement and
the failure an engine reports in its own words. Every engine imports this module; the one
that picks the engine a scenario names, `harness.run.engine_choice`, imports them.

A new engine is one module implementing `Engine`, its name and entry in
harness.scenario.engines, and one branch in `harness.run.engine_choice.engine_class`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..common.errors import KvmemError
from ..common.units import MiB

if TYPE_CHECKING:
    from ..judge.summary import ModelFacts
    from ..scenario import ScenarioSpec
    from .probe import Probe

# Told the steps served (a server: requests) and, now and then, a short note for the bar (a
# server's elapsed time, memory and what is over its budget so far).
Progress = Callable[..., None]

# What a variant's process holds beside what it serves: the interpreter, MLX, the sample rows.
RUNTIME_SLACK = 256 * MiB


class RunFailure(KvmemError, RuntimeError):
    """A failure whose message says all there is to say (a server that died, with its output):
    reported without the traceback other errors in a variant's process get."""


class Engine(Protocol):
    """Serves one variant in the process that creates it, one probe row per step.

    `estimate_bytes` bounds the variant's footprint before it is created (the size check, in
    the variant's process: it may import components); `serve` runs the whole workload; `facts`
    says what model it served and `store_stats` what its store says of itself, both for the
    summary; `close` releases what it holds, also after a failure.
    """

    def __init__(self, spec: ScenarioSpec, probe: Probe,
                 progress: Progress | None = None) -> None: ...

    @classmethod
    def estimate_bytes(cls, spec: ScenarioSpec) -> int: ...

    def serve(self) -> None: ...

    def facts(self) -> ModelFacts | None: ...

    def store_stats(self) -> dict[str, int | float] | None: ...

    def close(self) -> None: ...

