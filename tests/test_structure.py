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
    # leaves: no other module of ours (``_metrics`` uses Lightning's rank helpers, the rest the stdlib or yaml)
    (
        "lightning_mlopt",
        "lightning_mlopt.exceptions",
        "lightning_mlopt._compat",
        "lightning_mlopt.redaction",
        "lightning_mlopt.renamed",
        "lightning_mlopt.spelling",
        "lightning_mlopt.run_dir",
        "lightning_mlopt._metrics",
    ),
    ("lightning_mlopt.process",),  # standard library only: loaded before torch
    (
        "lightning_mlopt.distributed",
        "lightning_mlopt.checkpoint",
        "lightning_mlopt.planning",
        "lightning_mlopt.demos",
        "lightning_mlopt.hooks",  # declared hooks between components; names checkpoint types for typing
    ),
    ("lightning_mlopt.diagnosis", "lightning_mlopt.perf", "lightning_mlopt.strategies"),
    ("lightning_mlopt.callbacks", "lightning_mlopt.tracking"),
    ("lightning_mlopt.goodput",),  # listens to the checkpoint's events and the step's phases
    ("lightning_mlopt.cli",),  # the entry point, its helpers, and the subcommand table the tools read
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
    for node in _module_level_nodes(tree) if top_level_only else ast.walk(tree):
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


def _module_level_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node that runs when the module is imported: all but function bodies (``if``/``try`` included)."""
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


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
            # The root package is a leaf by itself; its subpackages each need a row of their own.
            below = name.startswith(prefix + ".") and prefix != "lightning_mlopt"
            if (name == prefix or below) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{name} is in no layer: add it to LAYERS in {__file__}"
    return best


def test_every_module_is_in_a_layer():
    assert len(MODULES) > 80  # the scan itself must not go quiet
    for name in MODULES:
        _layer(name)
    with pytest.raises(AssertionError, match="is in no layer"):
        _layer("lightning_mlopt.brand_new.module")  # a new package must be placed, not fall to the bottom


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
            # At import time only: an import inside a function runs once torch is loaded anyway.
            for imported, line in _imports(name, top_level_only=True):
                top = imported.split(".")[0]
                if top != "lightning_mlopt" and top not in sys.stdlib_module_names and top != "__future__":
                    found.append(f"{name}:{line} imports {imported}")
    assert not found, "\n".join(found)


# The goodput tool reads a file format: it starts in a tenth of a second, not after seconds of Lightning's imports.
# The subcommand table is read before torch, to dispatch a tool: the cli package's root must stay light too.
FAST_TOOLS = ["lightning_mlopt.tools.goodput", "lightning_mlopt.cli.commands"]


def test_process_modules_and_file_tools_import_without_torch_or_lightning():
    """What the AST check above cannot see through (a module of ours that imports torch): a real import."""
    import subprocess
    import sys

    names = [name for name in MODULES if name.startswith("lightning_mlopt.process")] + FAST_TOOLS
    heavy = "{'torch', 'lightning'}"
    code = f"import sys\nfor name in {names!r}: __import__(name)\nprint(sorted({heavy} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", f"importing {names} loaded {done.stdout.strip()}"


# ----------------------------------------------------------------------------------------------- private reaches


def _defined_private_names(tree: ast.AST) -> set[str]:
    """Private names this source defines: functions, classes, assignments (``self._x =``), parameters."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, (ast.Store, ast.Del))
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return {name for name in names if name.startswith("_")}


# Private names our own modules define (``_compat`` left out: what it reaches is theirs, not ours).
ALL_OURS = set().union(
    *(
        _defined_private_names(ast.parse(path.read_text()))
        for name, path in MODULES.items()
        if not name.endswith("_compat")
    )
)


def _private_reaches(name: str, source: str | None = None) -> list[str]:
    """Every use of another package's private name in module ``name`` (or in ``source``, read as that module).

    A private attribute read or written (``obj._x``, ``getattr(obj, "_x")``) must be one our package defines
    (a base class's private attribute that happens to be set on ``self`` is caught by the base-class check
    below); imports must not name a private module or object of another package.
    """
    tree = ast.parse(MODULES[name].read_text() if source is None else source)
    ours = ALL_OURS | _defined_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module.startswith("lightning_mlopt"):
                continue
            private = [part for part in module.split(".") if _is_private(part)]
            private += [alias.name for alias in node.names if _is_private(alias.name)]
            if private:
                found.append(f"{name}:{node.lineno} from {module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [
                f"{name}:{node.lineno} import {alias.name}"
                for alias in node.names
                if any(_is_private(part) for part in alias.name.split("."))
            ]
        else:
            attr = _attribute_named(node)
            if attr is not None and _is_private(attr) and attr not in PUBLIC_UNDERSCORE and attr not in ours:
                found.append(f"{name}:{node.lineno} .{attr}")
    return sorted(found, key=lambda reach: int(reach.split(":")[1].split(" ")[0]))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _attribute_named(node: ast.AST) -> str | None:
    """The attribute a node reads or writes on another object: ``obj._x``, ``getattr(obj, "_x")``, ...

    ``self._x = ...`` is not a reach: it defines the name (``_defined_private_names``).
    """
    if isinstance(node, ast.Attribute):
        own_store = isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id == "self"
        return None if own_store else node.attr
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
        and len(node.args) > 1
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


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
        module._device_mesh = None        # written, not read
        getattr(logger, "_wandb_init")    # by name
        self._mine = 1
        return self._mine
"""
    found = _private_reaches("lightning_mlopt.example", source)
    assert [reach.split(" ", 1)[1] for reach in found] == [
        "import torch._dynamo",
        "from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint",
        "._experiment",
        "._signal_connector",
        "._device_mesh",
        "._wandb_init",
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


@pytest.mark.slow
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
