"""The shape of the code, read from the source: imports point down the layers
that docs/architecture.md draws, no import cycle, no private name crosses a module,
and modules and functions stay small enough to hold in mind (no exemption list).

The import graph is built with ``ast`` from every module of the package: module-level
and function-level imports (an import inside a function still ties the two modules
together), but not those under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shardflow"

# Lowest first. A module may import modules of its own layer or of a lower one. The
# layer of a module is that of its longest listed prefix ("shardflow" itself names only
# the package's __init__, so that a new top-level module must be placed here).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("shardflow", "shardflow.errors", "shardflow.policy", "shardflow.fastpath", "shardflow.compat", "shardflow.world",
              "shardflow.state", "shardflow.expand", "shardflow.seeding")),
    ("format", ("shardflow.format",)),
    ("storage", ("shardflow.storage", "shardflow.urls")),
    ("codecs", ("shardflow.codecs", "shardflow.graph")),
    ("plan", ("shardflow.plan", "shardflow.costs", "shardflow.order", "shardflow.mixing", "shardflow.elastic", "shardflow.window")),
    ("reading", ("shardflow.shardset", "shardflow.source", "shardflow.reader", "shardflow.selection")),
    ("dataset", ("shardflow.dataset", "shardflow.dataloader", "shardflow.indexed", "shardflow.loading", "shardflow.collation",
                 "shardflow.transforms", "shardflow.batching", "shardflow.transfer")),
    ("tools", ("shardflow.writer", "shardflow.shardfile", "shardflow.indexing", "shardflow.convert", "shardflow.inspect", "shardflow.show")),
    ("cli", ("shardflow.cli", "shardflow.config")),
]

MAX_LINES = 450
"""Lines per module, for every module: a longer one is split along its seams."""

MAX_FUNCTION_LINES = 100
"""Lines of a function from its ``def`` to its last line, docstring included, for every function."""

MAX_BODY_LINES = 80
"""Lines of a function's body after its docstring, for every function."""


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    imports: set[str] = field(default_factory=set)
    private: list[str] = field(default_factory=list)


def _modules() -> dict[str, Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        out[name] = Module(name, path, is_package, ast.parse(path.read_text(), str(path)))
    return out


def _runtime_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) not in skipped:
            yield node


