"""The project's import graph, read from the source (ast, nothing imported): no circles between files, and
the lower packages never import the ones built on them.

Every import counts: at module level, inside a function, and under `TYPE_CHECKING` (a circle a type
checker walks is still a circle a reader walks). Modules are files: `a.b` is `a/b.py` or `a/b/__init__.py`.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("data", "kvcache", "model", "history", "serve")
PACKAGES = (*LIBRARY, "benchmark")  # the lab: benchmarks and the tests' harness, above the library

# What each library package may import of the project (besides itself). kvcache/ and data/ are the floor.
ALLOWED = {
    "data": set(),
    "kvcache": set(),
    "model": {"data", "kvcache", "history"},
    "history": {"data"},
    "serve": {"data", "kvcache", "model", "history"},
}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module a dotted name lands in (`a.b.func` -> `a.b`), or None outside the project."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def _imported(module: str, path: Path) -> Iterator[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module
            # `from pkg import name` imports pkg.name when that is a module, else pkg itself
            yield from (f"{source}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        targets = {_resolve(name) for name in _imported(module, path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _package(module: str) -> str:
    return module.split(".")[0]


def test_the_graph_sees_the_project():
    graph = import_graph()
    assert {"kvcache.config", "kvcache.page_layout", "serve.http_server", "benchmark.inference_end2end_example"} <= graph.keys()
    assert "kvcache.page_layout" in graph["kvcache.config"]
    assert "serve.http_limits" in graph["serve.http_connection"]  # `from serve.http_limits import ...`
    assert "kvcache.codecs" in graph["kvcache.config"]  # `from .codecs import ...`: relative, package
    assert "benchmark.serving.end2end_args" in graph["benchmark.serving.end2end"]  # a benchmark's sibling


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_file_imports_itself_back():
    assert circles(import_graph()) == []


def test_each_library_package_imports_only_the_ones_below_it():
    upward = set()
    for module, targets in import_graph().items():
        if _package(module) not in LIBRARY:
            continue
        for target in targets:
            if _package(target) != _package(module) and _package(target) not in ALLOWED[_package(module)]:
                upward.add((module, target))
    assert upward == set()


def test_the_library_never_imports_a_benchmark():
    graph = import_graph()
    assert not [(m, t) for m, targets in graph.items() if _package(m) in LIBRARY
                for t in targets if _package(t) not in LIBRARY]
