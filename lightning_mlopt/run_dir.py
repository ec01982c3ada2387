"""The run directory: one folder per distinct configuration, the same on every relaunch of a command."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# Keys that say where or how to run, not what to train: they must not move the run directory.
_VOLATILE_KEYS = frozenset({"config", "run_dir", "ckpt_path", "print_config", "__path__"})


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """Eight hex digits that identify a resolved configuration, ignoring where it was launched from.

    Example::

        >>> config_fingerprint({"model": {"lr": 0.1}}) == config_fingerprint({"model": {"lr": 0.1}})
        True
    """
    payload = json.dumps(_strip(config), sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:8]


def default_run_dir(root: str | Path, config_files: Iterable[str | Path], config: Mapping[str, Any]) -> Path:
    """``<root>/<stems of the config files>-<fingerprint>``, e.g. ``runs/gpt-zero2-1a2b3c4d``."""
    stems = [Path(str(path)).stem for path in config_files]
    name = "-".join([*stems, config_fingerprint(config)]) if stems else f"run-{config_fingerprint(config)}"
    return Path(root) / name


def _strip(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _strip(item) for key, item in value.items() if key not in _VOLATILE_KEYS}
    if isinstance(value, (list, tuple)):
        return [_strip(item) for item in value]
    return value
