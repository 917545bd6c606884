"""Packages meet only at their front doors, and import one way.

jaxpar's packages (``spec``, ``models``, ``engine``, ``inspect``, ``plan``, ``server``,
``cli``) import each other only through their ``__init__``: ``from jaxpar.engine._steps
import ...`` outside ``jaxpar/engine/`` fails this test, as does ``from jaxpar.engine import
_steps``. The rule covers the package code and the scripts; tests may import private
modules to check one piece on its own. That the packages import one way (spec -> models
-> engine -> inspect -> plan -> server -> cli) and no modules import each other in a
circle is tests/test_import_graph.py's.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every imported module of ``path`` as a dotted name (``from a import b`` -> ``a.b``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def _package_of(path: Path) -> str | None:
    parts = path.relative_to(ROOT).parts
    return parts[1] if parts[0] == "jaxpar" and len(parts) > 2 else None


def _sources() -> list[Path]:
    return sorted([*(ROOT / "jaxpar").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")])


def _private_imports(path: Path, home: str | None) -> list[str]:
    """Imports of ``jaxpar.<pkg>._private`` with ``<pkg>`` not ``home``."""
    bad = []
    for line, name in _imports(path):
        parts = name.split(".")
        if parts[0] != "jaxpar" or len(parts) < 3 or parts[1] == home:
            continue
        if parts[2].startswith("_"):
            bad.append(f"{path}:{line}: {name}")
    return bad


def test_packages_import_each_other_only_through_their_front_doors():
    bad = [b for path in _sources() for b in _private_imports(path, _package_of(path))]
    assert not bad, "private imports across packages:\n" + "\n".join(bad)


def test_the_scan_finds_private_imports(tmp_path):
    source = tmp_path / "x.py"
    source.write_text(
        "from jaxpar.engine._steps import Steps\n"
        "from jaxpar.models import _cache\n"
        "import jaxpar.spec._rules\n"
        "from jaxpar.engine import Steps\n"
        "def f():\n    from jaxpar.inspect._hlo import parse_collectives\n"
    )
    found = [b.split(": ")[1] for b in _private_imports(source, "cli")]
    assert found == [
        "jaxpar.engine._steps.Steps",
        "jaxpar.models._cache",
        "jaxpar.spec._rules",
        "jaxpar.inspect._hlo.parse_collectives",
    ]
    assert len(_private_imports(source, "engine")) == 3  # its own package's are fine
