"""The shape of the code: data flows one way, scenario → run → samples → findings → report /
gate, so `harness/` has no import cycle and no module imports a layer above its own, type-only
imports included (a type names a concept it depends on)."""

from __future__ import annotations

import ast
from pathlib import Path

HARNESS = Path(__file__).resolve().parent.parent / "harness"

# Top to bottom: a module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("harness", "harness.__main__", "harness.cli", "harness.pytest_plugin",  # entry points,
     "harness.protocols", "harness.geometry", "harness.units"),  # and moved names' old paths
    ("harness.adopt", "harness.gate"),  # `kvmem init`; the gate reads summaries, never runs
    ("harness.run",),                   # engines, probe, one process per variant, the suite
    ("harness.report",),                # report folders, plots, terminal tables
    ("harness.scenario",),              # scenario files: schema, loading, checks
    ("harness.judge",),                 # samples → metrics, findings, expectations, summary
    ("harness.components",),            # cache components: protocols, registry, adapters
    ("harness.models",),                # geometries, presets, real models, model folders
    ("harness.agent", "harness.common"),  # standalone: the agent; small shared pieces
)


def _module(path: Path) -> str:
    parts = list(path.relative_to(HARNESS.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The harness modules `path` imports anywhere: in functions and for type checking too."""
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules}
    return found - {name}


def graph() -> dict[str, set[str]]:
    files = sorted(HARNESS.rglob("*.py"))
    modules = {_module(f) for f in files}
    return {_module(f): _imports(f, modules) for f in files}


def layer(module: str) -> int:
    """The index in LAYERS of the longest package that holds `module`."""
    matches = [(len(prefix), index) for index, members in enumerate(LAYERS) for prefix in members
               if module == prefix or (prefix != "harness" and module.startswith(prefix + "."))]
    assert matches, f"{module} belongs to no layer: add its folder to LAYERS"
    return max(matches)[1]


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among modules (a package's __init__ importing its own modules aside)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(edges.get(node, ())):
            if target.startswith(node + "."):
                continue  # a package re-exporting its own modules
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_harness_has_no_import_cycle():
    assert _cycle(graph()) is None


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(f"{source} → {target}" for source, targets in graph().items()
                    for target in targets if layer(target) < layer(source))
    assert upward == []


def test_every_harness_module_belongs_to_a_layer():
    assert all(layer(module) >= 0 for module in graph())


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_a_layer_is_found_by_its_longest_package():
    assert layer("harness") == 0 and layer("harness.cli") == 0
    assert layer("harness.run.suite") == LAYERS.index(("harness.run",))
    assert layer("harness.common.units") == len(LAYERS) - 1


PRODUCT = (HARNESS, HARNESS.parent / "reference_impl")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 50


def test_no_module_or_function_outgrows_a_reading():
    """A module over 500 lines or a function over 50 holds more than one concept: split it."""
    too_long = []
    for path in (p for root in PRODUCT for p in sorted(root.rglob("*.py"))):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{path.name}: {len(text.splitlines())} lines")
        too_long += [f"{path.name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}"
                     for node in ast.walk(ast.parse(text))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert too_long == []
