"""The command line: ``python -m lightning_mlopt fit|validate|test|predict|<tool> ...``.

- ``commands.py``: which subcommands exist; the tools are dispatched from it before torch is imported.
- ``entry.py``: the LightningCLI subclass (:class:`MLOptCLI`) and :func:`main`, for the Trainer runs.
- ``check.py``: command lines parsed as ``fit`` would and no further (:func:`check_arguments`, many at once).
- ``support.py``: its run callbacks (resolved config, start-up lines, model summary), a finished run's check.
- ``bad_input.py``: parser errors made short, with the fix named; ``quiet.py``: known noise silenced
  (:func:`quiet_lightning`, public: a script with a Trainer of its own gets the CLI's quiet output with it).

This package's root imports nothing heavy, so a tool starts without torch: ``main``, ``MLOptCLI``,
``check_arguments`` and ``print_config`` load ``entry.py`` when first asked for (``quiet.py`` is standard
library).

Example::

    from lightning_mlopt.cli import main
    main(["fit", "--config", "configs/quickstart.yaml", "--trainer.max_steps=10"])
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_mlopt.cli.quiet import quiet_lightning

__all__ = ["MLOptCLI", "check_arguments", "main", "print_config", "quiet_lightning"]
_LAZY = {"MLOptCLI": "entry", "main": "entry", "check_arguments": "check", "print_config": "entry"}


def __getattr__(name: str) -> Any:
    # PEP 562: the Trainer-run names come from entry.py (torch, Lightning) only when used.
    if name in _LAZY:
        return getattr(importlib.import_module(f"lightning_mlopt.cli.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
