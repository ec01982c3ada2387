"""``python -m lightning_mlopt slurm --config FILE --nodes N --gpus_per_node G``: write an sbatch script.

The script runs ``srun python -m lightning_mlopt fit ...`` with one task per device (Lightning's
SLURMEnvironment reads the ranks from SLURM), asks SLURM for SIGUSR1 ``--signal_seconds`` before the time
limit, and requeues itself when the job saved and exited with FaultTolerantCheckpoint's status (75) after
SIGUSR1 or SIGTERM; the requeued job runs the same command in the same run directory and resumes. The task
count is checked twice: here against the config's ``trainer.devices``/``trainer.num_nodes``, and in the
script against the allocation SLURM actually gave.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_mlopt._bad_input import config_paths
from lightning_mlopt.commands import command_line
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.process import exit_codes
from lightning_mlopt.process.grace import GRACE_ENV
from lightning_mlopt.run_dir import SBATCH_NAME, resolve_run_dir
from lightning_mlopt.tools._preamble import ToolArgumentParser, bad_input, fit_arguments, without_options

_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?$")
_NAME = re.compile(r"^[\w.+-]+$")
SLURM_KILL_WAIT_S = 30  # slurm.conf KillWait's default: SIGTERM to SIGKILL when a job is cancelled or preempted


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


def check_task_count(trainer: dict[str, Any], nodes: int, gpus_per_node: int) -> None:
    """Srun starts ``gpus_per_node`` tasks per node and Lightning needs one per device: they must agree.

    Raises:
        BadInputError: naming both numbers and the fix.

    """
    devices = _as_count(trainer.get("devices"))
    if devices is not None and devices != gpus_per_node:
        raise BadInputError(
            f"trainer.devices is {devices} in the config but --gpus_per_node is {gpus_per_node}: the script starts "
            f"one task per device ({nodes} x {gpus_per_node} = {nodes * gpus_per_node} tasks), and Lightning needs "
            f"them equal; set trainer.devices: {gpus_per_node} (or auto) or --gpus_per_node {devices}"
        )
    num_nodes = _as_count(trainer.get("num_nodes"))
    if num_nodes not in (None, 1, nodes):
        raise BadInputError(f"trainer.num_nodes is {num_nodes} in the config but --nodes is {nodes}; make them equal")


@dataclass(frozen=True)
class SlurmJob:
    """What the sbatch directives ask for (``add_slurm_arguments`` defines the flags).

    Example::

        job = SlurmJob(nodes=2, gpus_per_node=8, time="1-00:00:00", partition="a100")
        script = sbatch_script(["python", "-m", "lightning_mlopt", "fit", "--config", "gpt.yaml"], run_dir, job)

    """

    nodes: int
    gpus_per_node: int
    gpus: bool = True  # False for trainer.accelerator: cpu (no GPU request)
    job_name: str = "lightning_mlopt"
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    signal_seconds: int = 120
    extra_directives: tuple[str, ...] = ()  # e.g. ("--mem=64G", "--constraint=a100"), from --sbatch_option

    @property
    def tasks(self) -> int:
        """One task per device over all nodes."""
        return self.nodes * self.gpus_per_node

    def trainer_arguments(self) -> list[str]:
        """The Trainer's placement for this allocation, appended to every command the script runs."""
        return [f"--trainer.num_nodes={self.nodes}", f"--trainer.devices={self.gpus_per_node}"]


