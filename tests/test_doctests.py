"""The examples in the package's docstrings (``>>>``) run and show what they say."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import lightning_mlopt


def _modules_with_examples() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(lightning_mlopt.__path__, prefix="lightning_mlopt."):
        if info.name.endswith("__main__"):
            continue
        spec = importlib.util.find_spec(info.name)
        if spec is not None and spec.origin and ">>> " in Path(spec.origin).read_text():
            names.append(info.name)
    return names


MODULES = _modules_with_examples()


def test_the_examples_are_found():
    assert len(MODULES) >= 10, MODULES  # the collection itself must not go quiet


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0, f"{name}: no example ran"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (output above)"


def test_no_module_with_examples_is_missed():
    # A folder without __init__.py is invisible to walk_packages: compare with the files on disk.
    root = Path(lightning_mlopt.__file__).parent
    on_disk = set()
    for path in root.rglob("*.py"):
        if ">>> " in path.read_text() and path.name != "__main__.py":
            parts = path.relative_to(root.parent).with_suffix("").parts
            on_disk.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    assert on_disk == set(MODULES)
