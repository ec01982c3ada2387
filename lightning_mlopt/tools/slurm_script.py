"""The sbatch script that ``slurm`` and ``sweep --slurm`` write: what it asks SLURM for, and how it runs the job.

The script traps the signals meant for the job step and passes them on, runs the set-up lines, checks the
allocation, starts ``srun``, and requeues the job when the step saved after a signal (exit 75). The flags that
fill :class:`SlurmJob` are in ``slurm.py``.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_mlopt.cli.commands import command_line
from lightning_mlopt.process import exit_codes
from lightning_mlopt.process.grace import GRACE_ENV
from lightning_mlopt.run_dir import SBATCH_NAME
from lightning_mlopt.tools._preamble import WRITTEN_BY

SLURM_KILL_WAIT_S = 30  # slurm.conf KillWait's default: SIGTERM to SIGKILL when a job is cancelled or preempted


@dataclass(frozen=True)
class SlurmJob:
    """What the sbatch script asks for and how it starts (``add_slurm_arguments`` defines the flags).

    Attributes:
        nodes: nodes of the allocation.
        gpus_per_node: GPUs per node, one task each (``#SBATCH --gpus-per-node``); 0: a CPU job of
            ``cpu_workers`` tasks per node, with no GPU request.
        cpu_workers: tasks per node of a CPU job (``gpus_per_node`` 0).
        job_name, time, partition, account, cpus_per_task: the sbatch options of the same names.
        signal_seconds: SIGUSR1 this long before the time limit (the save's head start).
        extra_directives: more ``#SBATCH`` lines, e.g. ``("--mem=64G", "--constraint=a100")`` (sbatch only:
            never passed to ``srun``).
        setup: shell lines run in the batch shell before the job step (``module load cuda/12.4``,
            ``conda activate mlopt``); the step inherits the environment they make.
        python: the interpreter the job step runs (default: the one writing the script, by absolute path), or
            a command that starts one, split as the shell would: ``apptainer exec --nv image.sif python``.
        workdir: the folder the job changes to before anything else (default: the one writing the script).
        error_log: stderr to ``slurm-<job id>.err`` beside the ``.out`` (default: both in the ``.out``).

    Example::

        job = SlurmJob(nodes=2, gpus_per_node=8, time="1-00:00:00", setup=("module load cuda/12.4",))
        script = sbatch_script(job.command("fit", "--config", "gpt.yaml"), run_dir, job)

    """

    nodes: int
    gpus_per_node: int
    cpu_workers: int = 1
    job_name: str = "lightning_mlopt"
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    signal_seconds: int = 120
    extra_directives: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()
    python: str = field(default_factory=lambda: sys.executable)
    workdir: Path | None = None
    error_log: bool = False

    @property
    def tasks_per_node(self) -> int:
        """One task per GPU, or ``cpu_workers`` tasks on a CPU job."""
        return self.gpus_per_node or self.cpu_workers

    @property
    def tasks(self) -> int:
        """One task per device over all nodes."""
        return self.nodes * self.tasks_per_node

    def trainer_arguments(self) -> list[str]:
        """The Trainer's placement for this allocation, appended to every command the script runs."""
        return [f"--trainer.num_nodes={self.nodes}", f"--trainer.devices={self.tasks_per_node}"]

    def command(self, subcommand: str, *args: str) -> list[str]:
        """``<python> -m lightning_mlopt SUBCOMMAND ARGS...``, with this job's interpreter."""
        return [*shlex.split(self.python), *command_line(subcommand, *args)[1:]]


def sbatch_script(
    command: Sequence[str],
    log_dir: Path,
    job: SlurmJob,
    *,
    requeue_exit_code: int = exit_codes.REQUEUE,
    array: str | None = None,
    script_path: Path | None = None,
) -> str:
    """The text of an sbatch script that runs ``command`` under ``srun`` on ``job.tasks`` tasks.

    With ``array`` (e.g. ``0-23%4``) it is a job array: ``$SLURM_ARRAY_TASK_ID`` may appear in ``command``,
    and a requeue targets the one array task.
    """
    log_dir = log_dir.resolve()
    log_name = f"slurm-{'%A_%a' if array else '%j'}"
    directives = [
        f"--job-name={job.job_name}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={job.tasks_per_node}",
        *([f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []),
        *([f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else []),
        *([f"--time={job.time}"] if job.time else []),
        *([f"--partition={job.partition}"] if job.partition else []),
        *([f"--account={job.account}"] if job.account else []),
        *([f"--array={array}"] if array else []),
        f"--signal=USR1@{job.signal_seconds}",
        "--requeue",
        "--open-mode=append",
        f"--output={log_dir}/{log_name}.out",
        *([f"--error={log_dir}/{log_name}.err"] if job.error_log else []),
        *job.extra_directives,
    ]
    quoted = " ".join(arg if "$SLURM_ARRAY_TASK_ID" in arg else shlex.quote(arg) for arg in command)
    where = script_path or log_dir / SBATCH_NAME
    workdir = (job.workdir or Path.cwd()).resolve()
    written_by = " (the one that wrote this script)" if job.python == sys.executable else ""
    lines = [
        "#!/bin/bash",
        f"{WRITTEN_BY}; submit with: sbatch {shlex.quote(str(where))}",  # a rerun may replace this file
        *[f"#SBATCH {directive}" for directive in directives],
        "",
        "# Where it runs: the job changes to this folder and starts this interpreter, by these paths, on the",
        "# compute nodes. Right on a filesystem the nodes share; otherwise give --workdir and --python (e.g.",
        "# --python python, with a `conda activate` in --setup; or a container's: --python 'apptainer exec",
        "# image.sif python').",
        f"#   working directory  {workdir}",
        f"#   interpreter        {job.python}{written_by}",
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
        f"cd {shlex.quote(str(workdir))}",
        *_setup_lines(job.setup),
        "export PYTHONUNBUFFERED=1",
        "# The time from each signal to the kill: SIGUSR1 comes --signal seconds before the time limit; a",
        "# preemption or scancel SIGTERM is followed by SIGKILL after KillWait (30 s, SLURM's default). A signal",
        "# save that would not end in time is not started.",
        f"export {GRACE_ENV}=SIGUSR1={job.signal_seconds},SIGTERM={SLURM_KILL_WAIT_S}",
        f'if [ "${{SLURM_NTASKS:-{job.tasks}}}" != "{job.tasks}" ]; then',
        f'  echo "error: SLURM allocated $SLURM_NTASKS tasks but the run needs {job.nodes} x {job.tasks_per_node} = '
        f'{job.tasks} (one per device); resubmit with matching --nodes/--ntasks-per-node" >&2',
        "  exit 2",
        "fi",
        # An array task is requeued as <array job>_<task>, a plain job by its id.
        'job="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"',
        'job="${job:-$SLURM_JOB_ID}"',
        f'echo "job $job (restart ${{SLURM_RESTART_COUNT:-0}}): {job.nodes} node(s) x {job.tasks_per_node} tasks, '
        f'logs in {log_dir}"',
        # Only what srun does not inherit from the allocation goes on its line (--cpus-per-task, since SLURM
        # 22.05); the #SBATCH options above (--mem, --constraint, ...) are the allocation's, never repeated here.
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


def _setup_lines(setup: Sequence[str]) -> list[str]:
    """The ``--setup`` lines, each stopping the job (exit 2, naming the line) when it fails.

    ``set -u`` is off around them: activation scripts (conda's, Lmod's) read variables that may be unset.
    The closing brace is on a line of its own, so a line ending in a ``# comment`` still has its check.
    """
    if not setup:
        return []
    lines = ["# Set-up (--setup): runs in this shell, so the job step (srun) inherits what it sets.", "set +u"]
    for line in setup:
        said = f'echo "error: the set-up line failed (exit $status): "{shlex.quote(line)} >&2'
        lines += [f"{{ {line}", f"}} || {{ status=$?; {said}; exit 2; }}"]
    return [*lines, "set -u"]
