"""No import cycle between controlplane's modules.

Every import counts, wherever it stands: at module level, under `if TYPE_CHECKING:`, or inside
a function. A lazy import hides a cycle from the interpreter but not from the reader, who
still has to hold both modules in mind at once; so the graph is read from the source with
`ast`, never from what Python happened to import.
"""

from __future__ import annotations

import ast
import itertools
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
    # The real tree is read, lazy imports too: the explain command names explain only in a function.
    explain_command = graph.get("controlplane.cli.commands.explain", set())
    assert "controlplane.cli.explain" in explain_command, "imports not read"
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


# ---- rooms: the folders under controlplane/ import one way ---------------------------------------


def room_of(module: str) -> str:
    """The room a module lives in: the folder under controlplane/ (controlplane.xds.server ->
    xds); a module directly under controlplane/ is a room of its own (controlplane.app -> app)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def room_graph(graph: Mapping[str, Set[str]]) -> dict[str, set[str]]:
    """room -> the other rooms its modules import. The package itself (`controlplane`, its
    __init__ and __version__) is below every room and not counted."""
    rooms: dict[str, set[str]] = {}
    for module, deps in graph.items():
        room = room_of(module)
        targets = rooms.setdefault(room, set())
        targets.update(room_of(d) for d in deps if d != PACKAGE and room_of(d) != room)
    return rooms


def room_imports(graph: Mapping[str, Set[str]], a: str, b: str) -> list[str]:
    """The module imports that make room `a` import room `b`, for the failure message."""
    return sorted(
        f"{m} -> {d}" for m, deps in graph.items() if room_of(m) == a for d in deps if room_of(d) == b
    )


def test_no_room_imports_itself_through_others() -> None:
    graph = import_graph()
    rooms = room_graph(graph)
    assert {"fleet", "routing", "xds", "signals", "obs"} <= set(rooms), "rooms not read"
    found = cycles(rooms)
    lines = []
    for c in found:
        lines.append("  " + " -> ".join(c))
        lines += [f"      {edge}" for a, b in itertools.pairwise(c) for edge in room_imports(graph, a, b)]
    assert not found, "rooms that import each other, directly or round a loop:\n" + "\n".join(lines)


def test_a_room_loop_is_found_even_when_modules_do_not_loop(tmp_path: Path) -> None:
    # fleet.schema -> routing.names and routing.translate -> fleet.model: no module cycle, but
    # the two rooms import each other.
    graph = _graph_of(
        tmp_path,
        {
            "__init__.py": "",
            "fleet/__init__.py": "",
            "fleet/model.py": "",
            "fleet/schema.py": "from controlplane.routing.names import stat_name\n",
            "routing/__init__.py": "",
            "routing/names.py": "",
            "routing/translate.py": "from controlplane.fleet.model import Fleet\n",
            "app.py": "import controlplane.routing.translate\nfrom controlplane import fleet\n",
        },
    )
    assert cycles(graph) == []
    assert cycles(room_graph(graph)) == [["fleet", "routing", "fleet"]]
    edges = room_imports(graph, "fleet", "routing")
    assert edges == ["controlplane.fleet.schema -> controlplane.routing.names"]


def test_a_module_under_the_package_is_a_room_of_its_own(tmp_path: Path) -> None:
    graph = _graph_of(
        tmp_path,
        {
            "__init__.py": "__version__ = '1'\n",
            "limits.py": "from controlplane import __version__\n",
            "x/__init__.py": "",
            "x/a.py": "from controlplane import limits\n",
        },
    )
    assert room_graph(graph) == {"controlplane": set(), "limits": set(), "x": {"limits"}}
