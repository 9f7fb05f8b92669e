"""Before any run: what each component a scenario file names is built from and where.

`harness.components.check` then resolves and builds them (user code once per file, in a child
process), so a component that exits, crashes or hangs at import is bad input rather than the
end of kvmem.
"""

from __future__ import annotations

import importlib.util

from ..components.registry import Binding
from .engines import ENGINES
from .schema import ScenarioSpec

EXTRA = "pip install 'kvmem[mlx]'"


def missing(spec: ScenarioSpec) -> str | None:
    """What a variant needs in kvmem's own environment that is not installed, as the message
    that says so and which extra brings it; None where nothing is missing. Every engine runs
    mlx-lm's models or caches in kvmem's process, except a server in an environment of its own."""
    if ENGINES[spec.engine].http and spec.serving().own_environment:
        return None
    if importlib.util.find_spec("mlx_lm") is not None:
        return None
    own = (" (or give the server an environment of its own: server.requires or server.python)"
           if ENGINES[spec.engine].http else "")
    return (f"engine: {spec.engine} runs mlx-lm in kvmem's own environment, and mlx-lm is not "
            f"installed: {EXTRA}{own}")


def bindings(spec: ScenarioSpec, where: str) -> list[Binding]:
    """The components a variant names, each with the argument its factory is called with
    (building the geometry, which on the mlx_lm engine may raise `models.ModelError`); none for
    a server, which uses its own caches."""
    if ENGINES[spec.engine].http:
        return []
    geometry = spec.geometry()
    recurrent = next((layer for layer in geometry.layers if layer.kind == "recurrent"),
                     geometry.layers[0])
    roles = {"layer": geometry.layers[0], "sliding": geometry.layers[0], "recurrent": recurrent,
             "store": geometry, "session": geometry}
    return [Binding(f"{where}cache.{role}", role, component.component, component.options,
                    first_arg)
            for role, first_arg in roles.items()
            if (component := getattr(spec.cache, role)) is not None]

