"""``python -m lightning_mlopt sweep``: the command line, and the SLURM job array (one task per trial)."""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.process import exit_codes
from lightning_mlopt.run_dir import SBATCH_NAME
from lightning_mlopt.tools._preamble import ToolArgumentParser, bad_input, check_output, fit_arguments, without_options
from lightning_mlopt.tools.slurm import add_slurm_arguments, check_slurm_flags, write_script
from lightning_mlopt.tools.sweep.probe import probe_metrics
from lightning_mlopt.tools.sweep.results import (
    collect_results,
    logged_metrics,
    metric_not_logged,
    read_metric,
    results_table,
    trial_name,
    write_results,
)
from lightning_mlopt.tools.sweep.runner import run_local
from lightning_mlopt.tools.sweep.spec import (
    SweepSpec,
    Trial,
    check_trials,
    load_sweep,
    local_trials,
)
from lightning_mlopt.tools.sweep.wandb_agent import run_wandb, wandb_sweep_config

# Flags of `sweep` that describe the SLURM array itself, not what each array task runs (with the sbatch flags
# that add_slurm_arguments defines, which _array_only_options() adds to these).
_ARRAY_ONLY = ["--slurm", "--max_parallel", "--sweep_dir", "--dry_run", "--probe", "--no_probe"]
_ARRAY_ONLY_FLAGS = ["--slurm", "--dry_run", "--probe", "--no_probe"]


def slurm_array(
    argv: Sequence[str],
    options: argparse.Namespace,
    base_args: Sequence[str],
    trials: Sequence[Trial],
    sweep_dir: Path,
) -> tuple[Path, str]:
    """The sbatch job array with one task per trial (``--max_parallel`` at a time): its path and text.

    Each array task runs this sweep with ``--trial $SLURM_ARRAY_TASK_ID`` on ``--nodes`` x ``--gpus_per_node``
    tasks; a trial saved after a signal is requeued as its own array task and resumes. The sbatch flags stay in
    the ``#SBATCH`` lines and out of the command each task runs.
    """
    from lightning_mlopt.cli.check import check_arguments
    from lightning_mlopt.tools.slurm import requeue_exit_code, sbatch_script, slurm_job

    config = check_arguments(base_args).as_dict()
    job = slurm_job(options, config.get("trainer") or {}, f"sweep-{sweep_dir.name}")
    names, flags = _array_only_options()
    command = job.command(
        "sweep",
        *without_options(argv, names, flags=flags),
        f"--sweep_dir={sweep_dir.resolve()}",
        "--trial=$SLURM_ARRAY_TASK_ID",
        *job.trainer_arguments(),
    )
    array = f"0-{len(trials) - 1}" + (f"%{options.max_parallel}" if options.max_parallel else "")
    path = sweep_dir / "sweep.sbatch"
    return path, sbatch_script(
        command, sweep_dir, job, requeue_exit_code=requeue_exit_code(config), array=array, script_path=path
    )


def _array_only_options() -> tuple[list[str], list[str]]:
    """Every option of the array itself (sbatch flags included), and those of them that take no value."""
    _, slurm_names, slurm_flags = _build_parser()
    return [*_ARRAY_ONLY, *slurm_names], [*_ARRAY_ONLY_FLAGS, *slurm_flags]


# ---------------------------------------------------------------------- command line


def _build_parser() -> tuple[argparse.ArgumentParser, list[str], list[str]]:
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
    parser.add_argument("--dry_run", action="store_true", help="check and print the trials (and script); run none")
    parser.add_argument("--trial", type=int, default=None, help="run only trial K (0-based), e.g. in a job array")
    parser.add_argument("--results", action="store_true", help="print the results table from disk; run nothing")
    parser.add_argument(
        "--probe",
        dest="probe",
        action="store_true",
        default=None,
        help="check metric.name with a two-batch fit of trial 0 before any trial (default: on, but for --slurm)",
    )
    parser.add_argument("--no_probe", dest="probe", action="store_false", help="skip that check")
    slurm = parser.add_argument_group(
        "SLURM job array (--slurm): one array task per trial; needs --nodes and --gpus_per_node"
    )
    slurm.add_argument("--slurm", action="store_true", help="write <sweep_dir>/sweep.sbatch instead of running")
    slurm.add_argument("--max_parallel", type=int, default=None, help="array tasks running at once")
    names, flags = add_slurm_arguments(slurm)  # type: ignore[arg-type]
    return parser, names, flags


def _default_sweep_dir(sweep_path: str, base_args: Sequence[str], spec: SweepSpec) -> Path:
    payload = json.dumps({"base": list(base_args), "sweep": spec.raw}, sort_keys=True, default=str)
    return Path("runs") / "sweeps" / f"{Path(sweep_path).stem}-{hashlib.sha256(payload.encode()).hexdigest()[:8]}"


