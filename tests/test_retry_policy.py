"""The retry bounds and docs/retries.md agree: the page cannot drift from the code.

The code of both packages is parsed (ast). A module-level number is a retry bound if its name says
so (``..._ATTEMPTS``, ``..._RACES``, ...), if it is the count of a ``for ... in range(N)`` loop
that catches an exception, if such a loop (or a ``while`` loop that catches one) compares against
it, or if it is added to ``time.monotonic()`` (a deadline). Every bound must be listed in the page's
tables as ``module.NAME`` with its value. Every constant listed there must exist with that value.
Every bound follows the naming rule (a Renames table on the page may list old names on their way out).
"""

from __future__ import annotations

import ast
import re

from .code_map import ROOT, library_modules

PAGE = ROOT / "docs" / "retries.md"
#: names that say "retry bound" whatever the code does with them
_BOUND_NAME = re.compile(r"ATTEMPTS|RACES|RETRIES|REFRESHES|RESYNCS|RESTARTS|REOPENS|LOOKS|FAILED_|TIMEOUT")
#: the naming rule (docs/retries.md, "Names of bounds")
_RULE = re.compile(r"_?(MAX_[A-Z0-9_]+_ATTEMPTS|[A-Z0-9_]+_SECONDS|DEFAULT_[A-Z0-9_]+)")
_ROW = re.compile(r"^\|\s*`([a-z0-9_.]+)\.([A-Z_][A-Z0-9_]*)`(?: \(again\))?\s*\|\s*([^|]+?)\s*\|", re.M)


