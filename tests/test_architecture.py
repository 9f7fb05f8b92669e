"""The shape of the code: data flows one way, scenario → run → samples → findings → report /
gate, so `harness/` and `reference_impl/` have no import cycle and no module imports a layer
above its own. Every way one module reaches another counts: type-only imports (a type names a
concept it depends on), `importlib.import_module` with a literal name, and a string that names
a harness module (`"harness.a.b"` or `"harness.a.b:Name"`, imported later by whoever reads it).
The registry's `reference_impl` names are not counted: they are its data, as a user's own
`module:factory` is."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

HARNESS = Path(__file__).resolve().parent.parent / "harness"
ROOTS = (HARNESS, HARNESS.parent / "reference_impl")

# Top to bottom: a module may import its own layer and the layers below it, never one above.
LAYERS = (
    ("harness", "harness.__main__", "harness.cli", "harness.pytest_plugin",  # entry points,
     "harness.protocols", "harness.geometry", "harness.units"),  # and moved names' old paths
    ("harness.adopt", "harness.gate"),  # `kvmem init`; the gate reads summaries, never runs
    ("harness.record",),                # kvmem record: a command kvmem did not start, sampled
    ("harness.pipeline",),              # the orchestrator: variants end to end, one process each
    ("harness.run",),                   # measuring one variant: engines, the probe, the environment
    ("harness.store",),                 # stored results read back: summaries, rows, git, record
    ("harness.report",),                # report folders, plots, terminal tables
    ("harness.scenario",),              # scenario files: schema, loading, checks
    ("harness.judge",),                 # samples → metrics, findings, expectations, summary
    ("reference_impl",),                # the reference strategies: components, built on geometry
    ("harness.components",),            # cache components: protocols, registry, adapters
    ("harness.models",),                # geometries, presets, real models, model folders
    ("harness.agent", "harness.common"),  # standalone: the agent; small shared pieces
)
NAMED = re.compile(r"harness(?:\.\w+)+(?::[\w.]+)?")  # "harness.a.b", "harness.a.b:Name"


def _module(path: Path) -> str:
    parts = list(path.relative_to(HARNESS.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """What an import statement names: modules, and names that may be modules."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, *([base] if base else [])])
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _loaded(node: ast.Call) -> list[str]:
    """`importlib.import_module("x")` or `import_module("x")` with a literal name: x."""
    called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    first = node.args[0] if node.args else None
    if called == "import_module" and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return [first.value]
    return []


def _named(node: ast.Constant, modules: set[str]) -> list[str]:
    """The module a string names, `harness.a.b` or an attribute of it (after a colon or a
    dot): the longest dotted prefix of it that is a module."""
    if not (isinstance(node.value, str) and NAMED.fullmatch(node.value)):
        return []
    parts = node.value.split(":")[0].split(".")
    prefixes = (".".join(parts[:end]) for end in range(len(parts), 1, -1))
    return next(([prefix] for prefix in prefixes if prefix in modules), [])


