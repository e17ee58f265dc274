"""extender/ has no import cycle, and every module imports on its own.

The graph counts every import of an `extender` module: at the top, inside a function, and under
`if TYPE_CHECKING:` (a cycle there is still two modules that cannot be read, tested or moved one
without the other). Read with `ast`, so a cycle is found even where Python would tolerate it at
run time because one side imports late.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "extender"
#: runs the CLI when imported (`python -m extender`)
NOT_IMPORTABLE = {"extender.__main__"}


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package (packages by their __init__)."""
    out: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The extender modules one import statement names (a `from package import module` names the
    module, a `from module import name` the module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return {_owner(name, known) for name in names if _owner(name, known)}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[: len(here) - node.level + 1]
        base = ".".join(here + ([base] if base else []))
    out = set()
    for alias in node.names:
        full = f"{base}.{alias.name}"
        owner = full if full in known else _owner(base, known)
        if owner:
            out.add(owner)
    return out


def _owner(name: str, known: dict[str, Path]) -> str:
    """The longest known module that `name` is or is inside of; "" outside the package."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the extender modules it imports anywhere in its text."""
    known = module_files(root)
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        deps: set[str] = set()
        for node in ast.walk(tree):
            deps |= _imported(node, module, path.name == "__init__.py", known)
        deps.discard(module)
        graph[module] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path (first module repeated at the end), or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_cycles_and_only_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond is no cycle
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "extender"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("import extender.top\n")
    (pkg / "top.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from extender.sub.leaf import X\n"
        "def f():\n    from extender import late\n"
    )
    (pkg / "late.py").write_text("from .sub import leaf\n")
    graph = import_graph(pkg)
    assert graph["extender.sub"] == {"extender.sub.leaf"}
    assert graph["extender.sub.leaf"] == {"extender.top"}
    assert graph["extender.top"] == {"extender.sub.leaf", "extender.late"}
    assert graph["extender.late"] == {"extender.sub.leaf"}
    assert find_cycle(graph) == [
        "extender.late",
        "extender.sub.leaf",
        "extender.top",
        "extender.late",
    ]


def test_extender_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "extender.demand" in graph["extender.ledger"]  # the graph is read, not empty
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("module", sorted(set(module_files()) - NOT_IMPORTABLE))
def test_every_module_imports(module: str) -> None:
    importlib.import_module(module)