def sbatch_script(
    command: Sequence[str],
    log_dir: Path,
    job: SlurmJob,
    *,
    requeue_exit_code: int = exit_codes.REQUEUE,
    array: str | None = None,
    workdir: Path | None = None,
    script_path: Path | None = None,
) -> str:
    """The text of an sbatch script that runs ``command`` under ``srun`` on ``job.tasks`` tasks.

    With ``array`` (e.g. ``0-23%4``) it is a job array: ``$SLURM_ARRAY_TASK_ID`` may appear in ``command``,
    and a requeue targets the one array task.
    """
    log_dir = log_dir.resolve()
    directives = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={job.gpus_per_node}",
        *([f"--gpus-per-node={job.gpus_per_node}"] if job.gpus else []),
        *([f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else []),
        *([f"--time={job.time}"] if job.time else []),
        *([f"--partition={job.partition}"] if job.partition else []),
        *([f"--account={job.account}"] if job.account else []),
        *([f"--array={array}"] if array else []),
        f"--signal=USR1@{job.signal_seconds}",
        "--requeue",
        "--open-mode=append",
        f"--output={log_dir}/slurm-{'%A_%a' if array else '%j'}.out",
        *job.extra_directives,
    ]
    quoted = " ".join(arg if "$SLURM_ARRAY_TASK_ID" in arg else shlex.quote(arg) for arg in command)
    where = script_path or log_dir / SBATCH_NAME
    lines = [
        "#!/bin/bash",
        "# Written by lightning_mlopt; submit with: sbatch " + shlex.quote(str(where)),
        *[f"#SBATCH {directive}" for directive in directives],
        "",
        "# SLURM sends SIGUSR1 to every task --signal seconds before the time limit (and SIGTERM on preemption):",
        f"# FaultTolerantCheckpoint saves, every rank exits {requeue_exit_code}, and this script requeues the job,",
        "# which resumes from that checkpoint in the same run directory.",
        "set -uo pipefail",
        "# This shell must outlive the signals meant for the tasks: `scancel --signal=USR1 --full` and a",
        "# preemption SIGTERM reach it too, and bash's default action would end the job FAILED before the",
        "# tasks have saved. Each is passed on to the job step, and the shell goes on waiting for it.",
        'srun_pid=""',
        "forward() {",
        '  echo "batch shell: SIG$1 received; passing it to the job step"',
        '  if [ -n "$srun_pid" ]; then kill -s "$1" "$srun_pid" 2>/dev/null; fi',
        "}",
        *[f"trap 'forward {name}' {name}" for name in ("TERM", "USR1", "USR2", "INT")],
        f"cd {shlex.quote(str((workdir or Path.cwd()).resolve()))}",
        "export PYTHONUNBUFFERED=1",
        "# The time from each signal to the kill: SIGUSR1 comes --signal seconds before the time limit; a",
        "# preemption or scancel SIGTERM is followed by SIGKILL after KillWait (30 s, SLURM's default). A signal",
        "# save that would not end in time is not started.",
        f"export {GRACE_ENV}=SIGUSR1={job.signal_seconds},SIGTERM={SLURM_KILL_WAIT_S}",
        f'if [ "${{SLURM_NTASKS:-{job.tasks}}}" != "{job.tasks}" ]; then',
        f'  echo "error: SLURM allocated $SLURM_NTASKS tasks but the run needs {job.nodes} x {job.gpus_per_node} = '
        f'{job.tasks} (one per device); resubmit with matching --nodes/--ntasks-per-node" >&2',
        "  exit 2",
        "fi",
        # An array task is requeued as <array job>_<task>, a plain job by its id.
        'job="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"',
        'job="${job:-$SLURM_JOB_ID}"',
        f'echo "job $job (restart ${{SLURM_RESTART_COUNT:-0}}): {job.nodes} node(s) x {job.gpus_per_node} tasks, '
        f'logs in {log_dir}"',
        "srun " + (f"--cpus-per-task={job.cpus_per_task} " if job.cpus_per_task else "") + quoted + " &",
        "srun_pid=$!",
        "while :; do",
        '  wait "$srun_pid"; status=$?',
        '  kill -0 "$srun_pid" 2>/dev/null || break  # still running: a trapped signal interrupted the wait',
        "done",
        "# A signal that interrupted the wait as the step ended left its status unread: read it.",
        'if [ "$status" -gt 128 ]; then',
        '  wait "$srun_pid" 2>/dev/null; again=$?',
        '  if [ "$again" -ne 127 ]; then status=$again; fi',
        "fi",
        f'if [ "$status" -eq {requeue_exit_code} ]; then',
        '  echo "checkpoint saved after a signal; requeueing job $job"',
        '  scontrol requeue "$job"',
        "fi",
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def add_slurm_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """The sbatch flags shared by ``slurm`` and ``sweep --slurm``."""
    parser.add_argument("--nodes", type=int, required=required, default=None)
    parser.add_argument("--gpus_per_node", type=int, required=required, default=None, help="devices (= tasks) per node")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--time", default=None, help="time limit, e.g. 04:00:00 or 1-12:00:00")
    parser.add_argument("--account", default=None)
    parser.add_argument("--job_name", default=None, help="default: the config file stems")
    parser.add_argument("--cpus_per_task", type=int, default=None)
    parser.add_argument("--signal_seconds", type=int, default=120, help="SIGUSR1 this long before the time limit")
    parser.add_argument(
        "--sbatch_option",
        action="append",
        default=[],
        metavar="OPTION",
        help="an extra #SBATCH line, in the = form: --sbatch_option=--mem=64G (repeatable)",
    )


def slurm_job(options: argparse.Namespace, trainer: dict[str, Any], default_name: str) -> SlurmJob:
    """Check the sbatch flags against each other and the config's trainer section; raise BadInputError."""
    if options.nodes is None or options.gpus_per_node is None:
        raise BadInputError("--nodes and --gpus_per_node are required for a SLURM script")
    if options.nodes < 1 or options.gpus_per_node < 1:
        raise BadInputError("--nodes and --gpus_per_node must be >= 1")
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
    extra = tuple(getattr(options, "sbatch_option", None) or ())
    for option in extra:
        if not option.startswith("--") or any(char in option for char in "\n;`$"):
            raise BadInputError(f"--sbatch_option {option!r}: give one sbatch option, e.g. --sbatch_option=--mem=64G")
    check_task_count(trainer, options.nodes, options.gpus_per_node)
    return SlurmJob(
        nodes=options.nodes,
        gpus_per_node=options.gpus_per_node,
        gpus=trainer.get("accelerator") != "cpu",
        job_name=options.job_name or default_name,
        time=options.time,
        partition=options.partition,
        account=options.account,
        cpus_per_task=options.cpus_per_task,
        signal_seconds=options.signal_seconds,
        extra_directives=extra,
    )


def requeue_exit_code(config: dict[str, Any]) -> int:
    """The exit status FaultTolerantCheckpoint uses after a signal-triggered save, from the config."""
    return int((config.get("checkpoint") or {}).get("exit_code") or exit_codes.REQUEUE)


def write_script(path: Path, text: str) -> None:
    """Write an executable script, creating its folder."""
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
    from lightning_mlopt.cli import check_arguments

    options, extra = _parser().parse_known_args(list(argv))
    fit_args = fit_arguments(options.config, extra)
    stems = "-".join(Path(path).stem for path in options.config)
    try:
        slurm_job(options, {}, stems)  # the flags alone first: cheap, before parsing the config
        config = check_arguments(fit_args).as_dict()
        job = slurm_job(options, config.get("trainer") or {}, stems)
    except BadInputError as error:
        return bad_input(error)
    trainer = config.get("trainer") or {}
    resolved = {**config, "trainer": {**trainer, "num_nodes": job.nodes, "devices": job.gpus_per_node}}
    run_dir = resolve_run_dir(resolved, config_paths(fit_args)).resolve()
    command = command_line(
        "fit",
        *without_options(fit_args, ["--run_dir"]),  # the script names it explicitly
        *job.trainer_arguments(),
        f"--run_dir={run_dir}",
    )
    target = Path(options.output) if options.output else run_dir / SBATCH_NAME
    run_dir.mkdir(parents=True, exist_ok=True)  # SLURM opens the --output file there before the job starts
    script = sbatch_script(command, run_dir, job, requeue_exit_code=requeue_exit_code(config), script_path=target)
    write_script(target, script)
    print(f"Wrote {target} ({job.nodes} node(s) x {job.gpus_per_node} tasks). Submit with: sbatch {target}")
    print(f"Run directory: {run_dir} (checkpoints, logs, slurm-<job id>.out)")
    return 0