MODULES = library_modules()
TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _constants(tree: ast.Module) -> dict[str, float]:
    """Module-level names bound to a number (a literal or arithmetic on literals)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        try:
            number = eval(compile(ast.Expression(value), "<constant>", "eval"), {"__builtins__": {}})  # noqa: S307
        except Exception:  # noqa: BLE001 - not arithmetic on literals: not a constant here
            continue
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            found.update({t.id: number for t in targets if isinstance(t, ast.Name) and t.id.isupper()})
    return found


CONSTANTS = {name: _constants(tree) for name, tree in TREES.items()}


def _imported(module: str, tree: ast.Module) -> dict[str, tuple[str, str | None]]:
    """Local name -> (module, name in it) for ``from X import NAME`` (name ``None``: a module)."""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            for alias in node.names:
                local = alias.asname or alias.name
                if f"{target}.{alias.name}" in MODULES:
                    found[local] = (f"{target}.{alias.name}", None)
                else:
                    found[local] = (target, alias.name)
    return found


def _resolve(module: str, node: ast.AST, imported: dict) -> tuple[str, str] | None:
    """The module-level constant ``node`` names (``NAME``, an imported ``NAME``, ``mod.NAME``)."""
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS[module]:
            return module, node.id
        where = imported.get(node.id)
        if where is not None and where[1] is not None and where[1] in CONSTANTS.get(where[0], {}):
            return where[0], where[1]
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        where = imported.get(node.value.id)
        if where is not None and where[1] is None and node.attr in CONSTANTS.get(where[0], {}):
            return where[0], node.attr
    return None


def _catches(loop: ast.AST) -> bool:
    return any(isinstance(n, ast.Try) and n.handlers for n in ast.walk(loop))


def _is_monotonic(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)) and \
        getattr(node.func, "attr", getattr(node.func, "id", "")) == "monotonic"


def _laps(loop: ast.For) -> bool:
    """Whether a ``for`` loop counts laps (its variable unused: ``_``, ``_attempt``, ``attempt``)."""
    return isinstance(loop.target, ast.Name) and (loop.target.id.startswith("_") or "attempt" in loop.target.id)


def retry_bounds(by_name: bool = True) -> dict[tuple[str, str], str]:
    """``(module, NAME) -> why it counts as a retry bound``, over both packages (``by_name``:
    names that say so count too; without it, only what the code does with them)."""
    bounds: dict[tuple[str, str], str] = {}
    for module, tree in TREES.items():
        imported = _imported(module, tree)

        def note(node: ast.AST, why: str) -> None:
            for sub in ast.walk(node):
                found = _resolve(module, sub, imported)  # noqa: B023 - used at once
                if found is not None:
                    bounds.setdefault(found, why)

        if by_name:
            bounds.update({(module, n): "its name" for n in CONSTANTS[module] if _BOUND_NAME.search(n)})
        for node in ast.walk(tree):
            if isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and \
                    getattr(node.iter.func, "id", None) == "range" and len(node.iter.args) == 1 and \
                    (_laps(node) or _catches(node)):
                note(node.iter, "the count of a loop of laps")
            if isinstance(node, (ast.For, ast.While)) and _catches(node):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Compare):
                        note(sub, "compared in a loop that catches")
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and \
                    (_is_monotonic(node.left) or _is_monotonic(node.right)):
                note(node, "a deadline")
    return bounds


def _page() -> tuple[dict[tuple[str, str], list[str]], dict[tuple[str, str], str]]:
    """``(rows of the loop tables: (module, NAME) -> values, renames: (module, NAME) -> new name)``."""
    text = PAGE.read_text()
    tables, _, renames = text.partition("\n## Renames\n")
    rows: dict[tuple[str, str], list[str]] = {}
    for module, name, value in _ROW.findall(tables):
        rows.setdefault((module, name), []).append(value)
    renamed = {(m, n): new.strip("` ") for m, n, new in _ROW.findall(renames)}
    return rows, renamed


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("_", ""))
    except ValueError:
        return None


def test_the_detection_finds_the_loops_by_their_shape_not_only_by_name():
    bounds = retry_bounds(by_name=False)
    for known, why in [(("storage_adapters.rolling_handle", "MAX_REFRESH_ATTEMPTS"), "the count of a loop of laps"),
                       (("attrindex.log.cleanup_policy", "MAX_CONFIGURE_ATTEMPTS"), "the count of a loop of laps"),
                       (("attrindex.btree.tree", "MAX_READ_ATTEMPTS"), "compared in a loop that catches"),
                       (("attrindex.attribute_state", "BACKPRESSURE_WAIT_SECONDS"), "a deadline")]:
        assert bounds.get(known) == why, known
    # ``_policy.MAX_CONFIGURE_ATTEMPTS`` is only used in segment.py (a module attribute), and
    # ``MAX_OPEN_ATTEMPTS`` is imported there: both resolve to the module that defines them.
    assert ("attrindex.segment", "MAX_OPEN_ATTEMPTS") not in bounds
    assert ("attrindex.appender", "MAX_GROUP_APPEND_ATTEMPTS") in retry_bounds()  # (``yield from range``: by its name)


def test_every_retry_bound_is_on_the_page_with_its_value():
    rows, _renamed = _page()
    missing, wrong = [], []
    for (module, name), why in sorted(retry_bounds().items()):
        if (module, name) not in rows:
            missing.append(f"{module}.{name} ({why}) = {CONSTANTS[module][name]}")
            continue
        value = CONSTANTS[module][name]
        wrong += [f"{module}.{name}: the page says {v}, the code {value}" for v in rows[(module, name)]
                  if _number(v) != value]
    assert not missing, f"retry bounds missing from docs/retries.md: {missing}"
    assert not wrong, wrong


def test_every_constant_on_the_page_exists_with_that_value():
    rows, renamed = _page()
    for (module, name), values in [*rows.items(), *((k, []) for k in renamed)]:
        assert module in MODULES, f"docs/retries.md names {module}.{name}: no module {module}"
        assert name in CONSTANTS[module], f"docs/retries.md names {module}.{name}: no such constant"
        for value in values:
            assert _number(value) == CONSTANTS[module][name], (module, name, value)


def test_every_retry_bound_follows_the_naming_rule_or_is_listed_for_renaming():
    _rows, renamed = _page()
    unnamed = [f"{module}.{name}" for module, name in sorted(retry_bounds())
               if not _RULE.fullmatch(name) and (module, name) not in renamed]
    assert not unnamed, f"retry bounds named against the rule and not in docs/retries.md's Renames: {unnamed}"
    for (module, name), new in renamed.items():
        assert _RULE.fullmatch(new), f"{module}.{name}: the new name {new!r} breaks the rule too"
        assert not _RULE.fullmatch(name), f"{module}.{name} follows the rule: take it off the Renames table"
