"""How turnkv's modules depend on each other: no import cycle anywhere in src/turnkv (an import inside a
function counts: it is a dependency all the same; one under ``if TYPE_CHECKING`` does not), and the engine
seam holds (what lies below the gateway imports nothing from it)."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
# packages below the gateway: the engines, OpenAI's wire shapes, the store, the decisions
BELOW_THE_GATEWAY = ("turnkv.engine", "turnkv.openai", "turnkv.state", "turnkv.reuse", "turnkv.routing")


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "turnkv").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _target(name: str) -> str:
    """The module an imported name lives in (``turnkv.a.b`` for ``from turnkv.a import b`` when ``b`` is a
    module, else ``turnkv.a``)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(body: list[ast.stmt]) -> Iterator[str]:
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _imports(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("turnkv"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("turnkv"):
            yield from (f"{node.module}.{a.name}" for a in node.names)
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _imports(inner)


@functools.cache
def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        found = {_target(i) for i in _imports(ast.parse(path.read_text()).body)}
        graph[name] = found - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_of_turnkv_imports_itself_through_others() -> None:
    graph = _graph()
    found = [
        "; ".join(f"{a} -> {b}" for a in cycle for b in sorted(graph[a]) if b in cycle) for cycle in _cycles(graph)
    ]
    assert found == []


def test_no_package_of_turnkv_imports_itself_through_others() -> None:
    # a package is a module's first name below turnkv (turnkv.gateway, turnkv.launch, turnkv.config...)
    graph = _graph()
    packages: dict[str, set[str]] = {_package(m): set() for m in graph}
    for m, found in graph.items():
        packages[_package(m)] |= {_package(d) for d in found} - {_package(m)}
    edges = [
        f"{m} -> {d}"
        for cycle in _cycles(packages)
        for m in sorted(graph)
        if _package(m) in cycle
        for d in sorted(graph[m])
        if _package(d) in cycle and _package(d) != _package(m)
    ]
    assert edges == []


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", BELOW_THE_GATEWAY)
def test_what_lies_below_the_gateway_imports_nothing_from_it(package: str) -> None:
    graph = _graph()
    inside = [m for m in graph if m == package or m.startswith(package + ".")]
    assert inside
    assert sorted((m, d) for m in inside for d in graph[m] if d.startswith("turnkv.gateway")) == []


def test_openai_shapes_import_nothing_else_of_turnkv() -> None:
    graph = _graph()
    assert sorted(d for m in graph if m.startswith("turnkv.openai") for d in graph[m]) == []
