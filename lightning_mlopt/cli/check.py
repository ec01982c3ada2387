"""Check Trainer-run command lines as ``fit`` parses them, and stop there: nothing built or written.

Example::

    config = check_arguments(["--config", "configs/quickstart.yaml", "--model.init_args.lr=0.1"])
    check = ArgumentChecker()  # many command lines (a sweep's trials), one parser
"""

from __future__ import annotations

from collections.abc import Sequence

from jsonargparse import Namespace

from lightning_mlopt.cli.bad_input import check_config_files, config_paths
from lightning_mlopt.cli.entry import MLOptParser, ParseOnlyCLI
from lightning_mlopt.spelling import spelled_for_the_cli


def check_arguments(args: Sequence[str]) -> Namespace:
    """Check a ``fit`` command line (without the subcommand) against the CLI's parser, building nothing.

    Returns:
        The parsed configuration.

    Raises:
        BadInputError: the short message ``fit`` would print, naming the key or file and the fix.

    Example::

        check_arguments(["--config", "configs/quickstart.yaml", "--model.init_args.lr=0.1"])

    """
    return ArgumentChecker()(args)


class ArgumentChecker:
    """:func:`check_arguments` for many command lines, with the parser built once.

    Building the CLI's parser (the Trainer's, the model's and our settings' signatures) costs a third of a second;
    a sweep checks its base config, each swept key and every trial, dozens of command lines.

    Example::

        check = ArgumentChecker()
        configs = [check([*base, f"--model.init_args.lr={lr}"]) for lr in (0.01, 0.1)]
    """

    def __init__(self) -> None:
        self._cli: ParseOnlyCLI | None = None

    def __call__(self, args: Sequence[str]) -> Namespace:
        """The parsed configuration of ``args``; BadInputError as :func:`check_arguments`."""
        argv = list(args)
        check_config_files(config_paths(argv))
        MLOptParser.argv = argv
        if self._cli is None:
            self._cli = ParseOnlyCLI(argv, run=False)  # builds the parser, then parses as a launch does
        else:
            with spelled_for_the_cli():  # its ckpt_path was checked with the first (a sweep's trials share it)
                self._cli.parse_arguments(self._cli.parser, argv)
        return self._cli.config


__all__ = ["ArgumentChecker", "check_arguments"]
