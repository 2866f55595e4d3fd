"""The house plan's rules that import-linter's contracts do not express (docs/architecture.md).

- No two modules import each other, directly or through a string import
  (``importlib.import_module("pkg.mod")``, ``"pkg.mod:attr"``), even inside a function.
- No module of the controller or of the checkpoint engine is over 600 lines.
- No ``isinstance`` on a concrete actuator: steps and the engine talk to the interface.

Pure file reading and one grimp graph: no sockets, no subprocesses.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("trainguard", "controller", "agents", "collectives", "checkpoint", "power", "web")
MAX_LINES = 600
#: ``"pkg.mod"`` or ``"pkg.mod:attr"`` as a whole string literal naming one of our modules (a
#: bare ``"web"`` is a word or a resource package more often than an import, so not counted).
_PKG = "(?:" + "|".join(PACKAGES) + ")"
STRING_IMPORT = re.compile(rf"^(?:(?P<dotted>{_PKG}(?:\.\w+)+)(?::\w+)?|(?P<bare>{_PKG}):\w+)$")
#: Known pairs outside the controller, left to their owners (a TYPE_CHECKING-only import of
#: the other module still ties the two together): remove an entry when its cycle is gone.
KNOWN_CYCLES = {
    ("collectives.finite", "collectives.recorder"),
    ("collectives.functional", "collectives.wrap"),
}


def _sources(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def string_imports(path: Path, known: set[str]) -> set[str]:
    """Modules a file names in string literals that are import targets of ours."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = STRING_IMPORT.match(node.value)
            module = match and (match["dotted"] or match["bare"])
            if module and module in known:
                found.add(module)
    return found


@cache
def import_edges() -> frozenset[tuple[str, str]]:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    edges = set()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            edges.add((importer, imported))
    known = set(graph.modules)
    for path in _sources(*PACKAGES):
        importer = _module_name(path)
        edges |= {(importer, m) for m in string_imports(path, known) if m != importer}
    return frozenset(edges)


def mutual_imports(edges: frozenset[tuple[str, str]]) -> list[tuple[str, str]]:
    """Pairs of distinct modules that import each other (a package and its own module
    count: ``pkg/__init__`` re-exporting ``pkg.mod`` that imports ``pkg`` is a cycle too)."""
    return sorted((a, b) for a, b in edges if a < b and (b, a) in edges)


def test_no_two_modules_import_each_other() -> None:
    pairs = [p for p in mutual_imports(import_edges()) if p not in KNOWN_CYCLES]
    assert pairs == [], "modules that import each other:\n" + "\n".join(
        f"  {a} <-> {b}" for a, b in pairs
    )


def test_the_cycle_check_sees_function_level_and_string_imports(tmp_path: Path) -> None:
    """The check must catch what import-linter's layers cannot: a string import."""
    source = tmp_path / "mod.py"
    source.write_text(
        'import importlib\nOPTIONAL = ("controller.runtime", "controller.api.app:create_app")\n'
        'def load():\n    return importlib.import_module("controller.services.events")\n'
    )
    known = {"controller.runtime", "controller.api.app", "controller.services.events"}
    assert string_imports(source, known) == known
    edges = frozenset({("a.x", "a.y"), ("a.y", "a.x"), ("a.x", "a.z")})
    assert mutual_imports(edges) == [("a.x", "a.y")]


@pytest.mark.parametrize("package", ["controller", "checkpoint"])
def test_no_module_is_over_600_lines(package: str) -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _sources(package)
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"modules over {MAX_LINES} lines (split them): {long}"


def concrete_actuators() -> set[str]:
    """Classes in controller/actuators/ that implement the Actuator interface."""
    names = set()
    for path in _sources("controller/actuators"):
        for node in ast.parse(path.read_text()).body:
            name = node.name if isinstance(node, ast.ClassDef) else ""
            if name.endswith("Actuator") and name != "Actuator":
                names.add(name)
    return names


def test_nothing_asks_which_actuator_it_has() -> None:
    concrete = concrete_actuators()
    assert {"LocalProcessActuator", "KubernetesActuator"} <= concrete
    offenders = []
    for path in _sources("controller"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
            ):
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if named & concrete:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], f"isinstance on a concrete actuator: {offenders}"
