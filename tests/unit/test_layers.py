"""The package's import graph: no cycle at import time, no arrow from a lower layer up.

Every module of ``dedupcore`` is parsed with :mod:`ast` (nothing is imported)
and placed in one layer of :data:`LAYERS` (docs/architecture.md, "The
layers"). A module may import modules of its own layer or of lower ones,
also inside functions; an import that runs when the module is imported must
not close a cycle. ``from dedupcore import x`` reads the package facade
(``dedupcore/__init__.py``, which re-exports from every layer), so inside
the package modules import each other by their own path.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dedupcore"
EXT = PACKAGE.parent / "ext"

#: The layers, bottom up. A module name ending in ``.*`` stands for every module
#: of that sub-package (its ``__init__`` included).
LAYERS: dict[int, tuple[str, ...]] = {
    # foundations: the native core and engine, errors, settings, keys, records, the decision
    0: (
        "dedupcore._core",
        "dedupcore._engine",
        "dedupcore.errors",
        "dedupcore.config",
        "dedupcore.keys",
        "dedupcore.record",
        "dedupcore.decision",
        "dedupcore.api.*",
        "dedupcore.ids",
        "dedupcore.retry",
        "dedupcore._platform",
        "dedupcore._checks",
        "dedupcore._spin",
    ),
    # files of their own: the shared file helpers, Bloom filters and rings, the write-ahead log
    1: (
        "dedupcore._files",
        "dedupcore.fuse",
        "dedupcore.fuse_stacks",
        "dedupcore.ring_manifest",
        "dedupcore.bloom",
        "dedupcore.ring",
        "dedupcore.wal.*",
    ),
    # stores and tiers: the embedded store, LMDB, archive, Redis, SQL, cache
    2: (
        "dedupcore.tiers.*",
        "dedupcore.store.*",
        "dedupcore.redis.*",
        "dedupcore.sql.*",
        "dedupcore.migrate",
        "dedupcore.check",
        "dedupcore.memory",
    ),
    # built from stores: stacks and shards, write-behind, opening by URL, patterns, metrics,
    # tracing
    3: (
        "dedupcore.stack",
        "dedupcore.writebehind",
        "dedupcore.factory",
        "dedupcore.patterns.*",
        "dedupcore.metrics",
        "dedupcore.tracing",
        "dedupcore.wrapper",
    ),
    # serving and using stores: the daemon, its clients, HTTP and broker integrations
    4: (
        "dedupcore.daemon.*",
        "dedupcore.client",
        "dedupcore.aio",
        "dedupcore.http.*",
        "dedupcore.integrations.*",
    ),
    # the face: the command line and the package's re-exports
    5: ("dedupcore.cli.*", "dedupcore", "dedupcore.__main__"),
}


#: Modules that need a framework of an extra (Django): nothing in the package imports them,
#: so ``import dedupcore`` and the other integrations work without it.
FRAMEWORK_MODULES = ("dedupcore.integrations.django",)


@dataclass(frozen=True)
class Arrow:
    """``source`` imports ``target`` at ``source_file:line``; ``eager`` if at import time."""

    source: str
    target: str
    line: int
    eager: bool


def modules_of(package: Path, native: Path | None = None) -> dict[str, Path | None]:
    """Module name -> source file (None for a native module built from ``native/*.pyx``)."""
    found: dict[str, Path | None] = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    if native is not None:
        for pyx in sorted(native.glob("*.pyx")):
            found[f"{package.name}.{pyx.stem}"] = None
    return found


def _imports(body: list[ast.stmt], eager: bool) -> Iterator[tuple[ast.stmt, bool]]:
    """Import statements, and whether each runs when the module is imported.

    Function bodies run later; ``if TYPE_CHECKING:`` blocks never run."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, eager
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports(node.body, False)
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            checking = test in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            yield from _imports(node.body, eager and not checking)
            yield from _imports(node.orelse, eager)
        else:  # class bodies, with, try, loops: run where the statement runs
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list):
                    yield from _imports(block, eager)
            for handler in getattr(node, "handlers", ()):
                yield from _imports(handler.body, eager)


def arrows(modules: Mapping[str, Path | None], root: str) -> list[Arrow]:
    """Every import of one module of the package by another."""
    out: list[Arrow] = []
    for name, path in modules.items():
        if path is None:
            continue
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, eager in _imports(tree.body, True):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    if not is_package:
                        anchor.pop()
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # The module named after "from" runs and is read; a name that is a
                # module of its own is imported too. Names read from the package
                # root go through its facade.
                targets = [base]
                if base != root:
                    targets += [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    out.append(Arrow(name, target, node.lineno, eager))
    return out


def layer_of(module: str, layers: Mapping[int, tuple[str, ...]]) -> int | None:
    for level, members in layers.items():
        for member in members:
            if member == module:
                return level
            if member.endswith(".*") and (module == member[:-2] or module.startswith(member[:-1])):
                return level
    return None


def upward(arrows: list[Arrow], layers: Mapping[int, tuple[str, ...]]) -> list[str]:
    """Arrows from a lower layer to a higher one, described."""
    bad = []
    for a in arrows:
        src, dst = layer_of(a.source, layers), layer_of(a.target, layers)
        if src is not None and dst is not None and dst > src:
            bad.append(f"{a.source} (layer {src}) imports {a.target} (layer {dst}), line {a.line}")
    return bad


def cycles(arrows: list[Arrow]) -> list[list[str]]:
    """The import-time cycles: strongly connected components of the eager arrows."""
    graph: dict[str, set[str]] = {}
    for a in arrows:
        if a.eager:
            graph.setdefault(a.source, set()).add(a.target)
            graph.setdefault(a.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def package() -> tuple[dict[str, Path | None], list[Arrow]]:
    modules = modules_of(PACKAGE, EXT)
    return modules, arrows(modules, "dedupcore")


def test_every_module_has_a_layer(package: tuple[dict[str, Path | None], list[Arrow]]) -> None:
    modules, _ = package
    assert {
        "dedupcore.cli",
        "dedupcore.factory",
        "dedupcore._core",
        "dedupcore.integrations.celery",
    } <= set(modules)
    unplaced = sorted(m for m in modules if layer_of(m, LAYERS) is None)
    assert not unplaced, f"add these modules to LAYERS in {__file__}: {unplaced}"


def test_no_import_from_a_lower_layer_to_a_higher_one(
    package: tuple[dict[str, Path | None], list[Arrow]],
) -> None:
    _, found = package
    assert len(found) > 50  # the parser sees the package's imports
    bad = upward(found, LAYERS)
    assert not bad, "upward imports (docs/architecture.md, 'The layers'):\n" + "\n".join(bad)


def test_no_import_cycle_at_import_time(
    package: tuple[dict[str, Path | None], list[Arrow]],
) -> None:
    _, found = package
    assert not cycles(found), cycles(found)


def test_the_daemon_does_not_import_the_clients_or_the_face(
    package: tuple[dict[str, Path | None], list[Arrow]],
) -> None:
    _, found = package
    bad = [
        a
        for a in found
        if a.source.startswith("dedupcore.daemon")
        and (a.target in ("dedupcore.client", "dedupcore.aio") or layer_of(a.target, LAYERS) == 5)
    ]
    assert not bad


def test_the_clients_load_neither_the_store_nor_its_log(
    package: tuple[dict[str, Path | None], list[Arrow]],
) -> None:
    """What ``dedupcore.client`` and ``dedupcore.aio`` import when they are imported, at
    any depth (the daemon's protocol among it), holds no store and no log
    (docs/daemon.md, "Errors"); tests/unit/test_errors.py checks it in a process."""
    _, found = package
    eager: dict[str, set[str]] = {}
    for a in found:
        if a.eager:
            eager.setdefault(a.source, set()).add(a.target)
    reached: set[str] = set()
    todo = ["dedupcore.client", "dedupcore.aio"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(eager.get(module, ()))
    assert "dedupcore.daemon.protocol" in reached
    loaded = sorted(
        m for m in reached if m.split(".")[:2] in (["dedupcore", "store"], ["dedupcore", "wal"])
    )
    assert not loaded, loaded


def test_no_module_imports_a_framework_integration(
    package: tuple[dict[str, Path | None], list[Arrow]],
) -> None:
    modules, found = package
    assert set(FRAMEWORK_MODULES) <= set(modules)
    bad = [
        f"{a.source} imports {a.target}, line {a.line}"
        for a in found
        if a.target in FRAMEWORK_MODULES
    ]
    assert not bad, bad


def test_the_check_finds_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.top import f\n")
    (pkg / "low.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import pkg.top\n"
        "def g():\n    from pkg import sub\n"
    )
    (pkg / "top.py").write_text(
        "import pkg.low\ntry:\n    import pkg.sub.a\nexcept ImportError:\n    pass\n"
    )
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from ..top import f\n")
    modules = modules_of(pkg)
    found = arrows(modules, "pkg")
    layers = {0: ("pkg.low",), 1: ("pkg.sub.*", "pkg.top"), 2: ("pkg",)}
    assert sorted(upward(found, layers)) == [
        "pkg.low (layer 0) imports pkg (layer 2), line 5",
        "pkg.low (layer 0) imports pkg.top (layer 1), line 3",
    ]
    assert cycles(found) == [["pkg.sub.a", "pkg.top"]]
    assert layer_of("pkg.sub", layers) == 1 and layer_of("pkg.other", layers) is None
