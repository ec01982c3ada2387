"""``python -m lightning_mlopt slurm --config FILE --nodes N --gpus_per_node G``: write an sbatch script.

The script runs ``srun python -m lightning_mlopt fit ...`` with one task per device (Lightning's
SLURMEnvironment reads the ranks from SLURM), asks SLURM for SIGUSR1 ``--signal_seconds`` before the time
limit, and requeues itself when the job saved and exited with FaultTolerantCheckpoint's status (75) after
SIGUSR1 or SIGTERM; the requeued job runs the same command in the same run directory and resumes. The task
count is checked twice: here against the config's ``trainer.devices``/``trainer.num_nodes``, and in the
script against the allocation SLURM actually gave. ``--gpus_per_node 0 --cpu_workers N`` is a CPU job (no GPU
request); a GPU request for a config that trains on the CPU is refused. ``--setup`` lines (``module load``,
``conda activate``) run in the batch shell before the job step, which inherits what they set up.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mlopt.checkpoint.settings import configured
from lightning_mlopt.cli.bad_input import config_paths
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.process import exit_codes
from lightning_mlopt.run_dir import SBATCH_NAME, resolve_run_dir
from lightning_mlopt.tools._preamble import ToolArgumentParser, bad_input, check_output, fit_arguments, without_options
from lightning_mlopt.tools.slurm_script import SlurmJob, sbatch_script  # the script itself

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")
_NAME = re.compile(r"^[\w.+-]+$")


def time_limit_seconds(limit: str) -> int:
    """Seconds in a SLURM time limit: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``.

    Example::

        >>> time_limit_seconds("1-02:00:00"), time_limit_seconds("90"), time_limit_seconds("04:30:00")
        (93600, 5400, 16200)
    """
    match = _TIME.match(limit.strip())
    if not match:
        raise BadInputError(f"--time {limit!r} is not a SLURM time limit; e.g. 90, 04:00:00, 1-12:00:00")
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + int(first) * 3600 + int(second or 0) * 60 + int(third or 0)
    if third is not None:  # HH:MM:SS
        return int(first) * 3600 + int(second) * 60 + int(third)
    if second is not None:  # MM:SS
        return int(first) * 60 + int(second)
    return int(first) * 60  # MM


def _as_count(value: Any) -> int | None:
    """An explicit device or node count from the config; None for auto, -1, a list or a string of ids."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def check_task_count(trainer: dict[str, Any], nodes: int, gpus_per_node: int, flag: str = "--gpus_per_node") -> None:
    """Srun starts ``gpus_per_node`` tasks per node and Lightning needs one per device: they must agree.

    ``flag`` is the option that set the per-node count (``--cpu_workers`` for a CPU job), for the message.

    Raises:
        BadInputError: naming both numbers and the fix.

    """
    devices = _as_count(trainer.get("devices"))
    if devices is not None and devices != gpus_per_node:
        raise BadInputError(
            f"trainer.devices is {devices} in the config but {flag} is {gpus_per_node}: the script starts "
            f"one task per device ({nodes} x {gpus_per_node} = {nodes * gpus_per_node} tasks), and Lightning needs "
            f"them equal; set trainer.devices: {gpus_per_node} (or auto) or {flag} {devices}"
        )
    num_nodes = _as_count(trainer.get("num_nodes"))
    if num_nodes not in (None, 1, nodes):
        raise BadInputError(f"trainer.num_nodes is {num_nodes} in the config but --nodes is {nodes}; make them equal")


