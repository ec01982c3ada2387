"""What every tool subcommand shares: its argument parser, the ``fit`` command line it passes on, bad input.

A tool (``plan``, ``checkpoint``, ``sweep``, ``slurm``, ``profile``) is a ``main(argv) -> int`` that the entry
point dispatches before importing torch (``cli/commands.py``). Bad input ends the same way in each: one line
``error: ...`` naming the cause and the fix, and exit status 2, before anything is written.

Example::

    parser = ToolArgumentParser(prog="python -m lightning_mlopt slurm")
    options, extra = parser.parse_known_args(argv)
    try:
        ...
    except BadInputError as error:
        return bad_input(error)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import NoReturn

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.process.exit_codes import BAD_INPUT

# The first comment of every file a tool writes for the user to keep (an sbatch script, a manifest): a file that
# has it near the top is one a tool wrote before, which a rerun may replace; any other file is the user's.
WRITTEN_BY = "# Written by lightning_mlopt"


class ToolArgumentParser(argparse.ArgumentParser):
    """argparse for the tool subcommands: a bad argument ends in one line and exit status 2, not the usage page.

    Example::

        parser = ToolArgumentParser(prog="python -m lightning_mlopt plan")
        parser.parse_args(["--bogus"])  # error: unrecognized arguments: --bogus (see: ... plan --help); exit 2

    """

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {message} (see: {self.prog} --help)\n")
        raise SystemExit(BAD_INPUT)


def bad_input(error: Exception) -> int:
    """Say what was wrong in one line; the exit status of bad input."""
    sys.stderr.write(f"error: {error}\n")
    return BAD_INPUT


def check_output(path: Path, option: str, example: str) -> None:
    """Refuse to write where data would be lost: at a folder, or over a file no tool of ours wrote.

    Args:
        path: the file the tool is about to write.
        option: the option that chose it, for the fix (``--output``, or ``--sweep_dir`` for a sweep's script).
        example: a file name to suggest when ``path`` is a folder.

    Raises:
        BadInputError: naming the path and the fix.

    Example::

        check_output(Path("precious.txt"), "--output", "job.sbatch")  # a file of the user's: refused

    """
    if path.is_dir():
        raise BadInputError(f"{path} is a folder, not a file: give {option} a file path, e.g. {path / example}")
    if path.exists() and not _written_by_a_tool(path):
        raise BadInputError(
            f"{path} exists and no lightning_mlopt tool wrote it (nothing overwritten): give another {option}, "
            "or move that file away"
        )


def _written_by_a_tool(path: Path) -> bool:
    """Whether one of the first lines of ``path`` is the :data:`WRITTEN_BY` header (only the head is read)."""
    try:
        with path.open("rb") as handle:
            head = handle.read(4096).decode("utf-8", errors="replace")
    except OSError:  # unreadable: not provably ours
        return False
    return any(line.startswith(WRITTEN_BY) for line in head.splitlines()[:3])


def fit_arguments(configs: Sequence[str], extra: Sequence[str]) -> list[str]:
    """The ``fit`` arguments a tool passes on: each config as ``--config PATH``, then the rest as given.

    Example::

        >>> fit_arguments(["a.yaml", "b.yaml"], ["--trainer.max_steps=5"])
        ['--config', 'a.yaml', '--config', 'b.yaml', '--trainer.max_steps=5']
    """
    return [arg for path in configs for arg in ("--config", path)] + list(extra)


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
