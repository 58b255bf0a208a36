"""No import cycle between controlplane's modules.

Every import counts, wherever it stands: at module level, under `if TYPE_CHECKING:`, or inside
a function. A lazy import hides a cycle from the interpreter but not from the reader, who
still has to hold both modules in mind at once; so the graph is read from the source with
`ast`, never from what Python happened to import.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Set
from pathlib import Path

import pytest

PACKAGE = "controlplane"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def module_name(path: Path, root: Path = ROOT) -> str:
    """controlplane/cli/main.py -> controlplane.cli.main; a package's __init__ is the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) `from ... import` source."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def imports_of(tree: ast.AST, module: str, is_package: bool, known: Set[str]) -> set[str]:
    """The controlplane modules `module` imports anywhere in its source. `from a import b`
    names the module a.b when that is a module (a submodule import), else a."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in known else source)
    # A package's __init__ that runs on the way to a module is not counted: `controlplane`
    # would otherwise sit in a cycle with every module its __init__ names.
    return (found & known) - {module}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the controlplane modules it imports, for every .py file under `root`
    (generated protobuf code included: it imports its neighbours too)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    return {
        name: imports_of(ast.parse(p.read_text(), str(p)), name, p.name == "__init__.py", known)
        for name, p in files.items()
    }


def cycles(graph: Mapping[str, Set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan), as one cycle
    through it, starting from its first module by name: a -> b -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted((_a_cycle(graph, c) for c in components), key=lambda c: c[0])


def _a_cycle(graph: Mapping[str, Set[str]], component: Set[str]) -> list[str]:
    """The shortest path from the component's first module back to itself, inside it."""
    start = min(component)
    paths: dict[str, list[str]] = {start: [start]}
    frontier = [start]
    while frontier:
        nxt: list[str] = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"not a cycle: {sorted(component)}")  # pragma: no cover


def test_no_module_imports_itself_through_others() -> None:
    graph = import_graph()
    # The real tree is read, lazy imports too: main names explain only inside a function.
    assert "controlplane.cli.explain" in graph.get("controlplane.cli.main", set()), "imports not read"
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


# ---- the check itself catches what it is for ----------------------------------------------------


def _graph_of(tmp_path: Path, files: Mapping[str, str]) -> dict[str, set[str]]:
    root = tmp_path / PACKAGE
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(root)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # module level against a lazy import in a function (the cli/explain <-> cli/main shape)
        ("from controlplane.b import run\n", "def f():\n    from controlplane.a import g\n"),
        # TYPE_CHECKING against a lazy import (the discovery/kubernetes <-> manager shape)
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from controlplane.b import K\n",
            "def f():\n    from controlplane.a import watch\n",
        ),
        # a submodule named in `from package import module`, and a plain `import`
        ("from controlplane import b\n", "import controlplane.a\n"),
        # relative imports
        ("from .b import x\n", "from . import a\n"),
    ],
)
def test_a_cycle_is_found_however_it_is_written(tmp_path: Path, a: str, b: str) -> None:
    graph = _graph_of(tmp_path, {"__init__.py": "", "a.py": a, "b.py": b})
    assert cycles(graph) == [["controlplane.a", "controlplane.b", "controlplane.a"]]


def test_a_cycle_through_packages_is_named_module_by_module(tmp_path: Path) -> None:
    graph = _graph_of(
        tmp_path,
        {
            "__init__.py": "",
            "x/__init__.py": "",
            "x/one.py": "from controlplane.y.two import f\n",
            "y/__init__.py": "",
            "y/two.py": "def f():\n    from controlplane.y import three\n",
            "y/three.py": "import controlplane.x.one as one\n",
            "z.py": "from controlplane.x import one\n",  # into the cycle, not part of it
        },
    )
    assert cycles(graph) == [
        ["controlplane.x.one", "controlplane.y.two", "controlplane.y.three", "controlplane.x.one"]
    ]


def test_a_package_importing_its_own_name_and_outside_modules_is_no_cycle(tmp_path: Path) -> None:
    graph = _graph_of(
        tmp_path,
        {
            "__init__.py": "from controlplane import a\n",  # the package and its module: one way
            "a.py": "import json\nimport grpc\nfrom controlplane.missing import x\n",
        },
    )
    assert cycles(graph) == []
