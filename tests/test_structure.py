"""The package's structure, pinned: import layers (no circles, nothing upward), private reaches only in
``_compat.py``, and no module over 400 lines without a reason at its top.

A structural claim that no test pins drifts (the README once said "imports point down" over two circles).
The import and private-name scans parse source with ``ast`` (a layering mistake cannot hide behind an import
that happens to work); only the base-class check imports the package, to read what Lightning's classes define.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_mlopt"

# The import layers, lowest first. A module may import its own layer or a lower one, never a higher one; the
# first matching prefix decides (``lightning_mlopt`` alone is the root package: ``__version__``).
LAYERS: list[tuple[str, ...]] = [
    # leaves: the standard library and small third-party helpers only
    (
        "lightning_mlopt",
        "lightning_mlopt.exceptions",
        "lightning_mlopt._compat",
        "lightning_mlopt.redaction",
        "lightning_mlopt.run_dir",
        "lightning_mlopt.commands",
        "lightning_mlopt._quiet",
        "lightning_mlopt._metrics",
        "lightning_mlopt._bad_input",
    ),
    ("lightning_mlopt.process",),  # standard library only: loaded before torch
    ("lightning_mlopt.distributed", "lightning_mlopt.checkpoint", "lightning_mlopt.planning", "lightning_mlopt.demos"),
    ("lightning_mlopt.diagnosis", "lightning_mlopt.perf", "lightning_mlopt.strategies"),
    ("lightning_mlopt.callbacks", "lightning_mlopt.tracking"),
    ("lightning_mlopt.cli", "lightning_mlopt.cli_support"),
    ("lightning_mlopt.tools",),
    ("lightning_mlopt.__main__",),
]

# Lower-floor packages that must not import torch, Lightning or any other third-party package at import time.
STANDARD_LIBRARY_ONLY = ("lightning_mlopt.process",)

MAX_LINES = 400
# Private names that are public API despite the underscore.
PUBLIC_UNDERSCORE = {"_exit", "_replace", "_asdict", "_fields", "_make", "_field_defaults", "_missing_", "_value_"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours that ``name`` (a module, or a name inside one) refers to."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, top_level_only: bool = False) -> Iterator[tuple[str, int]]:
    """(module imported, line) for every import in module ``name``, at any depth unless ``top_level_only``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            yield module, node.lineno
            for alias in node.names:
                yield f"{module}.{alias.name}", node.lineno


def _internal_edges() -> dict[str, dict[str, int]]:
    edges: dict[str, dict[str, int]] = defaultdict(dict)
    for name in MODULES:
        for imported, line in _imports(name):
            if imported.startswith("lightning_mlopt"):
                target = _resolve(imported)
                if target is not None and target != name:
                    edges[name].setdefault(target, line)
    return edges


EDGES = _internal_edges()


def _layer(name: str) -> int:
    best, best_length = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{name} is in no layer: add it to LAYERS in {__file__}"
    return best


def test_every_module_is_in_a_layer():
    assert len(MODULES) > 80  # the scan itself must not go quiet
    for name in MODULES:
        _layer(name)


def test_no_import_points_upward():
    upward = [
        f"{source} (layer {_layer(source)}) imports {target} (layer {_layer(target)}) at line {line}"
        for source, targets in EDGES.items()
        for target, line in targets.items()
        if _layer(target) > _layer(source) and not target.startswith(source + ".")
    ]
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_import_circles():
    # A package's __init__ importing its own submodules is how it re-exports, not a circle.
    graph = {
        source: {
            target
            for target in targets
            if not (MODULES[source].name == "__init__.py" and target.startswith(source + "."))
        }
        for source, targets in EDGES.items()
    }
    circles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                circles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(circle) for circle in circles)


@pytest.mark.parametrize("prefix", STANDARD_LIBRARY_ONLY)
def test_lower_floor_imports_the_standard_library_only(prefix):
    import sys

    found = []
    for name in MODULES:
        if name == prefix or name.startswith(prefix + "."):
            # Module level only: an import inside a function runs once torch is loaded anyway.
            for imported, line in _imports(name, top_level_only=True):
                top = imported.split(".")[0]
                if top != "lightning_mlopt" and top not in sys.stdlib_module_names and top != "__future__":
                    found.append(f"{name}:{line} imports {imported}")
    assert not found, "\n".join(found)


# ----------------------------------------------------------------------------------------------- private reaches


