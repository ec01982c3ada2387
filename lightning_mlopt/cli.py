"""``python -m lightning_mlopt fit|validate|test|predict --config FILE [--config OVERLAY ...]``.

A LightningCLI subclass that adds to Lightning's: our strategies by short name (``trainer.strategy: zero2``)
and a planner-backed ``strategy: auto``; a run directory that is stable across relaunches of the same
command (the resolved config is written there); FaultTolerantCheckpoint on by default (``checkpoint:``), so
a relaunch resumes; and bad input that ends in a short message and exit status 2 instead of a page of usage
text, before anything is written. Two more subcommands are dispatched before the LightningCLI is built:
``checkpoint list|verify|consolidate`` and ``plan``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from typing_extensions import override

from lightning_mlopt import strategies
from lightning_mlopt._bad_input import BadInputError, check_config_files, config_paths, explain_parser_error
from lightning_mlopt.callbacks import FaultTolerantCheckpoint
from lightning_mlopt.run_dir import default_run_dir

DEFAULT_SEED = 1234
DEFAULT_RUNS_ROOT = "runs"


class _Parser(LightningArgumentParser):
    """Raises :class:`BadInputError` where jsonargparse would print its usage and exit."""

    argv: list[str] = []  # set by main(), to name the file or argument a bad key came from

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        raise BadInputError(explain_parser_error(message, _known_keys(self), self.argv)) from ex


def _known_keys(parser: LightningArgumentParser) -> set[str]:
    """Every dotted key a parser and its subcommand parsers accept (for "did you mean")."""
    keys = {action.dest for action in parser._actions}
    subcommands = getattr(parser, "_subcommands_action", None)
    for subparser in getattr(subcommands, "_name_parser_map", {}).values():
        keys |= _known_keys(subparser)
    return keys


class _SaveResolvedConfig(SaveConfigCallback):
    """Writes the resolved config into the run directory (not a per-version log folder), rank zero only.

    Overwriting is deliberate: the run directory is derived from the config, so a relaunch writes the same
    content, and a fresh version folder per relaunch would scatter one run across many.
    """

    def __init__(self, parser: LightningArgumentParser, config: Namespace, run_dir: Path, name: str) -> None:
        super().__init__(parser, config, config_filename=name, overwrite=True, save_to_log_dir=False)
        self.run_dir = run_dir

    @override
    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.parser.save(self.config, self.run_dir / self.config_filename, skip_none=False, overwrite=True)


class MLOptCLI(LightningCLI):
    """LightningCLI with our strategy names, a stable run directory and short bad-input errors.

    Example::

        python -m lightning_mlopt fit --config configs/gpt.yaml --config configs/strategies/ddp.yaml
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        self.run_dir: Path | None = None
        super().__init__(
            model_class=LightningModule,
            datamodule_class=LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_class=_Parser,
            save_config_callback=None,  # replaced by _SaveResolvedConfig, which knows the run directory
            seed_everything_default=DEFAULT_SEED,
            args=list(args) if args is not None else None,
            run=run,
        )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # On by default: every `fit` gets crash-safe, auto-resuming checkpoints in <run_dir>/checkpoints,
        # configured under the top-level `checkpoint:` key.
        parser.add_lightning_class_args(FaultTolerantCheckpoint, "checkpoint")
        parser.add_argument(
            "--run_dir",
            type=str | None,
            default=None,
            help=(
                "Folder for this run's config, logs and checkpoints. Default: "
                f"<trainer.default_root_dir or '{DEFAULT_RUNS_ROOT}'>/<config file stems>-<config hash>, "
                "the same on every relaunch of the same command."
            ),
        )

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # Lightning warns when both `args` and sys.argv are set; main() always passes the argv it checked.
        self.config = parser.parse_args(args)

    @override
    def before_instantiate_classes(self) -> None:
        config = self._get_section()
        trainer = config["trainer"]
        if trainer.get("strategy") == "auto" and self.subcommand in (None, "fit"):
            trainer["strategy"] = self._plan_strategy(config)
        if isinstance(trainer.get("strategy"), str):
            try:
                trainer["strategy"] = strategies.resolve_strategy(trainer["strategy"])
            except ValueError as error:
                raise BadInputError(f"trainer.strategy: {error}") from None
        self.run_dir = self._resolve_run_dir(config)
        trainer["default_root_dir"] = str(self.run_dir)

    def _plan_strategy(self, config: Namespace) -> str:
        """``strategy: auto`` on several processes: the memory planner picks the simplest strategy that fits.

        Every rank plans from the same config, so every rank picks the same strategy. One process needs no
        choice: Lightning's own ``auto`` (a single device) stays.
        """
        from lightning_mlopt.planning.auto import choose_strategy, world_size_of

        as_dict = config.as_dict()
        if world_size_of(as_dict.get("trainer") or {}) < 2:
            return "auto"
        try:
            name, _, table = choose_strategy(as_dict)
        except Exception as error:
            _rank_zero_print(f"strategy: auto could not plan ({error}); using DDP")
            return "ddp"
        _rank_zero_print(table)
        if name is None:
            raise BadInputError(
                "strategy: auto: no strategy fits in memory (table above); use more devices or nodes, "
                "mixed precision, or a smaller model"
            )
        _rank_zero_print(f"strategy: auto chose {name}")
        return name

    def _get_section(self) -> Namespace:
        return self.config[self.subcommand] if self.subcommand else self.config

    def _resolve_run_dir(self, config: Namespace) -> Path:
        if config.get("run_dir"):
            return Path(config["run_dir"])
        root = config["trainer"].get("default_root_dir") or DEFAULT_RUNS_ROOT
        files = [str(path) for path in (config.get("config") or [])]
        return default_run_dir(root, files, config.as_dict())

    @override
    def instantiate_classes(self) -> None:
        # Constructors validate their arguments (STYLE.md: "the constructor is the config"), so an error
        # here is the user's input, not our bug: report it like a parser error, before any file exists.
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError, MisconfigurationException) as error:
            raise BadInputError(explain_parser_error(str(error), _known_keys(self.parser), _Parser.argv)) from None

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Trainer:
        assert self.run_dir is not None
        name = "config.yaml" if self.subcommand in (None, "fit") else f"config.{self.subcommand}.yaml"
        section = self.config.get(str(self.subcommand), self.config)
        callbacks = [
            *callbacks,
            _SaveResolvedConfig(self._parser(self.subcommand), section, self.run_dir, name),
        ]
        return super()._instantiate_trainer(config, callbacks)

    def after_fit(self) -> None:
        """Print the final validation metrics (rank zero), so a run ends with its result on screen."""
        if not self.trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val")}
        if metrics:
            summary = "  ".join(f"{key}={value:.4f}" for key, value in sorted(metrics.items()))
            print(f"Final validation metrics: {summary}")
        print(f"Run directory: {self.run_dir}")


def _rank_zero_print(text: str) -> None:
    # Before the Trainer exists its rank helpers are not set up; launchers set RANK or LOCAL_RANK.
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
        print(text, flush=True)


def main(args: Sequence[str] | None = None) -> None:
    """Run the CLI; bad input exits with status 2 and a short message on stderr."""
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["checkpoint"]:
        from lightning_mlopt.checkpoint.tool import main as checkpoint_main

        raise SystemExit(checkpoint_main(argv[1:]))
    if argv[:1] == ["plan"]:
        from lightning_mlopt.planning.tool import main as plan_main

        raise SystemExit(plan_main(argv[1:]))
    try:
        check_config_files(config_paths(argv))
        _Parser.argv = argv
        MLOptCLI(argv)
    except BadInputError as error:
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(2) from None
    _shut_down_process_group()


def _shut_down_process_group() -> None:
    """After a successful run: wait for every rank, then destroy the process group.

    Lightning leaves it alive. A rank that exits while another is still in a collective tears the
    connection down under it, and gloo's thread then aborts that process ("terminate called without an
    active exception") after a run that succeeded. Not called on errors: a barrier there could wait on a
    rank that is gone.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
