"""Keys of an earlier release that a settings group replaced: refused by name, with the key that replaced each.

A class whose flat arguments were grouped takes ``**renamed`` and passes it here, so ``keep_last=5`` fails with
``keep_last is now keep.last`` rather than a bare "unexpected keyword argument"; the CLI names the same new key
for the same old one in YAML (``cli/bad_input.py``).

Example::

    >>> refuse_renamed("Owner", {"old_key": 1}, {"old_key": "group.key"}, {"group": "Group"})
    Traceback (most recent call last):
    ...
    TypeError: Owner: old_key is now group.key (e.g. group=Group(key=...); YAML: group: {key: ...})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def refuse_renamed(
    owner: str, given: Mapping[str, Any], renamed: Mapping[str, str], group_classes: Mapping[str, str]
) -> None:
    """TypeError for the first key of ``given``: its new ``group.key`` named when renamed, else plainly unknown.

    ``renamed``: old key -> ``group.key``; ``group_classes``: group -> the settings class's name (for the example).
    """
    for old in given:
        new = renamed.get(old)
        if new is None:
            raise TypeError(f"{owner}: unexpected argument {old!r}")
        group, field = new.split(".")
        example = f"{group}={group_classes[group]}({field}=...)"
        raise TypeError(f"{owner}: {old} is now {new} (e.g. {example}; YAML: {group}: {{{field}: ...}})")
