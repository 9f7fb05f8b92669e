"""The engines a scenario's `engine:` may name, and what each serves: the schema checks a
scenario against this table, and `harness.run.engines` imports the class an entry names, by
its import path (so neither the schema nor this table imports an engine, nor MLX's models).

A new engine is one module under `harness/run/` and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineEntry:
    """`path`: the `module:Class` serving it. `real_model`: it builds a real mlx-lm model
    (`model:` names an mlx-lm preset or a local folder), else it feeds a geometry's synthetic
    K/V to the cache components. `http`: it sends `workload.http` to a server process, else
    it serves requests or a chat itself."""

    path: str
    real_model: bool
    http: bool


ENGINES: dict[str, EngineEntry] = {
    "synthetic": EngineEntry("harness.run.synthetic_engine:SyntheticEngine", real_model=False, http=False),
    "mlx_lm": EngineEntry("harness.run.model_engine:ModelEngine", real_model=True, http=False),
    "server": EngineEntry("harness.run.server_engine:ServerEngine", real_model=True, http=True),
}


def named(test: str) -> str:
    """The engines whose entry has `test` true, as a message lists them (`mlx_lm or server`)."""
    return " or ".join(name for name, entry in ENGINES.items() if getattr(entry, test))
