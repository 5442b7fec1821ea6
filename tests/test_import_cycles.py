"""No import cycle between onnxgrad's modules, counting imports inside functions too: each
module can be read (and changed) knowing only the modules below it."""

from __future__ import annotations

import ast
from pathlib import Path

import onnxgrad

PACKAGE = Path(onnxgrad.__file__).parent


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The onnxgrad modules ``name`` imports; ``from package import submodule`` counts as an
    import of the submodule only."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            subs = [f"{base}.{a.name}" for a in node.names]
            found.update(s for s in subs if s in modules)
            if any(s not in modules for s in subs):
                found.add(base)
    return {m for m in found if m in modules and m != name}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_cycle_finder_sees_a_cycle_through_a_function_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    modules = _modules()
    edges = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert "onnxgrad.cli_common" in edges["onnxgrad.cli_train"]
    assert _cycles(edges) == []
