"""Cache components by registry name or import path.

A scenario names each component either by a registry name (`mlx_lm.KVCache`,
`reference.prefix_cache`) or by an import path `package.module:attr`, so a user can profile
their own cache code without touching the harness. mlx-lm's own classes are driven as they are,
through the small factories in `harness.components.adapters`. Nothing here imports MLX or mlx-lm: a
scenario is checked against the registry without loading them.

An import path resolves from the working directory, then from the stores kvmem ships as
examples (`examples/` in a checkout; `harness/shipped/examples`, a link to it, is copied into a
wheel), so the bundled scenarios that name them run in any folder of an installed kvmem. The
shipped folder comes last on `sys.path` and `examples` has no `__init__.py`: a package of the
user's named `examples` is found first, and a folder of theirs merges with it.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.child import Child, how, import_first
from ..common.echo import MAX_ECHO, clip, echo
from ..common.errors import KvmemError

if TYPE_CHECKING:
    from ..models.geometry import Geometry
    from .adapters import RemainingStore

REGISTRY: dict[str, str] = {
    "mlx_lm.KVCache": "harness.components.adapters:kv_cache",
    "mlx_lm.RotatingKVCache": "harness.components.adapters:rotating_kv_cache",
    "mlx_lm.BatchRotatingKVCache": "harness.components.adapters:batch_rotating_kv_cache",
    "mlx_lm.QuantizedKVCache": "harness.components.adapters:quantized_kv_cache",
    "reference.rotating": "reference_impl.rotating:rotating",
    "reference.batch_rotating": "reference_impl.rotating_batch:batch_rotating",
    "reference.prefix_cache": "reference_impl.prefix_cache:prefix_cache",
    "reference.paged_ssd": "reference_impl.paged_ssd:PagedSSDStore",
    "reference.turboquant": "reference_impl.turboquant:turboquant",
    "reference.chat": "reference_impl.chat:ChatSession",
    "reference.arrays_state": "reference_impl.arrays_state:arrays_state",
    "mlx_lm.LRUPromptCache": "harness.components.adapters:lru_prompt_cache",
    "adapt.remaining": "harness.components.registry:remaining",
}
# The folder whose `examples` holds the example stores and plugins kvmem ships.
SHIPPED = str(Path(__file__).resolve().parents[1] / "shipped")


class ComponentError(KvmemError, ValueError):
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
    if name in REGISTRY:  # kvmem's own: from its installation, not a `reference_impl/` of the cwd
        import_first()
    elif SHIPPED not in sys.path:
        sys.path.append(SHIPPED)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's path, not ours
        raise ComponentError(f"cannot import module {echo(module_name)} for {echo(name)}: "
                             f"{clip(str(exc))}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ComponentError(f"{echo(module_name)} has no callable {echo(attr)} (from {echo(name)})")
    return factory


def remaining(geometry: Geometry, store: str, **options: Any) -> RemainingStore:
    """`adapt.remaining`: the store `store` (a registry name or `package.module:factory`),
    built as `factory(geometry, **options)`, whose fetch returns `(cache, remaining_tokens)`.
    Here, not among the adapters: it resolves a name, and the registry names the adapters."""
    from .adapters import RemainingStore  # mlx-lm's: imported when a scenario names it

    if not isinstance(store, str):
        raise TypeError(f"option 'store': expected a component name, got {type(store).__name__}")
    return RemainingStore(geometry, resolve(store)(geometry, **options))


def construct(component: Any, first_arg: Any) -> Any:
    """What a scenario component (an object with `component` and `options`) makes of its
    first argument: a layer's cache from its LayerSpec, a store or session from the geometry."""
    return resolve(component.component)(first_arg, **component.options)


def is_import_path(name: str) -> bool:
    """Whether a component name is user code by import path rather than a registry name."""
    return name not in REGISTRY and ":" in name


def _user_names(component: str, options: dict[str, Any]) -> list[str]:
    """The import paths a component runs: its own, and the store `adapt.remaining` wraps."""
    wrapped = options.get("store") if component == "adapt.remaining" else None
    return [name for name in (component, wrapped) if isinstance(name, str) and is_import_path(name)]


def import_paths(components: Iterable[Any]) -> list[str]:
    """The import paths among scenario components (objects with `component` and `options`),
    with the store that `adapt.remaining` wraps, each once, in order."""
    names = (name for spec in components for name in _user_names(spec.component, spec.options))
    return list(dict.fromkeys(names))


# What the engines use of each role's component; a missing member fails the run mid-way.
MEMBERS = {
    "layer": ("update_and_fetch", "nbytes", "state"),
    "sliding": ("update_and_fetch", "nbytes", "state"),
    "recurrent": ("update_and_fetch", "nbytes", "state"),
    "store": ("fetch", "store", "on_prefill", "nbytes", "close"),
    "session": ("start_turn", "evict", "keep_logits", "nbytes"),
}


