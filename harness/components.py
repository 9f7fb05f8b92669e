"""Cache components by registry name or import path.

A scenario names each component either by a registry name (`mlx_lm.KVCache`,
`reference.prefix_cache`) or by an import path `package.module:attr`, so a user can profile
their own cache code without touching the harness. mlx-lm's own classes are driven as they are,
through the small factories in `harness.adapters`. Nothing here imports MLX or mlx-lm: a
scenario is checked against the registry without loading them.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .child import Child, how
from .echo import MAX_ECHO, clip, echo

REGISTRY: dict[str, str] = {
    "mlx_lm.KVCache": "harness.adapters:kv_cache",
    "mlx_lm.RotatingKVCache": "harness.adapters:rotating_kv_cache",
    "mlx_lm.BatchRotatingKVCache": "harness.adapters:batch_rotating_kv_cache",
    "mlx_lm.QuantizedKVCache": "harness.adapters:quantized_kv_cache",
    "reference.rotating": "reference_impl.rotating:rotating",
    "reference.batch_rotating": "reference_impl.rotating:batch_rotating",
    "reference.prefix_cache": "reference_impl.prefix_cache:prefix_cache",
    "reference.paged_ssd": "reference_impl.paged_ssd:PagedSSDStore",
    "reference.turboquant": "reference_impl.turboquant:turboquant",
    "reference.chat": "reference_impl.chat:ChatSession",
    "mlx_lm.LRUPromptCache": "harness.adapters:lru_prompt_cache",
    "adapt.remaining": "harness.adapters:remaining",
}


class ComponentError(ValueError):
    """A component name or import path that does not resolve to a callable."""


def resolve(name: str) -> Callable[..., Any]:
    """The factory behind a registry name or a `package.module:attr` import path."""
    path = REGISTRY.get(name, name)
    if ":" not in path:
        known = ", ".join(sorted(REGISTRY))
        raise ComponentError(
            f"unknown component {echo(name)}: expected one of {known}, "
            "or an import path 'package.module:factory'"
        )
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's path, not ours
        raise ComponentError(f"cannot import module {echo(module_name)} for {echo(name)}: "
                             f"{clip(str(exc))}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ComponentError(f"{echo(module_name)} has no callable {echo(attr)} (from {echo(name)})")
    return factory


def construct(component: Any, first_arg: Any) -> Any:
    """What a scenario component (an object with `component` and `options`) makes of its
    first argument: a layer's cache from its LayerSpec, a store or session from the geometry."""
    return resolve(component.component)(first_arg, **component.options)


def is_import_path(name: str) -> bool:
    """Whether a component name is user code by import path rather than a registry name."""
    return name not in REGISTRY and ":" in name


def import_paths(components: Iterable[Any]) -> list[str]:
    """The import paths among scenario components (objects with `component` and `options`),
    with the store that `adapt.remaining` wraps, each once, in order."""
    names: dict[str, None] = {}
    for spec in components:
        wrapped = spec.options.get("store") if spec.component == "adapt.remaining" else None
        for name in (spec.component, wrapped):
            if isinstance(name, str) and is_import_path(name):
                names[name] = None
    return list(names)


@dataclass(frozen=True)
class Binding:
    """One component of a scenario to check: where it is named, what, and its first argument."""

    field: str  # e.g. "variant 'after': cache.store"
    name: str
    options: dict[str, Any]
    first_arg: Any


def _bind(binding: Binding) -> str | None:
    """Why `binding` cannot be constructed as written, or None when it can."""
    try:
        factory = resolve(binding.name)
    except ComponentError as exc:
        return f"{binding.field}.component: {exc}"
    try:
        inspect.signature(factory).bind(binding.first_arg, **binding.options)
    except TypeError as exc:
        return f"{binding.field}.options: {clip(str(exc))} (for {clip(binding.name, MAX_ECHO)})"
    except ValueError:
        pass  # builtins without a signature: the run will tell
    return None


def _bind_in_child(bindings: list[Binding], pipe: Any) -> None:
    pipe.send([_bind(b) for b in bindings])


IMPORT_TIMEOUT = 120.0  # seconds for a child to import and bind a scenario's user components


def check(bindings: list[Binding]) -> list[str]:
    """Why each component cannot be built, so a typo fails before any run; empty when all can.

    kvmem's own components are checked here. Components named by import path are user code
    that may exit, crash or hang at import, so they are imported in a spawned child, all of a
    scenario's at once, and a child that ends without answering is itself the error.
    """
    user = [b for b in bindings if is_import_path(b.name)]
    problems = [p for b in bindings if b not in user if (p := _bind(b))]
    if not user:
        return problems
    answer, timed_out = None, False
    with Child(_bind_in_child, user, grace=5) as child:
        try:
            answer = child.receive(IMPORT_TIMEOUT)
            timed_out = answer is None
        except EOFError:
            pass  # the child ended without answering
    if answer is None:
        ended = f"hung for {IMPORT_TIMEOUT:g} s" if timed_out else how(child.process.exitcode)
        names = ", ".join(sorted({clip(b.name, MAX_ECHO) for b in user}))
        return [*problems, f"{user[0].field}.component: the process importing {names} {ended} "
                           "before it could answer"]
    return problems + [p for p in answer if p]
