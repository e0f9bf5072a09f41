"""The import layers of docs/architecture.md hold, and there are no import cycles.

Imports are read from the source (nothing is imported): every one, at module level,
inside functions (the lazy imports that keep ``llmctl --help`` light) and under ``if
TYPE_CHECKING:``. A module may import its own layer or the ones below; the few lazy
imports that reach up are listed in ``ALLOWED_UPWARD`` with their reason. A cycle of
any kind (even through a function-level or type-only import) means two modules know
each other: none is allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

# Lowest first; a module belongs to the first layer with a prefix of its name.
LAYERS = [
    ("base", ["llmctl.errors", "llmctl.paths", "llmctl.kv_budget", "llmctl.hardware"]),
    ("model", ["llmctl.model"]),
    ("schema", ["llmctl.options"]),
    ("contract", ["llmctl.engine.sampling_params", "llmctl.backend"]),
    ("plugins", ["llmctl.plugins", "llmctl.profiles"]),
    ("engine", ["llmctl.engine"]),
    ("selection", ["llmctl.selection"]),
    ("backends", ["llmctl_torch", "llmctl_turbo", "llmctl_openai_proxy", "llmctl_transformers"]),
    ("front ends", ["llmctl.api", "llmctl.server", "llmctl.chat", "llmctl.bench"]),
    ("cli", ["llmctl.cli", "llmctl.options_doc", "llmctl.__main__"]),
]
ROOT = "llmctl"  # the package itself holds only the version and lazy names: any layer uses it

# (module, what it imports inside a function) -> why that import may reach up a layer.
ALLOWED_UPWARD = {
    **{
        ("llmctl", name): (
            "`from llmctl import LLM, SamplingParams`: the package's lazy names (PEP 562 "
            "__getattr__), resolved on first access so `import llmctl` stays light"
        )
        for name in ("llmctl.api", "llmctl.engine.sampling_params")
    },
    ("llmctl.options", "llmctl.plugins.manager"): (
        "the schema's full option list includes the options plugins register, and an "
        "option's help the registered backends' rules: read on first use, once plugins load"
    ),
}

PACKAGE_ROOTS = [REPO, REPO / "backends" / "torch", REPO / "backends" / "turbo"] + sorted(
    p for p in (REPO / "plugins").iterdir() if p.is_dir()
)


def first_party_modules(roots: list[Path] = PACKAGE_ROOTS) -> dict[str, Path]:
    """Module name -> file, for every package under the roots."""
    modules = {}
    for root in roots:
        for init in root.glob("*/__init__.py"):
            package_dir = init.parent
            for path in package_dir.rglob("*.py"):
                parts = path.relative_to(root).with_suffix("").parts
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                modules[name] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every first-party module ``name`` imports, wherever the import statement is."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


def import_graph(roots: list[Path] = PACKAGE_ROOTS) -> dict[str, set[str]]:
    modules = first_party_modules(roots)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> int:
    if module == ROOT:
        return 0
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/architecture.md")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import that reaches up a layer and is not in ``ALLOWED_UPWARD``."""
    return sorted(
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {imported} "
        f"({LAYERS[layer_of(imported)][0]})"
        for module, imports in graph.items()
        for imported in imports
        if layer_of(imported) > layer_of(module) and (module, imported) not in ALLOWED_UPWARD
    )


def test_the_graph_sees_the_packages():
    graph = import_graph()
    assert {"llmctl.selection", "llmctl_torch.model", "llmctl_turbo.runner"} <= set(graph)
    assert "llmctl.profiles" in graph["llmctl.selection"]  # a module-level edge
    assert "llmctl.model.check" in graph["llmctl.model.info"]  # function-level and type-only
    assert "llmctl_turbo.build" in graph["llmctl_torch.attention"]  # inside a function


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_point_down_the_layers():
    upward = upward_imports(import_graph())
    assert not upward, "imports reaching up a layer:\n" + "\n".join(upward)


def test_every_allowed_upward_import_exists():
    graph = import_graph()
    stale = [pair for pair in ALLOWED_UPWARD if pair[1] not in graph.get(pair[0], set())]
    assert not stale, f"ALLOWED_UPWARD lists imports that no longer exist: {stale}"


def test_a_function_level_import_that_climbs_a_layer_fails(tmp_path):
    """A model module (below the engine) that imports the engine inside a function."""
    package = tmp_path / "llmctl"
    for directory in (package, package / "model", package / "engine"):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "__init__.py").write_text("")
    (package / "engine" / "runner.py").write_text("RUNNERS = []\n")
    (package / "model" / "probe.py").write_text(
        "def runners():\n    from llmctl.engine.runner import RUNNERS\n\n    return RUNNERS\n"
    )
    upward = upward_imports(import_graph([tmp_path]))
    assert upward == ["llmctl.model.probe (model) imports llmctl.engine.runner (engine)"]
    (package / "engine" / "runner.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import llmctl.model.probe\n"
    )
    assert cycles(import_graph([tmp_path])) == [["llmctl.engine.runner", "llmctl.model.probe"]]


def test_a_cycle_is_detected():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
