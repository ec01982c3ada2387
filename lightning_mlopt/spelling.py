"""How a message names a setting: the way the user set it, YAML keys under the CLI, constructor calls in a script.

A callback does not know how it was made, so the CLI says so: it marks its process (and, through the
environment, every process it starts: Lightning's launcher runs the same command again, a spawn inherits it)
with :data:`CLI_ENV` while it runs. Unmarked, the user wrote Python, and is told the constructor call.

Example::

    >>> CHECKPOINT = Section("checkpoint", "FaultTolerantCheckpoint", {"resume": "Resume"})
    >>> CHECKPOINT.setting("resume.final", True)  # in a script
    'FaultTolerantCheckpoint(resume=Resume(final=True))'
    >>> with spelled_for_the_cli():
    ...     CHECKPOINT.setting("resume.final", True)
    'checkpoint.resume.final: true'
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

CLI_ENV = "LIGHTNING_MLOPT_CLI"
"""Set to ``1`` in the CLI's processes: messages name settings by their YAML keys."""

_UNSET: Any = object()  # no value: the setting named, not a value for it


def by_cli() -> bool:
    """Whether this process runs under the CLI (its settings came from YAML and flags)."""
    return os.environ.get(CLI_ENV) == "1"


@contextmanager
def spelled_for_the_cli() -> Iterator[None]:
    """Mark this process, and those it starts meanwhile, as the CLI's; put the mark back as it was after."""
    before = os.environ.get(CLI_ENV)
    os.environ[CLI_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CLI_ENV, None)
        else:
            os.environ[CLI_ENV] = before


@dataclass(frozen=True)
class Section:
    """A class's settings as messages name them: a YAML section under the CLI, a constructor call in a script.

    Args:
        key: the class's section in the CLI's YAML (``checkpoint``).
        owner: the class a script constructs (``FaultTolerantCheckpoint``).
        groups: each settings group's argument -> its class (``resume`` -> ``Resume``).

    """

    key: str
    owner: str
    groups: Mapping[str, str] = field(default_factory=dict)

    def setting(self, name: str, value: Any = _UNSET) -> str:
        """``name`` (``dirpath``, ``resume.final``), with ``value`` if given, as this process's user writes it.

        Example::

            >>> Section("checkpoint", "FaultTolerantCheckpoint").setting("dirpath")
            'FaultTolerantCheckpoint(dirpath=...)'
        """
        if by_cli():
            shown = "" if value is _UNSET else f": {_yaml(value)}"
            return f"{self.key}.{name}{shown}"
        *groups, last = name.split(".")
        call = f"{last}={'...' if value is _UNSET else repr(value)}"
        for group in reversed(groups):
            call = f"{group}={self.groups[group]}({call})"
        return f"{self.owner}({call})"


def _yaml(value: Any) -> str:
    """A scalar as YAML writes it (``true``, ``null``, a plain string)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