@dataclass(frozen=True)
class Binding:
    """One component of a scenario to check: where it is named, its role, what, and its first
    argument."""

    field: str  # e.g. "variant 'after': cache.store"
    role: str   # a key of MEMBERS
    name: str
    options: dict[str, Any]
    first_arg: Any

    @property
    def user_code(self) -> bool:
        """Whether building it runs user code: an import path, or an adapter wrapping one."""
        return bool(_user_names(self.name, self.options))


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


def _build(binding: Binding) -> str | None:
    """Why `binding` cannot be built, or lacks what its role uses: user code is built once here,
    so an option that a `**options` glue passes on, or a member it lacks, fails before the run."""
    problem = _bind(binding)
    if problem:
        return problem
    try:
        built = resolve(binding.name)(binding.first_arg, **binding.options)
    except Exception as exc:  # the user's constructor: any failure is theirs to read
        return (f"{binding.field}.options: {type(exc).__name__}: {clip(str(exc))} "
                f"(building {clip(binding.name, MAX_ECHO)})")
    missing = [m for m in MEMBERS[binding.role] if not _has(built, m)]
    close = getattr(built, "close", None)
    if binding.role == "store" and callable(close):
        close()
    if missing:
        wrapped = [n for n in _user_names(binding.name, binding.options) if n != binding.name]
        what = clip(binding.name, MAX_ECHO) + "".join(f" (around {clip(name, MAX_ECHO)})"
                                                      for name in wrapped)
        return (f"{binding.field}.component: {what} builds a {type(built).__name__} without "
                f"{', '.join(missing)} (a {binding.role} needs {', '.join(MEMBERS[binding.role])})")
    return None


def _has(built: Any, member: str) -> bool:
    """Whether `built` has `member`; a property that raises (a wrapper whose inner store lacks
    it) does not count, except one of mlx-lm's own caches: before 0.32 a fresh KVCache's
    `state` cannot be read until its first update."""
    from mlx_lm.models.cache import _BaseCache

    try:
        getattr(built, member)
    except Exception:
        return isinstance(built, _BaseCache) and isinstance(getattr(type(built), member, None),
                                                            property)
    return True


@dataclass(frozen=True)
class Checked:
    """What the pre-run check found: each problem, and the installed packages (distribution ->
    version) that building the user components loaded, kvmem's own aside."""

    problems: list[str]
    packages: dict[str, str] = field(default_factory=dict)


def _build_in_child(bindings: list[Binding], pipe: Any) -> None:
    # kvmem's own runtime, loaded by every run: not the user's. (An import statement of
    # `mlx_lm.models.cache` would bind `mlx_lm` and so run mlx-lm's deferred `__init__`.)
    importlib.import_module("mlx.core")
    importlib.import_module("mlx_lm.models.cache")

    before = set(sys.modules)
    problems = [_build(b) for b in bindings]
    pipe.send((problems, loaded_packages(set(sys.modules) - before)))


def loaded_packages(modules: Iterable[str]) -> dict[str, str]:
    """The installed distributions providing `modules` (kvmem aside), with their versions."""
    owners = metadata.packages_distributions()
    tops = sorted({name.partition(".")[0] for name in modules})
    dists = sorted({dist for top in tops for dist in owners.get(top, []) if dist != "kvmem"})
    return {dist: metadata.version(dist) for dist in dists}


IMPORT_TIMEOUT = 120.0  # seconds for a child to import and bind a scenario's user components


def check(bindings: list[Binding]) -> Checked:
    """Why each component cannot be built, so a typo fails before any run (empty problems when
    all can), and the packages the user components loaded.

    kvmem's own components are checked here, by their signature. Components that run user code
    (an import path, or an adapter wrapping one) may exit, crash or hang at import, so they are
    imported and built in a spawned child, all of a scenario's at once, and a child that ends
    without answering is itself the error.
    """
    user = [b for b in bindings if b.user_code]
    problems = [p for b in bindings if b not in user if (p := _bind(b))]
    if not user:
        return Checked(problems)
    answer, timed_out = None, False
    with Child(_build_in_child, user, grace=5) as child:
        try:
            answer = child.receive(IMPORT_TIMEOUT)
            timed_out = answer is None
        except EOFError:
            pass  # the child ended without answering
    if answer is None:
        ended = f"hung for {IMPORT_TIMEOUT:g} s" if timed_out else how(child.process.exitcode)
        names = ", ".join(sorted({clip(b.name, MAX_ECHO) for b in user}))
        return Checked([*problems, f"{user[0].field}.component: the process importing {names} "
                                   f"{ended} before it could answer"])
    found, packages = answer
    return Checked(problems + [p for p in found if p], packages)
