"""Before any run: what each component a scenario file names is built from and where.

`harness.components.check` then resolves and builds them (user code once per file, in a child
process), so a component that exits, crashes or hangs at import is bad input rather than the
end of kvmem.
"""

from __future__ import annotations

from ..components.registry import Binding
from .schema import ScenarioSpec


def bindings(spec: ScenarioSpec, where: str) -> list[Binding]:
    """The components a variant names, each with the argument its factory is called with
    (building the geometry, which on the mlx_lm engine may raise `models.ModelError`)."""
    geometry = spec.geometry()
    roles = {"layer": geometry.layers[0], "sliding": geometry.layers[0],
             "store": geometry, "session": geometry}
    return [Binding(f"{where}cache.{role}", role, component.component, component.options,
                    first_arg)
            for role, first_arg in roles.items()
            if (component := getattr(spec.cache, role)) is not None]

