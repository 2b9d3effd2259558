"""The shape of the code: the import graph of the two packages has no cycle, the storage layer never
imports the layers above it, and no module imports another module's private names (attribute
reaches into another class's private members are not checked here).

Modules and classes still over their size limits are listed by name: the lists may only shrink
(one that fits is taken off, and a new one over the limit fails).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("attrindex", "storage_adapters")
MAX_MODULE_LINES = 900
#: modules still over ``MAX_MODULE_LINES``, to be split by responsibility
OVERSIZED = {"attrindex/log/batch.py", "attrindex/segment.py"}
MAX_CLASS_LINES = 600
#: classes (``path:Class``) still over ``MAX_CLASS_LINES``, to be split by responsibility
OVERSIZED_CLASSES = {"attrindex/segment.py:Segment", "attrindex/log/segment_log.py:SegmentLog"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """``(module imported, names taken from it)`` for every import in the module, resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            names = [alias.name for alias in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            if submodules and len(submodules) == len(names):  # ``from . import bulk``: the submodules
                found += [(module, []) for module in submodules]
            else:
                found.append((target, names))
    return found


def _graph() -> dict[str, set[str]]:
    return {name: {target for target, _names in _imports(name, path) if target in MODULES and target != name}
            for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
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
                    components.append(sorted(component))
    return components


def test_the_import_graph_has_no_cycle():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_storage_layer_never_imports_the_layers_above():
    upward = sorted((name, target) for name, targets in _graph().items() if name.startswith("storage_adapters")
                    for target in targets if target.startswith("attrindex"))
    assert upward == []


def test_no_module_imports_another_modules_private_names():
    found = set()
    for name, path in MODULES.items():
        for target, names in _imports(name, path):
            if target in MODULES and target != name and any(n.startswith("_") and not n.startswith("__") for n in names):
                found.add((str(path.relative_to(ROOT)), target))
    assert sorted(found) == []


def test_modules_stay_under_the_size_limit():
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in MODULES.values()}
    over = {path for path, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert over <= OVERSIZED, f"over {MAX_MODULE_LINES} lines: {sorted(over - OVERSIZED)}"
    assert over == OVERSIZED, f"under the limit now, take them off OVERSIZED: {sorted(OVERSIZED - over)}"


def _class_sizes(source: str) -> dict[str, int]:
    """Lines of each class of a module, nested ones too (by qualified name), decorators included."""
    sizes = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                sizes[prefix + child.name] = child.end_lineno - first + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return sizes


def test_the_class_size_check_counts_a_class_to_its_last_line():
    source = "import x\n\n@dec\nclass A:\n    def f(self):\n        return 1\n\n    class B:\n        y = 2\n"
    assert _class_sizes(source) == {"A": 7, "A.B": 2}


def test_classes_stay_under_the_size_limit():
    over = set()
    for path in MODULES.values():
        for name, lines in _class_sizes(path.read_text()).items():
            if lines > MAX_CLASS_LINES:
                over.add(f"{path.relative_to(ROOT)}:{name}")
    assert over <= OVERSIZED_CLASSES, f"classes over {MAX_CLASS_LINES} lines: {sorted(over - OVERSIZED_CLASSES)}"
    assert over == OVERSIZED_CLASSES, f"under the limit now, take them off OVERSIZED_CLASSES: {sorted(OVERSIZED_CLASSES - over)}"


def test_the_view_of_a_rolling_segment_does_no_io():
    """``storage_adapters.rolling_view`` is built from a listing and changed by its own methods:
    it imports no module that reads or writes (the storage backends, the OS, the network)."""
    name = "storage_adapters.rolling_view"
    imported = {target for target, _names in _imports(name, MODULES[name])}
    assert imported <= {"__future__", "bisect", "re", "typing", "attrs", "storage_adapters.errors"}, imported
