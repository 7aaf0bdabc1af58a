"""diffdraft's import graph keeps its layering: no module cycles, and no import climbs a layer.

The graph is read from the source with :mod:`ast`, so nothing is imported to check it. Every import
statement counts wherever it stands: one inside a function still ties the two modules together (and
cycles at the first call), and one under ``if TYPE_CHECKING:`` still makes the lower module's design
depend on the higher one's types. ``from package import name`` is an edge to the submodule ``name``
when there is one, else to the package; the implicit import of a module's parent packages is not.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = "diffdraft"
ROOT = "__init__"
"""How :data:`LAYERS` names the package's own ``__init__`` (the public API)."""

LAYERS: tuple[tuple[str, ...], ...] = (
    # utilities that import nothing of diffdraft
    ("errors", "util"),
    # values and sources that everything above reads
    ("runtime", "data"),
    # the target, its fast forward, and how it is loaded
    ("kernels",),
    ("target",),
    # what drafts, and the n-gram trie DART prunes its trees with
    ("drafters", "ngram"),
    ("trees",),
    # the decoding package spans layers, so its modules are units of their own: verification and the
    # sequence spec (with the package itself, which holds nothing) below the budget, the loop and the
    # methods beside it
    ("decoding",),
    ("decoding.engine", "budget", "decoding.method_table"),
    ("decoding.batching",),
    ("generator",),
    # what the commands share over the generator
    ("commands",),
    # what is built on the generator: the applications, then the command line and the public API
    ("train", "bench", "export", "serve"),
    ("cli", ROOT),
)
"""Units (a top-level module or a subpackage, named below ``diffdraft``; a module of a package that
names it apart is its own unit), lowest layer first. A module may import its own unit and the units
of lower layers, never a unit of its own layer or a higher one."""

ALLOWED: Mapping[tuple[str, str], str] = {}
"""Edges (importer, imported) left out of both checks, each with the reason it stays (none now)."""


def package_dir() -> Path:
    """The source of the installed diffdraft, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def import_graph(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` (named below it; the package's own ``__init__`` is :data:`ROOT`)
    mapped to the modules of the package it imports."""
    files = {_module_name(path.relative_to(package)): path for path in sorted(package.rglob("*.py"))}
    return {name: _imports(name, path, package.name, set(files)) for name, path in files.items()}


def _module_name(relative: Path) -> str:
    parts = relative.with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or ROOT


def _imports(name: str, path: Path, package: str, modules: set[str]) -> set[str]:
    is_package = path.name == "__init__.py"
    here = [package, *([] if name == ROOT else name.split("."))]
    if not is_package:
        here = here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
            source = ".".join(part for part in (base, node.module) if part)
            targets = [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            module = _known_module(target, package, modules)
            if module is not None and module != name:
                found.add(module)
    return found


def _known_module(dotted: str, package: str, modules: set[str]) -> str | None:
    """The longest prefix of ``dotted`` that is a module of ``package`` (``from a import name`` ends in
    a submodule or in ``a`` itself), or None for imports from elsewhere."""
    parts = dotted.split(".")
    if parts[0] != package:
        return None
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[1:end]) or ROOT
        if name in modules:
            return name
    return None


def cyclic_edges(graph: Mapping[str, Iterable[str]]) -> list[tuple[str, str]]:
    """Every edge ``a -> b`` from which ``a`` can be reached again."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if a in _reachable(graph, b))


def _reachable(graph: Mapping[str, Iterable[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def unit_of(module: str, layers: tuple[tuple[str, ...], ...]) -> str | None:
    """The unit in ``layers`` that ``module`` belongs to (the longest that names it or a package
    above it), or None when no layer lists it."""
    units = [unit for layer in layers for unit in layer]
    matches = [unit for unit in units if module == unit or module.startswith(f"{unit}.")]
    return max(matches, key=len, default=None)


def layering_violations(graph: Mapping[str, Iterable[str]], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """Why each module or edge breaks ``layers``: a module no layer lists, or an import of a unit
    that is not in a lower layer."""
    level = {unit: index for index, layer in enumerate(layers) for unit in layer}
    problems = [
        f"{m} is in no layer: add it (or its package) to LAYERS" for m in graph if not unit_of(m, layers)
    ]
    for importer, targets in sorted(graph.items()):
        source = unit_of(importer, layers)
        for imported in sorted(targets):
            unit = unit_of(imported, layers)
            if None in (source, unit) or source == unit or level[unit] < level[source]:
                continue
            where = "the same layer as" if level[unit] == level[source] else "a higher layer than"
            problems.append(f"{importer} imports {imported}: {unit} is in {where} {source}")
    return problems


def _checked_graph() -> dict[str, set[str]]:
    graph = import_graph(package_dir())
    return {a: {b for b in targets if (a, b) not in ALLOWED} for a, targets in graph.items()}


def test_no_module_imports_another_that_imports_it_back():
    assert cyclic_edges(_checked_graph()) == []


def test_imports_go_down_the_layers():
    assert layering_violations(_checked_graph(), LAYERS) == []


def test_every_allowed_exception_still_exists():
    graph = import_graph(package_dir())
    assert [edge for edge in ALLOWED if edge[1] not in graph.get(edge[0], ())] == []


def test_layers_name_each_unit_once():
    units = [unit for layer in LAYERS for unit in layer]
    assert len(units) == len(set(units))


def test_the_checks_catch_a_cycle_and_an_upward_import(tmp_path: Path):
    """A tiny package whose low module imports the high one inside a function, and the high one the
    low one under TYPE_CHECKING: both edges are seen, so both checks fail on it."""
    package = tmp_path / "tinypkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "low.py").write_text("def climb():\n    from tinypkg.sub import high\n")
    (package / "sub" / "high.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import helper\nimport tinypkg.low\n"
    )
    (package / "sub" / "helper.py").write_text("from ..low import climb\n")
    graph = import_graph(package)
    assert graph == {
        ROOT: set(),
        "low": {"sub.high"},
        "sub": set(),
        "sub.helper": {"low"},
        "sub.high": {"sub.helper", "low"},
    }
    assert cyclic_edges(graph) == [
        ("low", "sub.high"),
        ("sub.helper", "low"),
        ("sub.high", "low"),
        ("sub.high", "sub.helper"),
    ]
    layers = (("low",), ("sub",))
    assert layering_violations(graph, layers) == [
        "__init__ is in no layer: add it (or its package) to LAYERS",
        "low imports sub.high: sub is in a higher layer than low",
    ]
    assert layering_violations(graph, (("low", "sub"), (ROOT,))) == [
        "low imports sub.high: sub is in the same layer as low",
        "sub.helper imports low: low is in the same layer as sub",
        "sub.high imports low: low is in the same layer as sub",
    ]