def add_slurm_arguments(parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """The sbatch flags shared by ``slurm`` and ``sweep --slurm``.

    Returns:
        The option strings added, and those of them that take no value: what ``sweep`` keeps out of the
        command each array task runs.

    """
    # None of them is required by argparse: slurm_job() reports a missing --nodes/--gpus_per_node itself, with
    # the flags that match the config's placement.
    options = [
        parser.add_argument("--nodes", type=int, default=None, help="nodes of the allocation (required)"),
        parser.add_argument(
            "--gpus_per_node",
            type=int,
            default=None,
            help="GPUs per node, one task each (= trainer.devices; required); 0: a CPU job of --cpu_workers tasks",
        ),
        parser.add_argument(
            "--cpu_workers", type=int, default=1, help="tasks per node of a CPU job (--gpus_per_node 0)"
        ),
        parser.add_argument("--partition", default=None),
        parser.add_argument("--time", default=None, help="time limit, e.g. 04:00:00 or 1-12:00:00"),
        parser.add_argument("--account", default=None),
        parser.add_argument("--job_name", default=None, help="default: the config file stems"),
        parser.add_argument("--cpus_per_task", type=int, default=None),
        parser.add_argument("--signal_seconds", type=int, default=120, help="SIGUSR1 this long before the time limit"),
        parser.add_argument(
            "--sbatch_option",
            action="append",
            default=[],
            metavar="OPTION",
            help="an extra #SBATCH line, in the = form: --sbatch_option=--mem=64G (repeatable; never passed to srun)",
        ),
        parser.add_argument(
            "--setup",
            action="append",
            default=[],
            metavar="LINE",
            help="a shell line run before the job step, e.g. --setup 'module load cuda/12.4' (repeatable, in order)",
        ),
        parser.add_argument(
            "--python",
            default=None,
            help="the interpreter the job runs (default: this one, by absolute path); e.g. python after a "
            "`conda activate` in --setup, or a container's: 'apptainer exec image.sif python'",
        ),
        parser.add_argument("--workdir", default=None, help="the folder the job runs in (default: this one)"),
        parser.add_argument(
            "--error_log", action="store_true", help="stderr to slurm-<job id>.err (default: into the .out)"
        ),
    ]
    names = [action.option_strings[0] for action in options]
    return names, [action.option_strings[0] for action in options if action.nargs == 0]


def check_slurm_flags(options: argparse.Namespace) -> None:
    """Check the sbatch flags that need no config (time, names, options, set-up lines); raise BadInputError."""
    if options.nodes is not None and options.nodes < 1:
        raise BadInputError(f"--nodes must be >= 1, got {options.nodes}")
    if options.gpus_per_node is not None and options.gpus_per_node < 0:
        raise BadInputError(f"--gpus_per_node must be >= 0 (0: a CPU job), got {options.gpus_per_node}")
    if options.cpu_workers < 1:
        raise BadInputError(f"--cpu_workers must be >= 1, got {options.cpu_workers}")
    if options.gpus_per_node and options.cpu_workers != 1:
        raise BadInputError("--cpu_workers is for CPU jobs (--gpus_per_node 0); with GPUs there is one task per GPU")
    if options.signal_seconds < 1:
        raise BadInputError(f"--signal_seconds must be >= 1, got {options.signal_seconds}")
    if options.time and time_limit_seconds(options.time) <= options.signal_seconds:
        raise BadInputError(
            f"--time {options.time} leaves no time before the SIGUSR1 sent {options.signal_seconds}s before it"
        )
    for name in ("partition", "account", "job_name"):
        value = getattr(options, name)
        if value is not None and not _NAME.match(value):
            raise BadInputError(f"--{name} {value!r}: letters, digits and . _ + - only")
    for option in options.sbatch_option:
        if not option.startswith("--") or any(char in option for char in "\n;`$"):
            raise BadInputError(f"--sbatch_option {option!r}: give one sbatch option, e.g. --sbatch_option=--mem=64G")
    for line in options.setup:
        if not line.strip() or "\n" in line:
            raise BadInputError(f"--setup {line!r}: give one non-empty shell line per --setup")
    if options.python is not None:
        try:
            words = shlex.split(options.python)
        except ValueError as error:
            raise BadInputError(f"--python {options.python!r}: {error}") from None
        if not words or "\n" in options.python:
            raise BadInputError(f"--python {options.python!r}: give an interpreter, e.g. --python python")


def slurm_job(options: argparse.Namespace, trainer: dict[str, Any], default_name: str) -> SlurmJob:
    """Check the sbatch flags against each other and the config's trainer section; raise BadInputError."""
    check_slurm_flags(options)
    accelerator = trainer.get("accelerator")
    on_cpu = accelerator == "cpu"
    if options.nodes is None or options.gpus_per_node is None:
        raise BadInputError(
            "a SLURM script needs --nodes N (nodes) and --gpus_per_node G (GPUs per node, one task each, "
            f"= trainer.devices; 0 with --cpu_workers N for a CPU job), e.g. {_example_allocation(trainer)}"
        )
    if options.gpus_per_node and on_cpu:
        count = options.gpus_per_node
        raise BadInputError(
            f"--gpus_per_node {count} asks SLURM for GPUs, but trainer.accelerator is cpu in the config: they would "
            f"sit idle. For a CPU job give --gpus_per_node 0 --cpu_workers {count}; to train on the GPUs, "
            f"--trainer.accelerator=gpu; to ask for GPUs anyway, --sbatch_option=--gpus-per-node={count}"
        )
    if options.gpus_per_node == 0 and accelerator not in (None, "auto", "cpu"):
        raise BadInputError(
            f"--gpus_per_node 0 is a CPU job (no GPU requested), but trainer.accelerator is {accelerator}; "
            "give --gpus_per_node G, or set --trainer.accelerator=cpu"
        )
    flag = "--gpus_per_node" if options.gpus_per_node else "--cpu_workers"
    check_task_count(trainer, options.nodes, options.gpus_per_node or options.cpu_workers, flag)
    return SlurmJob(
        nodes=options.nodes,
        gpus_per_node=options.gpus_per_node,
        cpu_workers=options.cpu_workers,
        job_name=options.job_name or default_name,
        time=options.time,
        partition=options.partition,
        account=options.account,
        cpus_per_task=options.cpus_per_task,
        signal_seconds=options.signal_seconds,
        extra_directives=tuple(options.sbatch_option),
        setup=tuple(options.setup),
        python=options.python or sys.executable,
        workdir=Path(options.workdir) if options.workdir else None,
        error_log=options.error_log,
    )


def _example_allocation(trainer: dict[str, Any]) -> str:
    """The flags that match the config's placement, for the message that asks for them."""
    nodes = _as_count(trainer.get("num_nodes")) or 1
    devices = _as_count(trainer.get("devices"))
    if trainer.get("accelerator") == "cpu":
        return f"--nodes {nodes} --gpus_per_node 0 --cpu_workers {devices or 1} (this config trains on the CPU)"
    return f"--nodes {nodes} --gpus_per_node {devices or 8}" + ("" if devices else " (8 GPUs per node)")


def requeue_exit_code(config: dict[str, Any]) -> int:
    """The exit status FaultTolerantCheckpoint uses after a signal-triggered save, from the config."""
    return int(configured(config.get("checkpoint"), "preemption.exit_code", exit_codes.REQUEUE))


def write_script(path: Path, text: str) -> None:
    """Write an executable script, creating its folder (callers have checked ``path`` with ``check_output``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def _parser() -> argparse.ArgumentParser:
    parser = ToolArgumentParser(
        prog="python -m lightning_mlopt slurm",
        description="Write an sbatch script for `fit`. Other arguments (e.g. --trainer.max_steps=1000) go to fit.",
    )
    parser.add_argument("--config", "-c", action="append", required=True, help="config file(s), in order")
    add_slurm_arguments(parser)
    parser.add_argument("--output", default=None, help="script path; default: <run_dir>/job.sbatch")
    return parser


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m lightning_mlopt slurm``; returns the exit status (2 on bad input)."""
    from lightning_mlopt.cli.check import check_arguments

    options, extra = _parser().parse_known_args(list(argv))
    fit_args = fit_arguments(options.config, extra)
    stems = "-".join(Path(path).stem for path in options.config)
    try:
        check_slurm_flags(options)  # the flags alone first: cheap, before parsing the config
        config = check_arguments(fit_args).as_dict()
        job = slurm_job(options, config.get("trainer") or {}, stems)
        trainer = config.get("trainer") or {}
        resolved = {**config, "trainer": {**trainer, "num_nodes": job.nodes, "devices": job.tasks_per_node}}
        run_dir = resolve_run_dir(resolved, config_paths(fit_args)).resolve()
        target = Path(options.output) if options.output else run_dir / SBATCH_NAME
        check_output(target, "--output", SBATCH_NAME)  # before the run directory is made
    except BadInputError as error:
        return bad_input(error)
    command = job.command(
        "fit",
        *without_options(fit_args, ["--run_dir"]),  # the script names it explicitly
        *job.trainer_arguments(),
        f"--run_dir={run_dir}",
    )
    run_dir.mkdir(parents=True, exist_ok=True)  # SLURM opens the --output file there before the job starts
    script = sbatch_script(command, run_dir, job, requeue_exit_code=requeue_exit_code(config), script_path=target)
    write_script(target, script)
    placement = f"{job.gpus_per_node} GPU(s)" if job.gpus_per_node else f"{job.cpu_workers} CPU task(s)"
    print(f"Wrote {target} ({job.nodes} node(s) x {placement}). Submit with: sbatch {target}")
    print(f"Run directory: {run_dir} (checkpoints, logs, slurm-<job id>.out)")
    return 0