def _base(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    parts = parts[: len(parts) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _owner(name: str, modules: dict[str, Module]) -> str:
    """The module that ``name`` (a module or a name inside one) lives in."""
    while name not in modules:
        name = name.rsplit(".", 1)[0]
    return name


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def build_graph() -> dict[str, Module]:
    modules = _modules()
    for module in modules.values():
        bound: set[str] = set()  # local names bound to shardflow modules
        for node in _runtime_nodes(module.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "shardflow" or alias.name.startswith("shardflow."):
                        module.imports.add(_owner(alias.name, modules))
                        bound.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, node)
                if base != "shardflow" and not base.startswith("shardflow."):
                    continue
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in modules:
                        module.imports.add(target)
                        bound.add(alias.asname or alias.name)
                        continue
                    module.imports.add(_owner(base, modules))
                    if _is_private(alias.name) and _owner(base, modules) != module.name:
                        module.private.append(f"from {base} import {alias.name}")
        for node in _runtime_nodes(module.tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and _is_private(node.attr)):
                module.private.append(f"{node.value.id}.{node.attr}")
        module.imports.discard(module.name)
    return modules


GRAPH = build_graph()


def _cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(modules[v].imports):
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

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return found


def layer_of(name: str) -> int:
    best, level = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            nested = prefix != "shardflow" and name.startswith(prefix + ".")
            if (name == prefix or nested) and len(prefix) > best:
                best, level = len(prefix), i
    if level is None:
        raise AssertionError(f"{name} is in no layer of LAYERS: add it where it belongs")
    return level


def test_the_graph_sees_module_and_function_level_imports():
    # a module-level import, a function-level one, a package and a submodule
    assert "shardflow.storage" in GRAPH["shardflow.reader.segments"].imports
    assert "shardflow.graph.collate" in GRAPH["shardflow.collation"].imports  # inside a method
    assert "shardflow.storage.readers.local" in GRAPH["shardflow.storage.readers"].imports
    assert len(GRAPH) > 60


def test_no_import_cycle():
    cycles = _cycles(GRAPH)
    described = [
        " / ".join(f"{m} -> {sorted(set(GRAPH[m].imports) & set(c))}" for m in c) for c in cycles
    ]
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_no_private_name_crosses_a_module():
    found = {m.name: m.private for m in GRAPH.values() if m.private}
    assert not found, f"private names used across modules (make them public where they live): {found}"


def test_imports_point_down_the_layers():
    wrong = []
    for module in GRAPH.values():
        mine = layer_of(module.name)
        for target in sorted(module.imports):
            theirs = layer_of(target)
            if theirs > mine:
                wrong.append(f"{module.name} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert not wrong, "imports pointing up:\n" + "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_module_size(name):
    lines = len(GRAPH[name].path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} is {lines} lines (limit {MAX_LINES}): split it along its seams"


def _functions(module: Module) -> Iterator[tuple[str, int, int]]:
    """``(qualified name, lines from its def to its end, body lines after its docstring)`` of
    every function, nested ones too."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = child.body[0]
                has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                           and isinstance(first.value.value, str))
                start = child.body[1].lineno if has_doc and len(child.body) > 1 else first.lineno
                yield (f"{prefix}{child.name}", child.end_lineno - child.lineno + 1, child.end_lineno - start + 1)
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")

    yield from walk(module.tree, f"{module.name}.")


def test_function_size():
    functions = [f for m in GRAPH.values() for f in _functions(m)]
    long = {name: lines for name, lines, _ in functions if lines > MAX_FUNCTION_LINES}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines, def to end (split them along their seams): {long}"
    bodies = {name: body for name, _, body in functions if body > MAX_BODY_LINES}
    assert not bodies, f"function bodies over {MAX_BODY_LINES} lines after the docstring (split them): {bodies}"


def test_architecture_doc_names_every_top_level_folder_module_and_layer():
    section = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    files = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    missing = [f"{f}/" for f in folders if f"{f}/" not in section] + [f for f in files if f not in section]
    assert not missing, f"docs/architecture.md does not name {missing}"
    for layer, _ in LAYERS:
        assert layer in section, f"docs/architecture.md does not draw the {layer!r} layer"


# Private names of a dependency live in its compat module (shardflow.compat), World alone asks
# torch which worker this is, and no shuffle rebuilds a generator from another's state.
CONFINED = [
    (r"torch\._C\b|\._cdata\b|_typed_storage|_untyped_storage|_new_shared|data\._utils|_shutdown_workers",
     {"shardflow.compat.torch"}),
    (r"\._read_array_header\b", {"shardflow.compat.numpy"}),
    (r"\._get_headers\b|\._set_session\b", {"shardflow.compat.gcsfs"}),
    (r"\bget_worker_info\b", {"shardflow.world"}),
    (r"\bgetstate\(", {"shardflow.seeding"}),  # (seeding saves and restores the caller's generators)
]


@pytest.mark.parametrize("pattern, allowed", CONFINED, ids=["torch", "numpy", "gcsfs", "worker_info", "random"])
def test_dependency_internals_stay_in_their_module(pattern, allowed):
    import re

    found = sorted(
        f"{m.name}:{n}"
        for m in GRAPH.values()
        if m.name not in allowed
        for n, line in enumerate(m.path.read_text().splitlines(), 1)
        if re.search(pattern, line) and not line.lstrip().startswith("#")
    )
    assert not found, f"{pattern!r} used outside {sorted(allowed) or 'nowhere allowed'}: {found}"
