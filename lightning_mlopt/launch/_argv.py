"""Editing a command line that is passed on to another command (a trial, an array task, an srun step)."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def without_options(argv: Sequence[str], names: Collection[str], flags: Collection[str] = ()) -> list[str]:
    """``argv`` without the options in ``names``, written ``--name value`` or ``--name=value``.

    Options also in ``flags`` take no value.

    Example::

        >>> without_options(["--config", "a.yaml", "--run_dir", "x", "--slurm", "--lr=1"], ["--run_dir", "--slurm"],
        ...                 flags=["--slurm"])
        ['--config', 'a.yaml', '--lr=1']
    """
    kept: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            skip_next = "=" not in arg and name not in flags
            continue
        kept.append(arg)
    return kept
