"""The shape of the code, read from the source: imports point down the layers
that docs/architecture.md draws, no import cycle, no private name crosses a module,
and modules and functions stay small enough to hold in mind (no exemption list).

The import graph is built with ``ast`` from every module of the package: module-level
and function-level imports (an import inside a function still ties the two modules
together), and those under ``if TYPE_CHECKING:`` too (they never run, but a circle of them
is still two modules that each need the other to be understood).
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
              "shardflow.state", "shardflow.expand", "shardflow.seeding", "shardflow.accounting")),
    ("format", ("shardflow.format",)),
    ("storage", ("shardflow.storage", "shardflow.urls")),
    ("codecs", ("shardflow.codecs", "shardflow.graph")),
    ("plan", ("shardflow.planning",)),
    ("reading", ("shardflow.sources", "shardflow.reader", "shardflow.planning.selection")),
    ("dataset", ("shardflow.dataset", "shardflow.loading", "shardflow.indexed", "shardflow.transforms")),
    ("tools", ("shardflow.writing", "shardflow.convert", "shardflow.inspect", "shardflow.show")),
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
        for node in ast.walk(module.tree):  # (``if TYPE_CHECKING:`` imports too: a typing-only circle is one)
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
    assert "shardflow.graph.collate" in GRAPH["shardflow.loading.collation"].imports  # inside a method
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


# Private names of a dependency live in its compat module (shardflow.compat; the names that
# test_private_names_of_other_packages_only_in_compat cannot tell from shardflow's own), World alone asks
# torch which worker this is, and no shuffle rebuilds a generator from another's state.
CONFINED = [
    (r"torch\._C\b|\._cdata\b|_typed_storage|_untyped_storage|_new_shared|data\._utils|_shutdown_workers",
     {"shardflow.compat.torch"}),
    (r"\._read_array_header\b", {"shardflow.compat.numpy"}),
    (r"\._get_headers\b|\._set_session\b", {"shardflow.compat.gcsfs"}),
    (r"\._mapping\b|\._global_store\b|\._slice_dict\b|\._inc_dict\b|\._num_graphs\b|\._db\b"
     r"|(?<!self)\._(?:store|key|num_nodes)\b", {"shardflow.compat.pyg"}),
    (r"\._strip_protocol\b|\._call_s3\b", {"shardflow.compat.fsspec"}),
    (r"\._request\b|\._credentials\b", {"shardflow.compat.aio"}),
    (r"\bget_worker_info\b", {"shardflow.world"}),
    (r"\bgetstate\(", {"shardflow.seeding"}),  # (seeding saves and restores the caller's generators)
]


@pytest.mark.parametrize("pattern, allowed", CONFINED, ids=["torch", "numpy", "gcsfs", "pyg", "fsspec", "aio", "worker_info", "random"])
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


def test_the_sample_dict_is_built_in_at_most_two_places():
    # a dict display with a "__key__" key: the sample readers hand on is built in one place
    # (shardflow.format.tar.raw_sample), so its shape cannot drift between reading paths
    built = sorted(
        f"{m.name}:{node.lineno}"
        for m in GRAPH.values()
        for node in ast.walk(m.tree)
        if isinstance(node, ast.Dict)
        and any(isinstance(k, ast.Constant) and k.value == "__key__" for k in node.keys)
    )
    assert 1 <= len(built) <= 2, f"the sample dict is built in {len(built)} places (at most 2): {built}"


def _stdlib(name: str) -> bool:
    import sys

    return name.split(".")[0] in sys.stdlib_module_names


def _is_dependency(name: str) -> bool:
    """Whether the module ``name`` belongs to another package: not shardflow, not the standard library."""
    return not (name == "shardflow" or name.startswith("shardflow.") or _stdlib(name))


def _own_attributes() -> set[str]:
    """The names shardflow itself defines: functions, classes, variables, arguments, attributes it
    sets on ``self``/``cls``, ``__slots__`` entries. A private attribute of another name is a dependency's."""
    own: set[str] = set()
    for m in GRAPH.values():
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
                own.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return own


def _dependency_privates(module: Module, own: set[str]) -> list[str]:
    """Where ``module`` imports a private name (or module) of another package, or reads or sets a private
    attribute of one: on a name bound to its import, or on any object when shardflow defines no such name."""
    found: list[str] = []
    bound: dict[str, str] = {}  # local name -> the module it was imported from
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = alias.name
                if _is_dependency(alias.name) and any(map(_is_private, alias.name.split("."))):
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                bound[alias.asname or alias.name] = node.module
                if _is_dependency(node.module) and any(map(_is_private, [*node.module.split("."), alias.name])):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(module.tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in bound:
            if _is_dependency(bound[base.id]):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif not (isinstance(base, ast.Name) and base.id in ("self", "cls")) and node.attr not in own:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_private_names_of_other_packages_only_in_compat():
    # a dependency's private name moves without notice on an upgrade: each one is used behind a
    # function of shardflow.compat, where tests/test_compat.py checks it is still there
    own = _own_attributes()
    found = {m.name: f for m in GRAPH.values()
             if not m.name.startswith("shardflow.compat") and (f := _dependency_privates(m, own))}
    assert not found, f"private names of other packages outside shardflow.compat (wrap them there): {found}"


MAX_MODULES_PER_FOLDER = 15
"""Modules (``.py`` files, ``__init__.py`` included) directly in one package folder, the top level too."""


def test_no_package_folder_holds_more_than_15_modules():
    folders = {PACKAGE, *(p.parent for p in PACKAGE.rglob("__init__.py"))}
    crowded = {str(f.relative_to(PACKAGE.parent)): n for f in sorted(folders)
               if (n := len(list(f.glob("*.py")))) > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"package folders over {MAX_MODULES_PER_FOLDER} modules (give them sub-packages): {crowded}"


MAX_SHARED_SELF_NAMES = 12
"""``self.`` attribute names that the modules of ``shardflow/dataset/`` may share: the dataset
holds configuration, its epochs' runs hold every position, and no mixin spreads one object's
state over several files."""


def _self_names(module: Module) -> set[str]:
    return {node.attr for node in ast.walk(module.tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"}


def test_the_dataset_modules_share_few_self_names():
    modules = [m for name, m in GRAPH.items() if name.startswith("shardflow.dataset.")]
    assert len(modules) >= 5
    where: dict[str, list[str]] = {}
    for m in modules:
        for attr in _self_names(m):
            where.setdefault(attr, []).append(m.name.rsplit(".", 1)[-1])
    shared = {attr: sorted(ms) for attr, ms in where.items() if len(ms) > 1}
    assert len(shared) <= MAX_SHARED_SELF_NAMES, f"{len(shared)} self. names shared across shardflow/dataset/: {shared}"