def imports(source: str, name: str, package: str, modules: set[str]) -> set[str]:
    """The modules among `modules` that the module `name` (in `package`), of text `source`,
    reaches anywhere: in functions, for type checking, by `import_module` or by name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(_imported(node, package))
        elif isinstance(node, ast.Call):
            found.update(_loaded(node))
        elif isinstance(node, ast.Constant):
            found.update(_named(node, modules))
    return (found & modules) - {name}


def graph() -> dict[str, set[str]]:
    files = [path for root in ROOTS for path in sorted(root.rglob("*.py"))]
    modules = {_module(f) for f in files}
    edges = {}
    for path in files:
        name = _module(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges[name] = imports(path.read_text(), name, package, modules)
    return edges


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


def test_there_is_no_import_cycle():
    assert _cycle(graph()) is None


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(f"{source} → {target}" for source, targets in graph().items()
                    for target in targets if layer(target) < layer(source))
    assert upward == []


def test_every_module_belongs_to_a_layer():
    assert all(layer(module) >= 0 for module in graph())


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


PLANTED = {  # a circle of three modules, each reaching the next another way
    "harness.x.a": ("harness.x", 'import importlib\nimportlib.import_module("harness.x.b")\n'),
    "harness.x.b": ("harness.x", 'TABLE = {"c": "harness.x.c:Thing"}\n'),
    "harness.x.c": ("harness.x", 'from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n'
                                 '    from . import a\n'),
}


def test_a_cycle_through_import_module_a_named_string_and_a_type_is_found():
    modules = {*PLANTED, "harness.x"}
    edges = {name: imports(source, name, package, modules)
             for name, (package, source) in PLANTED.items()}
    assert edges == {"harness.x.a": {"harness.x.b"}, "harness.x.b": {"harness.x.c"},
                     "harness.x.c": {"harness.x", "harness.x.a"}}
    assert _cycle(edges) == ["harness.x.a", "harness.x.b", "harness.x.c", "harness.x.a"]


def test_a_string_that_names_no_module_is_no_edge():
    modules = {"harness.x", "harness.x.a"}
    source = 'DOC = "see harness.x.a"\nOTHER = "harness.y.z"\nfrom_module = "x.harness.x.a"\n'
    assert imports(source, "harness.z", "harness", modules) == set()
    assert imports('NAME = "harness.x.a.Thing"\n', "harness.z", "harness", modules) == \
        {"harness.x.a"}


def test_a_layer_is_found_by_its_longest_package():
    assert layer("harness") == 0 and layer("harness.cli") == 0
    assert layer("harness.run.probe") == LAYERS.index(("harness.run",))
    assert layer("harness.common.units") == len(LAYERS) - 1
    assert layer("reference_impl.rotating") == LAYERS.index(("reference_impl",))


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 50


def test_no_module_or_function_outgrows_a_reading():
    """A module over 500 lines or a function over 50 holds more than one concept: split it."""
    too_long = []
    for path in (p for root in ROOTS for p in sorted(root.rglob("*.py"))):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{path.name}: {len(text.splitlines())} lines")
        too_long += [f"{path.name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1}"
                     for node in ast.walk(ast.parse(text))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert too_long == []


def _classes(root: Path) -> dict[str, list[str]]:
    """Each class defined under `root` by name, with the names of its bases."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found[node.name] = [base.id if isinstance(base, ast.Name) else
                                    getattr(base, "attr", "") for base in node.bases]
    return found


def outside_the_root(classes: dict[str, list[str]], root: str = "KvmemError") -> list[str]:
    """The error classes among `classes` (a builtin Exception among their ancestors) that do not
    derive from `root`. An interrupt (KeyboardInterrupt's) is no error: `except Exception`
    must not catch it."""
    def ancestors(name: str) -> set[str]:
        bases = classes.get(name, [])
        return set(bases).union(*(ancestors(base) for base in bases if base != name))

    def builtin_error(name: str) -> bool:
        value = getattr(builtins, name, None)
        return isinstance(value, type) and issubclass(value, Exception)

    return sorted(name for name in classes if name != root
                  and any(map(builtin_error, ancestors(name))) and root not in ancestors(name))


def test_every_exception_kvmem_defines_derives_from_its_root():
    """One root, harness.common.errors.KvmemError, under which bad input (exit 2) and the
    failures of a run sit. The agent is left out: it runs inside servers on the standard
    library alone and imports nothing of kvmem's."""
    classes = {name: bases for folder in sorted(HARNESS.iterdir())
               if folder.is_dir() and folder.name != "agent"
               for name, bases in _classes(folder).items()}
    assert "RunFailure" in classes and outside_the_root(classes) == []
    planted = {"KvmemError": ["Exception"], "Bad": ["KvmemError", "ValueError"],
               "Stray": ["ValueError"], "Under": ["Stray"], "Plain": ["object"],
               "Stop": ["KeyboardInterrupt"]}
    assert outside_the_root(planted) == ["Stray", "Under"]


def test_a_mebibyte_is_written_once():
    """`MiB` (and KiB, GiB) are defined in harness/common/units.py alone; every other figure in
    bytes is written with them."""
    root = HARNESS.parent
    spelled = "2**" + "20"  # not written out here, or this file would be a second place
    files = [path for folder in ("harness", "reference_impl", "tests", "benchmarks", "docs", "scripts")
             for path in sorted((root / folder).rglob("*")) if path.suffix in (".py", ".md")]
    found = [f"{path.relative_to(root)}:{number}" for path in files
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if spelled in line]
    assert [place.split(":")[0] for place in found] == ["harness/common/units.py"], found
