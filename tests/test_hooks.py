"""The hooks between components are declared (``lightning_mlopt/hooks.py``), and nothing finds one by name.

Pinned here, by parsing the package's source: every class that defines a hook method subclasses the Protocol
that declares it, and builds (a misspelt method leaves it abstract); no ``getattr``/``hasattr`` names a hook;
no module but ``hooks.py`` walks ``trainer.callbacks``. A user's class that has the methods satisfies a hook
without subclassing it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_mlopt import hooks
from lightning_mlopt.hooks import (
    CheckpointUploader,
    DescribesOutputs,
    ResumeListener,
    RunTracker,
    SaveVetter,
    callbacks_with,
    checkpoint_events,
    loggers_with,
)

PACKAGE = Path(hooks.__file__).resolve().parent
PROTOCOLS = (RunTracker, CheckpointUploader, ResumeListener, SaveVetter, DescribesOutputs)
MEMBER_OF = {member: protocol for protocol in PROTOCOLS for member in protocol.__abstractmethods__}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _classes() -> list[tuple[str, ast.ClassDef]]:
    """(module, class definition) for every class in the package's source."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        found += [(_module_name(path), node) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    return found


def _base_names(node: ast.ClassDef) -> set[str]:
    return {base.id if isinstance(base, ast.Name) else ast.unparse(base).rpartition(".")[2] for base in node.bases}


def _implementers() -> dict[type, set[type]]:
    """Every class of ours that subclasses a hook Protocol, with the Protocols it declares."""
    classes: dict[type, set[type]] = {}
    for module, node in _classes():
        if module == "lightning_mlopt.hooks":
            continue
        declared = {protocol for protocol in PROTOCOLS if protocol.__name__ in _base_names(node)}
        if declared:
            classes[getattr(importlib.import_module(module), node.name)] = declared
    return classes


@pytest.mark.slow
def test_every_class_that_defines_a_hook_method_subclasses_its_protocol():
    missing = []
    for module, node in _classes():
        if module == "lightning_mlopt.hooks":
            continue
        methods = {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for name in methods & set(MEMBER_OF):
            if MEMBER_OF[name].__name__ not in _base_names(node):
                missing.append(f"{module}.{node.name}.{name}: subclass hooks.{MEMBER_OF[name].__name__}")
    assert not missing, "\n".join(missing)


def test_every_implementer_builds_and_is_its_protocol():
    implementers = _implementers()
    # The scan must see the implementers it is about: our trackers and the callbacks that take part.
    names = {cls.__name__ for cls in implementers}
    assert {"WandbTracker", "MLflowTracker", "ReplicaConsistencyCheck", "FaultTolerantCheckpoint"} <= names
    assert {"NCCLHealthCheck", "PerformanceMonitor"} <= names
    for cls, protocols in implementers.items():
        assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} undefined"
        assert all(issubclass(cls, protocol) for protocol in protocols)


def test_a_misspelt_hook_method_cannot_build():
    class Misspelt(pl.Callback, SaveVetter):
        def before_checkpiont(self, trainer: pl.Trainer) -> None:  # the typo a string lookup would miss
            pass

    with pytest.raises(TypeError, match="before_checkpoint"):
        Misspelt()


def test_a_users_class_with_the_methods_satisfies_a_hook_without_subclassing():
    class UsersUploader(CSVLogger):
        def __init__(self, save_dir: str) -> None:
            super().__init__(save_dir)
            self.uploaded: list[Any] = []

        def log_checkpoint_artifact(self, path: Path, manifest: Any) -> None:
            self.uploaded.append((path, manifest))

    class UsersVetter(pl.Callback):
        def before_checkpoint(self, trainer: pl.Trainer) -> None:
            pass

    plain = CSVLogger("unused")
    trainer = pl.Trainer(
        logger=[UsersUploader("unused"), plain], callbacks=[UsersVetter(), pl.Callback()], enable_progress_bar=False
    )
    assert [type(logger) for logger in loggers_with(trainer, CheckpointUploader)] == [UsersUploader]
    assert loggers_with(trainer, ResumeListener) == [] and loggers_with(trainer, RunTracker) == []
    assert [type(callback) for callback in callbacks_with(trainer, SaveVetter)] == [UsersVetter]


def test_checkpoint_events_are_one_per_trainer():
    first, second = pl.Trainer(logger=False), pl.Trainer(logger=False)
    assert checkpoint_events(first) is checkpoint_events(first)
    checkpoint_events(first).resumed_from = Path("step-000000010")
    assert checkpoint_events(second).resumed_from is None and checkpoint_events(second).store is None


def _calls_naming_a_hook(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each getattr/hasattr whose attribute is a hook method named by a string."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id in ("getattr", "hasattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and name.value in MEMBER_OF:
                found.append((node.lineno, name.value))
    return found


def _walks_of_the_callback_list(tree: ast.AST) -> list[int]:
    """Lines that iterate ``<something>.callbacks`` (a loop or a comprehension)."""
    iterables = [node.iter for node in ast.walk(tree) if isinstance(node, (ast.For, ast.comprehension))]
    return [it.lineno for it in iterables if isinstance(it, ast.Attribute) and it.attr == "callbacks"]


@pytest.mark.slow
def test_no_hook_is_found_by_name_and_no_callback_list_is_scanned_outside_hooks():
    by_name, scans = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        where = path.relative_to(PACKAGE.parent)
        by_name += [f"{where}:{line}: {name}" for line, name in _calls_naming_a_hook(tree)]
        if path.name != "hooks.py":
            scans += [f"{where}:{line}" for line in _walks_of_the_callback_list(tree)]
    assert not by_name, "hooks looked up by name (use lightning_mlopt.hooks):\n" + "\n".join(by_name)
    assert not scans, "callback lists scanned (use hooks.callbacks_with or checkpoint_events):\n" + "\n".join(scans)


def test_the_scans_find_what_they_forbid():
    source = "v = getattr(cb, 'before_checkpoint', None)\nfor c in trainer.callbacks:\n    pass\n"
    tree = ast.parse(source)
    assert _calls_naming_a_hook(tree) == [(1, "before_checkpoint")]
    assert _walks_of_the_callback_list(tree) == [2]
    assert _walks_of_the_callback_list(ast.parse("[c for c in self.trainer.callbacks]")) == [1]
