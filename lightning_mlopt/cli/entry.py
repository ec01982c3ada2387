"""``python -m lightning_mlopt fit|validate|test|predict --config FILE [--config OVERLAY ...]``.

A LightningCLI subclass that adds to Lightning's: our strategies by short name (``trainer.strategy: zero2``) and a
planner-backed ``strategy: auto``; a run directory that is stable across relaunches of the same command (the
resolved config is written there); FaultTolerantCheckpoint on by default (``checkpoint:``), so a relaunch resumes;
and bad input that ends in a short message and exit 2, before anything is written. Tools: see ``commands.py``.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import Namespace, set_parsing_settings
from jsonargparse.typing import NonNegativeFloat
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_mlopt import strategies
from lightning_mlopt._compat import cli_subcommand_parser, parser_actions, subcommand_parsers
from lightning_mlopt.callbacks import (
    CollectiveSequenceCheck,
    CompileModel,
    FaultTolerantCheckpoint,
    Float8Training,
    PerformanceMonitor,
    ThroughputProgressBar,
    UnevenInputs,
)
from lightning_mlopt.cli.bad_input import check_config_files, config_paths, explain_parser_error, raised_by_lightning
from lightning_mlopt.cli.ckpt_path import prefer_own_checkpoint, read_by_lightning, resolve_ckpt_path
from lightning_mlopt.cli.commands import TOOLS, TRAINER_RUNS, refuse_unknown_subcommand, tools_help
from lightning_mlopt.cli.quiet import quiet_lightning, show_our_warnings_plainly
from lightning_mlopt.cli.renamed_keys import RENAMED
from lightning_mlopt.cli.run_dir_guard import RunDirGuard
from lightning_mlopt.cli.support import (
    MeasuredModelSummary,
    RunFinished,
    SaveResolvedConfig,
    StartupComplete,
    check_fits_strategy,
    default_optimizer_replaced,
    describe_outputs,
    finished_run,
    poll_preemption_notices,
    unused_model_arguments,
    write_final_metrics,
)
from lightning_mlopt.exceptions import BadInputError, CheckpointWriteError, StoppedTogether
from lightning_mlopt.goodput.ledger import GoodputLedger
from lightning_mlopt.process import exit_codes, launch_report
from lightning_mlopt.process.exit import exit_after_launcher, leave_without_destructors, shut_down_process_group
from lightning_mlopt.process.launcher import is_global_rank_zero
from lightning_mlopt.process.notices import PreemptionNotices
from lightning_mlopt.process.startup import DEFAULT_STARTUP_TIMEOUT_S, STARTUP_TIMEOUT_EXIT_CODE, startup_guard
from lightning_mlopt.run_dir import config_name, fill_run_dir, refuse_foreign_config, resolve_run_dir
from lightning_mlopt.spelling import spelled_for_the_cli
from lightning_mlopt.tracking import mlflow_tracker, wandb_tracker  # noqa: F401 (YAML may name `WandbTracker` alone)

DEFAULT_SEED = 1234
CHECKPOINT_WRITE_EXIT_CODE = exit_codes.CHECKPOINT_WRITE


class MLOptParser(LightningArgumentParser):
    """Raises :class:`BadInputError` where jsonargparse would print its usage and exit."""

    argv: list[str] = []  # set by main(), to name the file or argument a bad key came from

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        raise BadInputError(explain_parser_error(message, _known_keys(self), self.argv, RENAMED)) from ex


def _known_keys(parser: LightningArgumentParser) -> set[str]:
    """Every dotted key a parser and its subcommand parsers accept (for "did you mean")."""
    keys = {action.dest for action in parser_actions(parser)}
    for subparser in subcommand_parsers(parser):
        keys |= _known_keys(subparser)  # type: ignore[arg-type]
    return keys


class MLOptCLI(LightningCLI):
    """LightningCLI with our strategy names, a stable run directory and short bad-input errors.

    Example::

        python -m lightning_mlopt fit --config configs/gpt.yaml --config configs/strategies/ddp.yaml
    """

    def __init__(self, args: Sequence[str] | None = None, run: bool = True) -> None:
        self.run_dir: Path | None = None
        words = list(args) if args is not None else sys.argv[1:]
        asks_help = any(word in ("-h", "--help") for word in words)
        self._launched = words[0] if words and not asks_help else None  # the subcommand, when it comes first
        # The settings come from YAML: messages name them by their keys (``checkpoint.resume.final: true``), in
        # this process and the ranks it launches.
        with spelled_for_the_cli():
            super().__init__(
                model_class=LightningModule,
                # No datamodule class: `data:` is optional (subclass mode), as in LightningCLI, so a model that
                # brings its own dataloaders needs none.
                datamodule_class=None,
                subclass_mode_model=True,
                parser_class=MLOptParser,
                save_config_callback=None,  # replaced by SaveResolvedConfig, which knows the run directory
                seed_everything_default=DEFAULT_SEED,
                args=list(args) if args is not None else None,
                run=run,
            )

    @override
    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]  # Lightning's is a staticmethod
        """The launched subcommand's alone: each parser costs ~0.2 s of every rank's start; all of them for help."""
        every = LightningCLI.subcommands()
        return {self._launched: every[self._launched]} if self._launched in every else every

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for action in parser_actions(parser):  # the Trainer's own help for `strategy` knows only Lightning's names
            if action.dest == "trainer.strategy":
                ours = ", ".join(strategies.STRATEGIES)
                action.help = f"{action.help or ''} With lightning_mlopt: {ours}, or auto (the memory planner)."
        # On by default: crash-safe, auto-resuming checkpoints in <run_dir>/checkpoints, configured under `checkpoint:`.
        # Its settings groups document each field in a docstring under it (checkpoint.keep.last, ...), which
        # --help shows. Reading attribute docstrings parses the source of every class introspected (~1 s a
        # start for the Trainer, the model, the data), so it is on for this class alone.
        set_parsing_settings(docstring_parse_attribute_docstrings=True)
        try:
            parser.add_lightning_class_args(FaultTolerantCheckpoint, "checkpoint")
        finally:
            set_parsing_settings(docstring_parse_attribute_docstrings=False)
        # On by default too: per-rank step-time breakdown, throughput, input stalls, MFU and memory under
        # `perf/*`, configured under the top-level `performance:` key.
        parser.add_lightning_class_args(PerformanceMonitor, "performance")
        # And the goodput ledger (`goodput:`): every launch appends its steps and exit to <run_dir>/goodput.jsonl.
        parser.add_lightning_class_args(GoodputLedger, "goodput")
        # torch.compile (`compile:`), off unless turned on (configs/features/compile.yaml, over any strategy overlay).
        parser.add_lightning_class_args(CompileModel, "compile")
        # float8 training (`float8:`, torchao), off unless configs/features/float8.yaml turns it on.
        parser.add_lightning_class_args(Float8Training, "float8")
        parser.set_defaults({"compile.enabled": False, "float8.enabled": False})
        # Cloud spot notices that count as a preemption signal, under the top-level `preemption:` key.
        parser.add_class_arguments(PreemptionNotices, "preemption")
        parser.add_argument(
            "--startup_timeout",
            type=NonNegativeFloat | None,
            default=DEFAULT_STARTUP_TIMEOUT_S,
            help=(
                "Seconds a run may take from launch to its first batch (rendezvous, DeepSpeed op builds, resume) "
                f"before every rank exits with status {STARTUP_TIMEOUT_EXIT_CODE}; null or 0: no limit."
            ),
        )
        RunDirGuard.add_arguments(parser)  # run_dir, and run_dir_wait: one live job per run directory

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        # Lightning warns when both `args` and sys.argv are set; main() always passes the argv it checked.
        self.config = parser.parse_args(args)

    @override
    def _parse_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        read_by_lightning(self.config[subcommand].get("ckpt_path") if subcommand else None, super()._parse_ckpt_path)

    @override
    def before_instantiate_classes(self) -> None:
        config = self._get_section()
        if startup_guard.armed:  # armed by the entry point; the config's limit replaces the default
            startup_guard.arm(config.get("startup_timeout"))
        trainer = config["trainer"]
        if trainer.get("strategy") == "auto" and self.subcommand in (None, "fit"):
            trainer["strategy"] = self._plan_strategy(config)
        if isinstance(trainer.get("strategy"), str):
            try:
                trainer["strategy"] = strategies.resolve_strategy(trainer["strategy"])
            except ValueError as error:
                raise BadInputError(f"trainer.strategy: {error}") from None
        self.run_dir = self._resolve_run_dir(config)
        finished = finished_run(config.as_dict(), self.run_dir) if self.subcommand == "fit" else None
        if finished:  # before any Trainer: a relaunch of a finished run makes no log folder and logs nothing
            raise RunFinished(finished)
        # Recorded in the saved config.yaml, so relaunching from that file lands in this run, whatever its name.
        config["run_dir"] = str(self.run_dir.resolve())
        trainer["default_root_dir"] = config["run_dir"]  # absolute, as in a relaunch from the saved config
        fill_run_dir(config, str(self.run_dir))
        if self.subcommand == "fit" and (chosen := prefer_own_checkpoint(config, self.run_dir)):
            _rank_zero_print(chosen)
        described = resolve_ckpt_path(config, self.run_dir)
        if described is not None:
            _rank_zero_print(f"ckpt_path: {described}, verified")

    def _plan_strategy(self, config: Namespace) -> str:
        """``strategy: auto`` on several processes: the memory planner picks the simplest strategy that fits.

        Every rank plans from the same config (the same choice); one process keeps Lightning's own ``auto``.
        """
        from lightning_mlopt.checkpoint.rng import capture_rng_state, restore_rng_state
        from lightning_mlopt.planning.auto import choose_strategy, world_size_of

        as_dict = config.as_dict()
        if world_size_of(as_dict.get("trainer") or {}) < 2:
            return "auto"
        # The planner builds the model to measure it, drawing from the RNGs seeded a moment ago: put them back,
        # so `auto` trains exactly the run its chosen strategy would.
        seeded = capture_rng_state()
        try:
            name, _, table = choose_strategy(as_dict)
        except Exception as error:
            _rank_zero_print(f"strategy: auto could not plan ({error}); using DDP")
            return "ddp"
        finally:
            restore_rng_state(seeded)
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
        run_dir = resolve_run_dir(config.as_dict(), [str(path) for path in (config.get("config") or [])])
        refuse_foreign_config(run_dir, config_name(self.subcommand))  # each launch saves its config there
        return run_dir

    @override
    def instantiate_classes(self) -> None:
        # Constructors validate their arguments (the shared style guide: "the constructor is the config"), so an error
        # here is the user's input, not our bug: report it like a parser error, before any file exists.
        replaced = default_optimizer_replaced(self._get_section())
        try:
            with warnings.catch_warnings():
                if replaced is not None:  # a demo's default optimizer, replaced as the config asks: no warning
                    overridden = rf"`{re.escape(replaced.__name__)}\.configure_optimizers` will be overridden"
                    warnings.filterwarnings("ignore", message=overridden)
                super().instantiate_classes()
        except (ValueError, TypeError, FileNotFoundError, MisconfigurationException) as error:
            if isinstance(error, TypeError) and not raised_by_lightning(error):  # a bug in the user's code: traceback
                raise
            message = explain_parser_error(str(error), _known_keys(self.parser), MLOptParser.argv, RENAMED)
            raise BadInputError(message) from None
        if replaced is not None and (unused := unused_model_arguments(self._get_section(), replaced)):
            _rank_zero_print(unused)

    @override
    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Trainer:
        assert self.run_dir is not None
        name = config_name(self.subcommand)
        section = self.config.get(str(self.subcommand), self.config)
        callbacks = [
            *callbacks,
            SaveResolvedConfig(cli_subcommand_parser(self, self.subcommand), section, self.run_dir, name),
        ]
        callbacks.append(StartupComplete())
        given = [*callbacks, *(config.get("callbacks") or [])]
        if not any(isinstance(c, UnevenInputs) for c in given):
            callbacks.append(UnevenInputs())  # ranks whose data differs in length end each epoch together
        if not any(isinstance(c, CollectiveSequenceCheck) for c in given):
            callbacks.append(CollectiveSequenceCheck())  # ranks that issue different collectives are named
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in given):
            callbacks.append(ThroughputProgressBar())  # Lightning's bar plus samples/s and the run's ETA
        if config.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary) for c in given):
            callbacks.append(MeasuredModelSummary())  # FLOPs only where measured, not a column of zeros
        return super()._instantiate_trainer(config, callbacks)

    def before_fit(self) -> None:
        """Check the model against the strategy, hold the run directory, then say where the outputs go (rank zero)."""
        self._check_model_fits_strategy()
        RunDirGuard.hold(self.trainer, self.run_dir, self._get_section().get("run_dir_wait"))  # before any file
        poll_preemption_notices(self.trainer, self._get_section().get("preemption"))
        _rank_zero_print(describe_outputs(self.trainer, self.run_dir))

    def before_validate(self) -> None:
        """Check the model against the strategy before anything runs."""
        self._check_model_fits_strategy()

    before_test = before_predict = before_validate

    def _check_model_fits_strategy(self) -> None:
        """A strategy setting that the model or the batch size does not fit fails here, before files."""
        check_fits_strategy(self.trainer.strategy, self.model, self.datamodule)

    def after_fit(self) -> None:
        """Rank zero: write ``metrics.json`` (final metrics, for sweeps and scripts) and print the result."""
        if self.trainer.is_global_zero and self.run_dir is not None:
            write_final_metrics(self.trainer, self.run_dir)


class ParseOnlyCLI(MLOptCLI):
    """Parses and validates a command line like ``fit`` would, and stops there: nothing built or written."""

    @override
    def before_instantiate_classes(self) -> None:
        pass

    @override
    def instantiate_classes(self) -> None:
        pass

    @override
    def _set_seed(self) -> None:
        pass  # seeding is an effect of running, not of checking


def print_config(args: Sequence[str], subcommand: str = "fit") -> str:
    """The composed config of a Trainer-run command line (after the subcommand), with its run directory.

    LightningCLI prints it before our run directory exists (``run_dir: null``); a file saved from it, relaunched,
    must land in the same run, so the resolved ``run_dir`` is filled in here.
    """
    flags = [arg for arg in args if arg.split("=")[0] == "--print_config"]
    rest = [arg for arg in args if arg not in flags]
    # This parse has no subcommand: with JSONARGPARSE_DEFAULT_ENV, it reads PL_TRAINER__X where the run reads
    # PL_FIT__TRAINER__X. Offer it the run's variables (this process only prints, then exits).
    prefix = f"PL_{subcommand.upper()}__"
    for name, value in list(os.environ.items()):
        if name.startswith(prefix):
            os.environ["PL_" + name[len(prefix) :]] = value
    parsed = ParseOnlyCLI(rest, run=False)  # main() has checked the config files
    config = parsed.config
    config["run_dir"] = str(resolve_run_dir(config.as_dict(), config_paths(rest)).resolve())
    skip_none = any("skip_null" in flag for flag in flags)
    return str(parsed.parser.dump(config, skip_none=skip_none))


def _rank_zero_print(text: str) -> None:
    if is_global_rank_zero():  # before the Trainer exists its rank helpers are not set up
        print(text, flush=True)


def main(args: Sequence[str] | None = None) -> None:
    """Run a Trainer subcommand (``fit``, ...; tools go through ``commands.py``); bad input exits with status 2."""
    argv = list(sys.argv[1:] if args is None else args)
    if not argv:
        sys.stderr.write(f"error: name a subcommand: {', '.join((*TRAINER_RUNS, *TOOLS))}\n")
        sys.stderr.write(tools_help())
        raise SystemExit(exit_codes.BAD_INPUT)
    if argv in (["-h"], ["--help"]):
        print(tools_help(below=True))
    quiet_lightning()
    show_our_warnings_plainly()
    try:
        refuse_unknown_subcommand(argv[0])
        check_config_files(config_paths(argv))
        MLOptParser.argv = argv
        if argv[0] in TRAINER_RUNS and any(arg.split("=")[0] == "--print_config" for arg in argv):
            print(print_config(argv[1:], argv[0]), end="")
            raise SystemExit(0)
        MLOptCLI(argv)
    except RunFinished as finished:  # every rank reads the same files: each ends here, with nothing to do
        finished.say()
    except BadInputError as error:
        sys.stderr.write("" if error.said_elsewhere else f"error: {error}\n")
        exit_after_launcher(exit_codes.BAD_INPUT)
    except CheckpointWriteError as error:
        sys.stderr.write(f"error: {error}\n")
        exit_after_launcher(CHECKPOINT_WRITE_EXIT_CODE)
    except StoppedTogether as stop:  # a callback stopped every rank on purpose: its message is the diagnosis
        sys.stderr.write(f"error: {type(stop).__name__}: {stop}\n")
        exit_after_launcher(exit_codes.FAILURE)
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            exit_after_launcher(exit_.code)
        raise
    except Exception:
        # Unexpected (a bug, a collective a departed peer broke): Python's report as it would print it, then the
        # exit every other status takes (the process group destroyed, a launched rank after its launcher), so the
        # job ends with 1: not -6 from a live gloo group at exit, nor 137 from a launcher that saw a child fail.
        sys.excepthook(*sys.exc_info())
        exit_after_launcher(exit_codes.FAILURE)
    finally:
        startup_guard.disarm()
    launch_report.write(status=exit_codes.SUCCESS)
    if shut_down_process_group():
        leave_without_destructors(exit_codes.SUCCESS)
