"""jaxpar's modules import each other without circles, and its packages import one way.

The graph is read from the source, not from ``sys.modules``: every ``import`` and ``from ...
import`` statement in every module under ``jaxpar/`` counts, wherever it stands -- at the
top, inside a function, under ``if TYPE_CHECKING:``. A circle closed by an import inside a
function still makes two modules that cannot be understood, tested or loaded one without the
other; a circle closed by a type-only import still says that the lower module knows the
upper one. Relative imports are resolved against the importing module's package.

A node is a module: ``jaxpar.engine._steps`` is ``jaxpar/engine/_steps.py`` and
``jaxpar.engine`` is ``jaxpar/engine/__init__.py``. The edges:

- ``import a.b.c`` and ``from a.b.c import name`` depend on module ``a.b.c``;
- ``from a.b import c`` depends on module ``a.b.c`` when ``c`` is a submodule (a file or
  package of its own), and on ``a.b`` (its ``__init__``) when ``c`` is a name defined or
  re-exported there;
- a package's ``__init__`` depends on the submodules it imports, like any other module.

Enclosing packages are not edges: ``import jaxpar.engine._steps`` also runs
``jaxpar/engine/__init__.py``, but from inside ``jaxpar/engine/`` that ``__init__`` is
already running, and from outside the front-door rule (tests/test_imports.py) forbids the
import anyway. Re-exports are edges, though: a module under ``jaxpar/engine/`` that imports
``from jaxpar.engine import Steps`` depends on the package's ``__init__``, which imports
every engine module, itself included -- a circle, and reported as one.

``jaxpar/__init__.py`` loads ``models``, ``engine`` and ``inspect`` by name on first
attribute access (``importlib``); that is not an import statement and not an edge, and
``jaxpar`` and ``jaxpar.errors`` stand outside the package order.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("spec", "models", "engine", "inspect", "plan", "server", "cli")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(module: str | None, level: int, here: str, package: bool) -> str:
    """The absolute dotted name of ``from <level dots><module> import ...`` in ``here``."""
    if level == 0:
        return module or ""
    base = here.split(".") if package else here.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def import_graph(root: Path, top: str = "jaxpar") -> dict[str, dict[str, int]]:
    """Every module under ``root/top`` -> {module it imports: line of the first import}.

    Only modules of ``top`` are kept as targets; ``root`` is the directory that holds the
    ``top`` package.
    """
    paths = {_module_name(p, root): p for p in sorted((root / top).rglob("*.py"))}
    return {here: _edges(here, path, paths) for here, path in paths.items()}


def _edges(here: str, path: Path, paths: dict[str, Path]) -> dict[str, int]:
    """The modules of ``paths`` that module ``here`` (at ``path``) imports, each with the
    line of its first import."""
    edges: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node.module, node.level, here, _is_package(path))
            subs = (f"{source}.{alias.name}" for alias in node.names)
            targets = [sub if sub in paths else source for sub in subs]
        else:
            continue
        for target in targets:
            if target in paths and target != here:
                edges[target] = min(edges.get(target, node.lineno), node.lineno)
    return edges


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One circle of ``graph`` as its modules in import order (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [f"  {a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:], strict=False)]
    return "\n".join(steps)


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ORDER else None


def test_modules_import_without_circles():
    graph = import_graph(ROOT)
    cycle = find_cycle(graph)
    assert cycle is None, f"an import circle of {len(cycle) - 1} modules:\n" + _describe(
        cycle, graph
    )


def test_packages_import_one_way():
    """spec -> models -> engine -> inspect -> plan -> server -> cli, never back."""
    graph = import_graph(ROOT)
    bad = [
        f"{a} (line {line}) -> {b}"
        for a, targets in graph.items()
        for b, line in targets.items()
        if _package(a) and _package(b) and ORDER.index(_package(b)) > ORDER.index(_package(a))
    ]
    assert not bad, "imports against " + " -> ".join(ORDER) + ":\n" + "\n".join(bad)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_graph_counts_lazy_relative_and_submodule_imports(tmp_path):
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.sub import Thing\n",
            "pkg/sub/__init__.py": "from ._a import Thing\nfrom . import _b\n",
            "pkg/sub/_a.py": "def f():\n    from .._c import g\n    return g\nThing = 1\n",
            "pkg/sub/_b.py": "import pkg._c\nfrom pkg.sub import _a\n",
            "pkg/_c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from pkg.sub import Thing\n",
        },
    )
    graph = import_graph(root, "pkg")
    assert {k: set(v) for k, v in graph.items()} == {
        "pkg": {"pkg.sub"},
        "pkg.sub": {"pkg.sub._a", "pkg.sub._b"},
        "pkg.sub._a": {"pkg._c"},  # inside a function, two dots up
        "pkg.sub._b": {"pkg._c", "pkg.sub._a"},  # a submodule, not the package
        "pkg._c": {"pkg.sub"},  # a type-only import of a re-export
    }
    cycle = find_cycle(graph)
    assert cycle[0] == cycle[-1] and len(cycle) == 4
    assert set(cycle) == {"pkg._c", "pkg.sub", "pkg.sub._a"}  # _b is off the circle


@pytest.mark.parametrize(
    ("edges", "circle"),
    [
        ({"a": ["b"], "b": ["c"], "c": []}, False),
        ({"a": ["b", "c"], "b": ["c"], "c": []}, False),  # a diamond is no circle
        ({"a": ["b"], "b": ["a"]}, True),
        ({"a": ["b"], "b": ["c"], "c": ["d"], "d": ["b"]}, True),
    ],
)
def test_find_cycle(edges, circle):
    graph = {k: dict.fromkeys(v, 1) for k, v in edges.items()}
    found = find_cycle(graph)
    assert (found is not None) == circle
    if found:
        assert found[0] == found[-1]
        assert all(b in graph[a] for a, b in zip(found, found[1:], strict=False))
