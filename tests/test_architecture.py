"""The shape of the code: the import graph of the two packages has no cycle, the storage layer never
imports the layers above it, and no module imports another module's private names. Attribute
reaches into another object's private members are checked for the log's modules
(``attrindex/log``) only.

Modules still over the size limit are listed by name: the list may only shrink (a module that
fits is taken off it, and a new one over the limit fails).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("attrindex", "storage_adapters")
MAX_MODULE_LINES = 900
#: modules still over ``MAX_MODULE_LINES``, to be split by responsibility
OVERSIZED = {"storage_adapters/rolling.py", "attrindex/segment.py"}


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


def _private_reaches(source: str) -> list[str]:
    """``obj._name`` in ``source`` where ``obj`` is not ``self``/``cls`` and no class of the module
    defines ``_name`` (as a method, a class attribute or a ``self._name`` assignment)."""
    tree = ast.parse(source)
    private = lambda name: name.startswith("_") and not name.startswith("__")  # noqa: E731
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    own.add(item.name)
                elif isinstance(item, ast.Assign):
                    own.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    own.add(item.target.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"):
            own.add(node.attr)
    return sorted(ast.unparse(node) for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in own
                  and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")))


def test_the_log_modules_reach_into_no_other_objects_private_members():
    found = {str(path.relative_to(ROOT)): reaches for name, path in MODULES.items()
             if name.startswith("attrindex.log") and (reaches := _private_reaches(path.read_text()))}
    assert found == {}


def test_the_reach_finder_finds_a_reach():
    source = """
class Log:
    def __init__(self):
        self._mine = 1

    def ok(self, other: "Log"):
        return self._mine + other._mine

def clean(log):
    log._sync()
    return log._chunks[log._mine]
"""
    assert _private_reaches(source) == ["log._chunks", "log._sync"]
