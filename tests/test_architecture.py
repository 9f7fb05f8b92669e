"""The shape of the code: data flows one way, so harness/ has no import cycle and the runner
never imports the gate."""

from __future__ import annotations

import ast
from pathlib import Path

HARNESS = Path(__file__).resolve().parent.parent / "harness"


def _module(path: Path) -> str:
    parts = list(path.relative_to(HARNESS.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The harness modules `path` imports anywhere (in functions too; not for type checking)."""
    name = _module(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if _type_checking(node) for n in ast.walk(node)}
    for node in ast.walk(tree):
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
        if id(node) in skipped:
            continue
        found |= {t for t in targets if t in modules}
    return found - {name}


def graph() -> dict[str, set[str]]:
    files = sorted(HARNESS.rglob("*.py"))
    modules = {_module(f) for f in files}
    return {_module(f): _imports(f, modules) for f in files}


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


def _reached(edges: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in edges.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_runner_never_imports_the_gate():
    """Not even through another module: the gate reads summaries, the runner writes them."""
    edges = graph()
    offending = {module: sorted(t for t in _reached(edges, module) if t.startswith("harness.gate"))
                 for module in edges if module.startswith("harness.run")}
    assert {m: t for m, t in offending.items() if t} == {}


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