def main(argv: Sequence[str]) -> int:
    """Entry point of ``python -m lightning_mlopt sweep``; returns the exit status (2 on bad input)."""
    options, extra = _build_parser()[0].parse_known_args(list(argv))
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
        if options.slurm:
            check_slurm_flags(options)
        # Every rank of an array task runs this check too: it is cheap, and a bad argument stops all of them.
        check_trials(base_args, spec, trials)
        sweep_dir = Path(options.sweep_dir) if options.sweep_dir else _default_sweep_dir(options.sweep, base_args, spec)
        if options.results and not sweep_dir.is_dir():
            raise BadInputError(
                f"--results: no sweep folder {sweep_dir}; give --sweep_dir the folder the sweep ran in (its start "
                "line named it), with the same --config and --sweep"
            )
        # The array's script is made (its flags checked against the config) before anything runs.
        script = slurm_array(argv, options, base_args, trials, sweep_dir) if options.slurm else None
        if script is not None:  # before the sweep folder is made: a file of the user's there stops it first
            check_output(script[0], "--sweep_dir", SBATCH_NAME)
        status = _check_metric(options, base_args, spec, trials or [{}], sweep_dir)
        if status is not None:
            return status
        if options.dry_run:
            shown: Any = wandb_sweep_config(spec, base_args, sweep_dir) if options.mode == "wandb" else trials
            print(json.dumps(shown, indent=2, default=str))
            if script is not None:
                path, text = script
                print(f"\n{text}\nDry run: {path} not written (without --dry_run, the script above is written there)")
            return 0
        if options.mode == "wandb":
            return run_wandb(spec, base_args, sweep_dir, options)
        if script is not None:
            path, text = script
            sweep_dir.mkdir(parents=True, exist_ok=True)  # SLURM opens the --output files there before a task
            write_script(path, text)
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
        if result.status == "no metric":
            return _metric_missing(spec, sweep_dir / result.name, result.name)
        return result.exit_code  # 75 after a signal-triggered save: the script requeues the array task
    print(f"Sweep of {len(trials)} trials in {sweep_dir}, ranked by {spec.metric} ({spec.goal})", flush=True)
    results = run_local(base_args, spec, trials, sweep_dir)
    print(results_table(results, spec))
    print(f"Results: {write_results(results, spec, sweep_dir)}")
    if results and results[-1].status == "no metric":
        return _metric_missing(spec, sweep_dir / results[-1].name, results[-1].name)
    return 0 if all(r.metric is not None for r in results) else 1


def _metric_missing(spec: SweepSpec, folder: Path, name: str) -> int:
    """A trial finished without the metric: say what it logged; the sweep ends (bad input, status 2)."""
    said = metric_not_logged(spec, logged_metrics(folder) or [], by=name)
    return bad_input(BadInputError(f"{said}; the sweep stopped after {name} (the other trials would do the same)"))


def _check_metric(
    options: argparse.Namespace, base_args: Sequence[str], spec: SweepSpec, trials: Sequence[Trial], sweep_dir: Path
) -> int | None:
    """The metric name against what trial 0 logs, before any trial runs: a two-batch probe.

    Skipped when a trial already logged the metric, for a single array task (``--trial``) or ``--results``,
    and for ``--slurm`` unless ``--probe`` (a login node may have no GPU, and no time to spare). Returns the
    exit status to end with, or None to go on.

    Raises:
        BadInputError: the probe finished and the metric is not among what it logged.

    """
    if options.trial is not None or options.results or options.probe is False:
        return None
    if options.slurm and options.probe is None:
        print(f"metric.name {spec.metric!r}: the first array task to finish checks it (--probe: a two-batch fit here)")
        return None
    if any(read_metric(sweep_dir / trial_name(number), spec.metric) is not None for number in range(len(trials))):
        return None  # a finished trial logged it
    print(f"Checking that the model logs {spec.metric!r}: a two-batch fit of trial 0 ...", flush=True)
    probe = probe_metrics(base_args, trials[0])
    if probe.signalled:
        print("Stopped: the sweep was signalled during the check", flush=True)
        return exit_codes.REQUEUE
    if probe.logged is None:
        print(
            f"Not checked: the two-batch fit ended with exit {probe.exit_code} (--no_probe skips it); the first "
            "trial to finish checks the metric. Its output ended:\n  " + "\n  ".join(probe.log_tail),
            flush=True,
        )
        return None
    if spec.metric not in probe.logged:
        said = metric_not_logged(spec, probe.logged, by="a two-batch fit of trial 0")
        raise BadInputError(f"{said}. A metric the model logs only later in training: run with --no_probe")
    print(f"Checked in {probe.seconds:.0f}s: the model logs {spec.metric!r}.", flush=True)
    return None