def _defined_private_names(tree: ast.AST) -> set[str]:
    """Private names this source defines: functions, classes, assignments (``self._x =``), parameters."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return {name for name in names if name.startswith("_")}


ALL_OURS = set().union(*(_defined_private_names(ast.parse(path.read_text())) for path in MODULES.values()))


def _private_reaches(name: str, source: str | None = None) -> list[str]:
    """Every use of another package's private name in module ``name`` (or in ``source``, read as that module).

    ``self._x``/``cls._x`` must be defined in the same module (else it is a base class's private attribute);
    ``obj._x`` must be defined somewhere in our package; imports must not name a private module or object of
    another package.
    """
    tree = ast.parse(MODULES[name].read_text() if source is None else source)
    local = _defined_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            attr = node.attr
            if not attr.startswith("_") or attr.startswith("__") or attr in PUBLIC_UNDERSCORE:
                continue
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if (own and attr not in local) or (not own and attr not in ALL_OURS):
                found.append(f"{name}:{node.lineno} .{attr}")
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and not (node.module or "").startswith("lightning_mlopt")
        ):
            module = node.module or ""
            private = [part for part in module.split(".") if part.startswith("_") and not part.startswith("__")]
            private += [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private:
                found.append(f"{name}:{node.lineno} from {module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(part.startswith("_") and not part.startswith("__") for part in alias.name.split(".")):
                    found.append(f"{name}:{node.lineno} import {alias.name}")
    return found


def test_private_reaches_only_in_compat():
    found = [reach for name in MODULES if name != "lightning_mlopt._compat" for reach in _private_reaches(name)]
    assert not found, "private names of other packages used outside _compat.py:\n" + "\n".join(found)


def test_the_private_scan_finds_each_kind_of_reach():
    # The scan must not go quiet: each kind of reach it looks for, written as the package once had it.
    source = """
import torch._dynamo
from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

class Tracker:
    def run(self):
        if self._experiment is None:      # a base class's private attribute, never set here
            trainer._signal_connector.teardown()
        self._mine = 1
        return self._mine
"""
    found = _private_reaches("lightning_mlopt.example", source)
    assert [reach.split(" ", 1)[1] for reach in found] == [
        "import torch._dynamo",
        "from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint",
        "._experiment",
        "._signal_connector",
    ], found


def _external_private_names(cls: type) -> set[str]:
    """Private names that the classes ``cls`` inherits from another package define or use on ``self``."""
    names: set[str] = set()
    for base in cls.__mro__[1:]:
        if base is object or base.__module__.startswith("lightning_mlopt"):
            continue
        names |= {name for name in vars(base) if name.startswith("_") and not name.startswith("__")}
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        names |= set(re.findall(r"self\.(_[a-zA-Z]\w*)", source))
    return names


def test_no_class_of_ours_touches_a_base_class_private_name():
    """``self._x`` where ``_x`` belongs to a Lightning/torch base class: an override or a reach, both via _compat.

    Overriding a private method is allowed only when ``_compat.PRIVATE_OVERRIDES`` lists it (and
    ``tests/test_compat.py`` checks it still exists); reading or writing a base's private attribute goes
    through a ``_compat`` function.
    """
    from lightning_mlopt._compat import PRIVATE_OVERRIDES

    allowed = {name for _, _, name in PRIVATE_OVERRIDES}
    found = []
    for name, path in MODULES.items():
        if name in ("lightning_mlopt._compat", "lightning_mlopt.__main__"):
            continue
        module = importlib.import_module(name)
        for node in ast.walk(ast.parse(path.read_text())):
            cls = getattr(module, node.name, None) if isinstance(node, ast.ClassDef) else None
            if not isinstance(cls, type) or cls.__module__ != name:
                continue
            inherited = _external_private_names(cls) - allowed
            for inner in ast.walk(node):
                touched = None
                if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name):
                    touched = inner.attr if inner.value.id in ("self", "cls") else None
                elif isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) and inner in node.body:
                    touched = inner.name
                if touched in inherited:
                    found.append(f"{name}:{inner.lineno} {cls.__name__} uses its base class's {touched}")
    assert not found, "\n".join(found)


# ------------------------------------------------------------------------------------------------ module size


def test_no_long_module_without_a_reason():
    """A module over 400 lines says why in its first line (a ``# long: ...`` comment) or is split."""
    long = [
        f"{name}: {len(lines)} lines"
        for name, path in MODULES.items()
        if len(lines := path.read_text().splitlines()) > MAX_LINES and not lines[0].startswith("# long: ")
    ]
    assert not long, "modules over 400 lines without a '# long: <reason>' first line:\n" + "\n".join(long)
