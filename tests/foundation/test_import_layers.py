"""The import layers of docs/architecture.md hold, and there are no import cycles.

Imports are read from the source (nothing is imported): those a module runs when it is
first imported, i.e. outside functions and outside ``if TYPE_CHECKING:``. A module may
import its own layer or the ones below; a cycle makes import order matter.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import REPO

# Lowest first; a module belongs to the first layer with a prefix of its name.
LAYERS = [
    ("base", ["llmctl.errors", "llmctl.paths", "llmctl.kv_budget", "llmctl.hardware"]),
    ("model", ["llmctl.model"]),
    ("schema", ["llmctl.options", "llmctl.plugins", "llmctl.profiles"]),
    ("contract", ["llmctl.engine.sampling_params", "llmctl.backend"]),
    ("engine", ["llmctl.engine"]),
    ("selection", ["llmctl.selection"]),
    ("backends", ["llmctl_torch", "llmctl_turbo", "llmctl_openai_proxy", "llmctl_transformers"]),
    ("front ends", ["llmctl.api", "llmctl.server", "llmctl.chat", "llmctl.bench"]),
    ("cli", ["llmctl.cli", "llmctl.options_doc", "llmctl.__main__"]),
]
ROOT = "llmctl"  # the package itself holds only the version and lazy names: any layer uses it

PACKAGE_ROOTS = [REPO, REPO / "backends" / "torch", REPO / "backends" / "turbo"] + sorted(
    p for p in (REPO / "plugins").iterdir() if p.is_dir()
)


def first_party_modules() -> dict[str, Path]:
    """Module name -> file, for every package under the roots."""
    modules = {}
    for root in PACKAGE_ROOTS:
        for init in root.glob("*/__init__.py"):
            package_dir = init.parent
            for path in package_dir.rglob("*.py"):
                parts = path.relative_to(root).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                modules[name] = path
    return modules


def import_time_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run when the module is imported (class bodies too, not functions)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from import_time_statements(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            children = getattr(node, field, None)
            if isinstance(children, list) and children and isinstance(children[0], ast.AST):
                stmts = [c for c in children if isinstance(c, ast.stmt)]
                for handler in (c for c in children if isinstance(c, ast.ExceptHandler)):
                    stmts += handler.body
                yield from import_time_statements(stmts)


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in import_time_statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {m for m in found if m in modules and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in graph:
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = first_party_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> int:
    if module == ROOT:
        return 0
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


def test_the_graph_sees_the_packages():
    graph = import_graph()
    assert {"llmctl.selection", "llmctl_torch.runner", "llmctl_turbo.runner"} <= set(graph)
    assert "llmctl.profiles" in graph["llmctl.selection"]  # a known edge is found


def test_no_module_level_import_cycles():
    found = cycles(import_graph())
    assert not found, "module-level import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_point_down_the_layers():
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {imported} "
        f"({LAYERS[layer_of(imported)][0]})"
        for module, imports in import_graph().items()
        for imported in imports
        if layer_of(imported) > layer_of(module)
    ]
    assert not upward, "imports reaching up a layer:\n" + "\n".join(sorted(upward))


def test_a_cycle_is_detected():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
