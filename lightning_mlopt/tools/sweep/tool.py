"""``python -m lightning_mlopt sweep``: the command line, and the SLURM job array (one task per trial)."""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mlopt.commands import command_line
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.tools._preamble import ToolArgumentParser, bad_input, fit_arguments, without_options
from lightning_mlopt.tools.slurm import add_slurm_arguments
from lightning_mlopt.tools.sweep.results import collect_results, results_table, write_results
from lightning_mlopt.tools.sweep.runner import run_local
from lightning_mlopt.tools.sweep.spec import (
    SweepSpec,
    Trial,
    check_trials,
    load_sweep,
    local_trials,
)
from lightning_mlopt.tools.sweep.wandb_agent import run_wandb, wandb_sweep_config


def write_slurm_array(
    argv: Sequence[str],
    options: argparse.Namespace,
    base_args: Sequence[str],
    trials: Sequence[Trial],
    sweep_dir: Path,
) -> Path:
    """Write an sbatch job array with one task per trial (``--max_parallel`` at a time).

    Each array task runs this sweep with ``--trial $SLURM_ARRAY_TASK_ID`` on ``--nodes`` x ``--gpus_per_node``
    tasks; a trial saved after a signal is requeued as its own array task and resumes.
    """
    from lightning_mlopt.cli import check_arguments
    from lightning_mlopt.tools.slurm import requeue_exit_code, sbatch_script, slurm_job, write_script

    config = check_arguments(base_args).as_dict()
    job = slurm_job(options, config.get("trainer") or {}, f"sweep-{sweep_dir.name}")
    command = command_line(
        "sweep",
        *without_options(argv, _SLURM_ONLY_FLAGS, flags=_FLAGS_WITHOUT_VALUE),
        f"--sweep_dir={sweep_dir.resolve()}",
        "--trial=$SLURM_ARRAY_TASK_ID",
        *job.trainer_arguments(),
    )
    array = f"0-{len(trials) - 1}" + (f"%{options.max_parallel}" if options.max_parallel else "")
    path = sweep_dir / "sweep.sbatch"
    sweep_dir.mkdir(parents=True, exist_ok=True)
    script = sbatch_script(
        command, sweep_dir, job, requeue_exit_code=requeue_exit_code(config), array=array, script_path=path
    )
    write_script(path, script)
    return path


# Flags of `sweep` that describe the SLURM array itself, not what each array task runs.
_SLURM_ONLY_FLAGS = (
    "--slurm",
    "--nodes",
    "--gpus_per_node",
    "--partition",
    "--time",
    "--account",
    "--job_name",
    "--cpus_per_task",
    "--signal_seconds",
    "--max_parallel",
    "--sweep_dir",
    "--dry_run",
)
_FLAGS_WITHOUT_VALUE = ("--slurm", "--dry_run")


# ---------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = ToolArgumentParser(
        prog="python -m lightning_mlopt sweep",
        description="Hyperparameter sweeps over `fit`. Arguments not listed here (e.g. --trainer.max_epochs=3) "
        "go to every trial.",
    )
    parser.add_argument("--config", "-c", action="append", required=True, help="base config file(s), in order")
    parser.add_argument("--sweep", required=True, help="sweep file (W&B format, dotted parameter keys)")
    parser.add_argument("--mode", choices=["local", "wandb"], default="local")
    parser.add_argument("--count", type=int, default=None, help="trials to run (random: required unless run_cap)")
    parser.add_argument("--seed", type=int, default=0, help="seed of local random search")
    parser.add_argument("--sweep_dir", default=None, help="default: runs/sweeps/<sweep file stem>-<hash>")
    parser.add_argument("--project", default="lightning_mlopt", help="W&B project (--mode wandb)")
    parser.add_argument("--entity", default=None, help="W&B entity (--mode wandb)")
    parser.add_argument("--dry_run", action="store_true", help="check and print the trials; run nothing")
    parser.add_argument("--trial", type=int, default=None, help="run only trial K (0-based), e.g. in a job array")
    parser.add_argument("--results", action="store_true", help="print the results table from disk; run nothing")
    slurm = parser.add_argument_group("SLURM job array (--slurm): one array task per trial")
    slurm.add_argument("--slurm", action="store_true", help="write <sweep_dir>/sweep.sbatch instead of running")
    slurm.add_argument("--max_parallel", type=int, default=None, help="array tasks running at once")
    add_slurm_arguments(slurm, required=False)  # type: ignore[arg-type]
    return parser


def _default_sweep_dir(sweep_path: str, base_args: Sequence[str], spec: SweepSpec) -> Path:
    payload = json.dumps({"base": list(base_args), "sweep": spec.raw}, sort_keys=True, default=str)
    return Path("runs") / "sweeps" / f"{Path(sweep_path).stem}-{hashlib.sha256(payload.encode()).hexdigest()[:8]}"


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m lightning_mlopt sweep``; returns the exit status (2 on bad input)."""
    options, extra = _parser().parse_known_args(list(argv))
    base_args = fit_arguments(options.config, extra)
    try:
        spec = load_sweep(options.sweep)
        if options.count is not None and options.count < 1:
            raise BadInputError(f"--count must be >= 1, got {options.count}")
        # W&B draws its own trials; the keys and their bounds are still checked below.
        trials = local_trials(spec, options.count, options.seed) if options.mode == "local" else []
        if options.trial is not None and not 0 <= options.trial < len(trials):
            raise BadInputError(f"--trial {options.trial}: this sweep has trials 0..{len(trials) - 1}")
        if (options.slurm or options.trial is not None) and options.mode != "local":
            raise BadInputError("--slurm and --trial run trials of a local-mode sweep; drop --mode wandb")
        # Every rank of an array task runs this check too: it is cheap, and a bad argument stops all of them.
        check_trials(base_args, spec, trials)
        sweep_dir = Path(options.sweep_dir) if options.sweep_dir else _default_sweep_dir(options.sweep, base_args, spec)
        if options.dry_run:
            shown: Any = wandb_sweep_config(spec, base_args, sweep_dir) if options.mode == "wandb" else trials
            print(json.dumps(shown, indent=2, default=str))
            return 0
        if options.mode == "wandb":
            return run_wandb(spec, base_args, sweep_dir, options)
        if options.slurm:
            path = write_slurm_array(argv, options, base_args, trials, sweep_dir)
            print(f"Wrote {path}: a job array of {len(trials)} trials. Submit with: sbatch {path}")
            print(f"Results so far: python -m lightning_mlopt sweep <same arguments> --sweep_dir={sweep_dir} --results")
            return 0
    except BadInputError as error:
        return bad_input(error)
    if options.results:
        results = collect_results(spec, trials, sweep_dir)
        print(results_table(results, spec))
        print(f"Results: {write_results(results, spec, sweep_dir)}")
        return 0
    if options.trial is not None:
        (result,) = run_local(base_args, spec, trials, sweep_dir, only=options.trial)
        return result.exit_code  # 75 after a signal-triggered save: the script requeues the array task
    print(f"Sweep of {len(trials)} trials in {sweep_dir}, ranked by {spec.metric} ({spec.goal})", flush=True)
    results = run_local(base_args, spec, trials, sweep_dir)
    print(results_table(results, spec))
    print(f"Results: {write_results(results, spec, sweep_dir)}")
    return 0 if all(r.metric is not None for r in results) else 1
