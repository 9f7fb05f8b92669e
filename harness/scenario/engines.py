"""The engines a scenario's `engine:` may name, and what each serves: the schema checks a
scenario against this table. The class serving each is `harness.run.engines.engine_class`'s,
imported only when a variant names it (so neither the schema nor this table imports an engine,
nor MLX's models).

A new engine is one module under `harness/run/`, its name in `EngineName`, one entry here and
one branch in `engine_class`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EngineName = Literal["synthetic", "mlx_lm", "server"]


@dataclass(frozen=True)
class EngineEntry:
    """`real_model`: it builds a real mlx-lm model (`model:` names an mlx-lm preset or a local
    folder), else it feeds a geometry's synthetic K/V to the cache components. `http`: it sends
    `workload.http` to a server process, else it serves requests or a chat itself."""

    real_model: bool
    http: bool


# In EngineName's order (tests/test_engine.py holds them equal).
ENGINES: dict[EngineName, EngineEntry] = {
    "synthetic": EngineEntry(real_model=False, http=False),
    "mlx_lm": EngineEntry(real_model=True, http=False),
    "server": EngineEntry(real_model=True, http=True),
}


def named(test: str) -> str:
    """The engines whose entry has `test` true, as a message lists them (`mlx_lm or server`)."""
    return " or ".join(name for name, entry in ENGINES.items() if getattr(entry, test))
