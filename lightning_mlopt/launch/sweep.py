"""``python -m lightning_mlopt sweep --config BASE --sweep SWEEP.yaml``: hyperparameter sweeps over our CLI.

The sweep file is a W&B sweep configuration whose parameter names are the CLI's dotted keys::

    method: grid                     # grid | random (here or on W&B) | bayes (W&B only)
    metric: {name: val/acc, goal: maximize}

Parameters
----------
      model.init_args.lr: {values: [0.01, 0.05, 0.1]}
      model.init_args.weight_decay: {distribution: log_uniform_values, min: 1.0e-5, max: 1.0e-3}

Every trial's arguments are checked against the CLI's parser before the first trial starts, so a typo in a
key or a value of the wrong type fails at once, naming it. ``--mode local`` (the default) needs no W&B
server: trials run one after another as ``python -m lightning_mlopt fit ... --key=value`` (each launches its
own ranks, so every rank gets the same values), each in ``<sweep_dir>/trial-NNN``, and the sweep ends with a
results table, best first (also ``results.csv``). Running the same sweep again skips finished trials and
resumes interrupted ones. ``--mode wandb`` creates the sweep on the W&B server and runs a W&B agent whose
command is our CLI with W&B's ``${args}`` (``--key=value``).

"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import itertools
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml

from lightning_mlopt._bad_input import ToolArgumentParser
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.launch._argv import without_options
from lightning_mlopt.launch.slurm import add_slurm_arguments
from lightning_mlopt.run_dir import METRICS_NAME

_LOCAL_DISTRIBUTIONS = ("uniform", "log_uniform_values", "int_uniform", "q_uniform", "normal", "categorical")
Trial = dict[str, Any]


@dataclass(frozen=True)
class SweepSpec:
    """A sweep file, checked.

    Attributes:
        method: ``grid``, ``random`` or ``bayes``.
        metric: the logged metric that ranks trials (a key of ``metrics.json``, e.g. ``val/acc``).
        goal: ``maximize`` or ``minimize``.
        parameters: dotted CLI key -> W&B parameter spec (``value``, ``values``, or a distribution).
        run_cap: the most trials to run (random search needs it, or ``--count``).
        raw: the file's content, as W&B receives it.

    Example::

        spec = load_sweep("lr_sweep.yaml")
        trials = grid_trials(spec)  # [{"model.init_args.lr": 0.01}, ...]

    """

    method: str
    metric: str
    goal: str
    parameters: dict[str, dict[str, Any]]
    run_cap: int | None
    raw: dict[str, Any]


def load_sweep(path: str | Path) -> SweepSpec:
    """Read and check a sweep file.

    Raises:
        BadInputError: naming the file and what is wrong in it.

    """
    where = Path(path)
    if not where.is_file():
        raise BadInputError(f"sweep file not found: {where}")
    try:
        raw = yaml.safe_load(where.read_text()) or {}
    except yaml.YAMLError as error:
        raise BadInputError(f"{where} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise BadInputError(f"{where}: expected a mapping with method, metric and parameters")
    method = raw.get("method", "grid")
    if method not in ("grid", "random", "bayes"):
        raise BadInputError(f"{where}: method must be grid, random or bayes; got {method!r}")
    metric = raw.get("metric") or {}
    if not isinstance(metric, dict) or not metric.get("name"):
        raise BadInputError(f"{where}: metric.name is required (e.g. metric: {{name: val/acc, goal: maximize}})")
    goal = metric.get("goal", "minimize")
    if goal not in ("maximize", "minimize"):
        raise BadInputError(f"{where}: metric.goal must be maximize or minimize; got {goal!r}")
    parameters = raw.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        raise BadInputError(f"{where}: parameters is empty; name at least one dotted key to sweep")
    for key, spec in parameters.items():
        if isinstance(spec, dict) and "parameters" in spec:
            raise BadInputError(f"{where}: parameters.{key}: write nested keys dotted (model.init_args.lr)")
        if not isinstance(spec, dict) or not ({"value", "values", "distribution", "min"} & spec.keys()):
            raise BadInputError(f"{where}: parameters.{key} needs value, values, or a distribution with min/max")
    run_cap = raw.get("run_cap")
    if run_cap is not None and (not isinstance(run_cap, int) or run_cap < 1):
        raise BadInputError(f"{where}: run_cap must be a positive integer; got {run_cap!r}")
    return SweepSpec(method, str(metric["name"]), goal, parameters, run_cap, raw)


def grid_trials(spec: SweepSpec) -> list[Trial]:
    """Every combination of the parameters' values, in file order.

    Example::

        >>> spec = SweepSpec("grid", "m", "minimize", {"a": {"values": [1, 2]}, "b": {"value": 0}}, None, {})
        >>> grid_trials(spec)
        [{'a': 1, 'b': 0}, {'a': 2, 'b': 0}]
    """
    choices = []
    for key, parameter in spec.parameters.items():
        if "value" in parameter:
            choices.append([parameter["value"]])
        elif "values" in parameter:
            choices.append(list(parameter["values"]))
        else:
            raise BadInputError(f"grid search needs values for every parameter; {key} has a distribution")
    return [dict(zip(spec.parameters, values, strict=True)) for values in itertools.product(*choices)]


def random_trials(spec: SweepSpec, count: int, seed: int) -> list[Trial]:
    """``count`` independent draws from the parameters' distributions; the same seed draws the same trials."""
    generator = random.Random(seed)
    return [{key: _draw(key, parameter, generator) for key, parameter in spec.parameters.items()} for _ in range(count)]


def _draw(key: str, parameter: dict[str, Any], generator: random.Random) -> Any:
    if "value" in parameter:
        return parameter["value"]
    if "values" in parameter and parameter.get("distribution", "categorical") == "categorical":
        return generator.choice(list(parameter["values"]))
    kind = parameter.get("distribution", "int_uniform" if isinstance(parameter.get("min"), int) else "uniform")
    if kind not in _LOCAL_DISTRIBUTIONS:
        raise BadInputError(f"parameters.{key}: distribution {kind!r} is W&B-only; use --mode wandb or values")
    if kind == "normal":
        return generator.gauss(float(parameter.get("mu", 0.0)), float(parameter.get("sigma", 1.0)))
    low, high = parameter.get("min"), parameter.get("max")
    if low is None or high is None or float(low) > float(high):
        raise BadInputError(f"parameters.{key}: {kind} needs min <= max; got min={low!r}, max={high!r}")
    if kind == "int_uniform":
        return generator.randint(int(low), int(high))
    if kind == "log_uniform_values":
        if float(low) <= 0:
            raise BadInputError(f"parameters.{key}: log_uniform_values needs min > 0; got {low!r}")
        return math.exp(generator.uniform(math.log(float(low)), math.log(float(high))))
    value = generator.uniform(float(low), float(high))
    if kind == "q_uniform":
        step = float(parameter.get("q", 1.0))
        value = round(value / step) * step
    return value


def trial_arguments(trial: Trial) -> list[str]:
    """``--key=value`` arguments, the form W&B's ``${args}`` passes to an agent's command.

    Example::

        >>> trial_arguments({"model.init_args.lr": 0.1, "trainer.deterministic": True})
        ['--model.init_args.lr=0.1', '--trainer.deterministic=true']
    """
    return [f"--{key}={_format_value(value)}" for key, value in trial.items()]


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def check_trials(base_args: Sequence[str], spec: SweepSpec, trials: Sequence[Trial]) -> None:
    """Parse the base config, each swept key, then every trial, as ``fit`` would; nothing is built.

    Raises:
        BadInputError: naming the base config, the swept key or the trial, with the parser's reason.

    """
    from lightning_mlopt.cli import check_arguments

    try:
        check_arguments(base_args)
    except BadInputError as error:
        raise BadInputError(f"the base config does not parse:\n{error}") from None
    for key, parameter in spec.parameters.items():
        # Each key alone first, with its bounds or first value, so the message names the key.
        for probe in _probe_values(parameter):
            try:
                check_arguments([*base_args, *trial_arguments({key: probe})])
            except BadInputError as error:
                raise BadInputError(f"sweep parameter {key!r} (value {probe!r}):\n{error}") from None
    for number, trial in enumerate(trials):
        try:
            check_arguments([*base_args, *trial_arguments(trial)])
        except BadInputError as error:
            raise BadInputError(f"trial {number} ({_describe(trial)}):\n{error}") from None


def _probe_values(parameter: dict[str, Any]) -> list[Any]:
    if "value" in parameter:
        return [parameter["value"]]
    if "values" in parameter:
        return list(parameter["values"])
    return [parameter[bound] for bound in ("min", "max") if bound in parameter]


def _describe(trial: Trial) -> str:
    return ", ".join(
        f"{key.rsplit('.', 1)[-1]}={value:.4g}" if isinstance(value, float) else f"{key.rsplit('.', 1)[-1]}={value}"
        for key, value in trial.items()
    )


# ---------------------------------------------------------------------- running


def trial_name(number: int) -> str:
    """The folder of trial ``number`` in a local or SLURM-array sweep: ``trial-007``."""
    return f"trial-{number:03d}"


@dataclass
class TrialResult:
    """One trial's outcome: its folder, values, metric (None if missing) and status."""

    name: str
    trial: Trial
    metric: float | None
    status: str
    seconds: float
    exit_code: int = 0


def run_local(
    base_args: Sequence[str],
    spec: SweepSpec,
    trials: Sequence[Trial],
    sweep_dir: Path,
    only: int | None = None,
) -> list[TrialResult]:
    """Run the trials one after another (or just trial ``only``); a finished trial is read, not run again."""
    results: list[TrialResult] = []
    durations: list[float] = []
    env = {**os.environ, "WANDB_RUN_GROUP": sweep_dir.name}  # a WandbTracker groups the trials in W&B
    if "SLURM_NTASKS" not in env:
        env.pop("MASTER_PORT", None)  # each trial's ranks pick a free port (under srun, SLURM's rules hold)
    for number, trial in enumerate(trials):
        if only is not None and number != only:
            continue
        name = trial_name(number)
        folder = sweep_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "params.json").write_text(json.dumps(trial, indent=2, sort_keys=True))
        metric = _read_metric(folder, spec.metric)
        if metric is not None:
            results.append(TrialResult(name, trial, metric, "done earlier", 0.0, 0))
            print(f"[{number + 1}/{len(trials)}] {name}: done earlier, {spec.metric}={metric:.4g}", flush=True)
            continue
        command = [sys.executable, "-m", "lightning_mlopt", "fit", *base_args, *trial_arguments(trial)]
        command.append(f"--run_dir={folder}")
        started = time.monotonic()
        with open(folder / "output.log", "ab") as log:
            code, signalled = _run_forwarding_signals(command, log, env)
        seconds = time.monotonic() - started
        durations.append(seconds)
        metric = _read_metric(folder, spec.metric)
        status = "ok" if code == 0 and metric is not None else f"failed (exit {code})" if code else "no metric"
        results.append(TrialResult(name, trial, metric, status, seconds, code))
        left = (len(trials) - number - 1) if only is None else 0
        eta = datetime.timedelta(seconds=round(left * sum(durations) / len(durations)))
        shown = f"{spec.metric}={metric:.4g}" if metric is not None else status
        print(
            f"[{number + 1}/{len(trials)}] {name} ({_describe(trial)}): {shown} in {seconds:.0f}s, eta {eta}",
            flush=True,
        )
        if signalled:
            print(f"Stopped after {name}: the sweep was signalled (the trial saved and can resume)", flush=True)
            break
    return results


_FORWARDED = (signal.SIGTERM, signal.SIGUSR1)


def _run_forwarding_signals(command: Sequence[str], log: IO[bytes], env: dict[str, str]) -> tuple[int, bool]:
    """Run a trial, forwarding SIGTERM/SIGUSR1 sent to the sweep (preemption, a SLURM time limit) to it.

    The trial's FaultTolerantCheckpoint saves and exits 75, instead of the signal killing the sweep and
    orphaning the trial. Returns the trial's exit status and whether a signal came.
    """
    child = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=env)
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {number: signal.signal(number, forward) for number in _FORWARDED} if in_main_thread else {}
    try:
        return child.wait(), bool(received)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def collect_results(spec: SweepSpec, trials: Sequence[Trial], sweep_dir: Path) -> list[TrialResult]:
    """What is on disk for each trial (its ``metrics.json``), without running anything."""
    results = []
    for number, trial in enumerate(trials):
        name = trial_name(number)
        metric = _read_metric(sweep_dir / name, spec.metric)
        started = (sweep_dir / name / "params.json").is_file()
        status = "done" if metric is not None else "not finished" if started else "not started"
        results.append(TrialResult(name, trial, metric, status, 0.0))
    return results


def collect_run_dirs(spec: SweepSpec, sweep_dir: Path) -> list[TrialResult]:
    """Results of the trials a W&B agent ran under ``sweep_dir``.

    Each trial's values come from its resolved ``config.yaml`` (the CLI writes it), its metric from
    ``metrics.json``.
    """
    results = []
    for config_path in sorted(sweep_dir.glob("*/config.yaml")):
        config = yaml.safe_load(config_path.read_text()) or {}
        trial = {key: _lookup(config, key) for key in spec.parameters}
        metric = _read_metric(config_path.parent, spec.metric)
        results.append(TrialResult(config_path.parent.name, trial, metric, "done" if metric is not None else "-", 0.0))
    return results


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _read_metric(folder: Path, name: str) -> float | None:
    path = folder / METRICS_NAME
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())["metrics"].get(name)
    except (ValueError, KeyError):
        return None
    return float(value) if value is not None else None


def ranked(results: Sequence[TrialResult], spec: SweepSpec) -> list[TrialResult]:
    """Trials with a metric, best first by the spec's goal (ties keep their order), then those without."""
    scored = [r for r in results if r.metric is not None]
    scored.sort(key=lambda r: r.metric, reverse=spec.goal == "maximize")  # type: ignore[arg-type, return-value]
    return scored + [r for r in results if r.metric is None]


def results_table(results: Sequence[TrialResult], spec: SweepSpec) -> str:
    """The trials ranked by the metric, best first; failed trials last."""
    keys = list(spec.parameters)
    header = ["rank", "trial", spec.metric, *keys, "status"]
    rows = [
        [
            "-" if r.metric is None else str(i + 1),
            r.name,
            "-" if r.metric is None else f"{r.metric:.6g}",
            *[str(r.trial.get(k)) for k in keys],
            r.status,
        ]
        for i, r in enumerate(ranked(results, spec))
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


def write_results(results: Sequence[TrialResult], spec: SweepSpec, sweep_dir: Path) -> Path:
    """``results.csv`` in the sweep folder: one row per trial, best first."""
    path = sweep_dir / "results.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["trial", spec.metric, *spec.parameters, "status", "seconds"])
        for r in ranked(results, spec):
            writer.writerow([r.name, r.metric, *[r.trial.get(k) for k in spec.parameters], r.status, round(r.seconds)])
    return path


def wandb_sweep_config(spec: SweepSpec, base_args: Sequence[str], sweep_dir: Path) -> dict[str, Any]:
    """The configuration sent to W&B: the sweep file plus an agent command that runs our CLI.

    W&B replaces ``${args}`` with ``--key=value`` per parameter; the trials' run directories go under
    ``sweep_dir``, so the results table can be built from their ``metrics.json`` afterwards.
    """
    command = [sys.executable, "-m", "lightning_mlopt", "fit", *base_args]
    command += [f"--trainer.default_root_dir={sweep_dir}", "${args}"]
    return {**spec.raw, "command": ["${env}", *command]}


def run_wandb(spec: SweepSpec, base_args: Sequence[str], sweep_dir: Path, options: argparse.Namespace) -> int:
    """Create the sweep on the W&B server and run one agent here (``--count`` trials at most)."""
    from lightning_mlopt.tracking.wandb_tracker import _api_key_configured

    if not _api_key_configured():
        raise BadInputError(
            "--mode wandb needs a W&B server and an API key (run `wandb login` or set WANDB_API_KEY); "
            "without them use --mode local"
        )
    import wandb

    sweep_id = wandb.sweep(
        wandb_sweep_config(spec, base_args, sweep_dir), project=options.project, entity=options.entity
    )
    print(f"W&B sweep {sweep_id}: more agents with `wandb agent <entity>/{options.project}/{sweep_id}`", flush=True)
    target = "/".join(part for part in (options.entity, options.project, sweep_id) if part)
    agent = [sys.executable, "-m", "wandb", "agent", *(["--count", str(options.count)] if options.count else [])]
    status = subprocess.call([*agent, target])
    results = collect_run_dirs(spec, sweep_dir)  # the trials this and other agents ran into sweep_dir
    if results:
        print(results_table(results, spec))
        print(f"Results: {write_results(results, spec, sweep_dir)}")
    return status


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
    from lightning_mlopt.launch.slurm import requeue_exit_code, sbatch_script, slurm_job, write_script

    config = check_arguments(base_args).as_dict()
    job = slurm_job(options, config.get("trainer") or {}, f"sweep-{sweep_dir.name}")
    command = [
        sys.executable,
        "-m",
        "lightning_mlopt",
        "sweep",
        *without_options(argv, _SLURM_ONLY_FLAGS, flags=_FLAGS_WITHOUT_VALUE),
        f"--sweep_dir={sweep_dir.resolve()}",
        "--trial=$SLURM_ARRAY_TASK_ID",
        f"--trainer.num_nodes={job.nodes}",
        f"--trainer.devices={job.gpus_per_node}",
    ]
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
    base_args = [arg for path in options.config for arg in ("--config", path)] + extra
    try:
        spec = load_sweep(options.sweep)
        if options.count is not None and options.count < 1:
            raise BadInputError(f"--count must be >= 1, got {options.count}")
        count = options.count or spec.run_cap
        if options.mode == "local":
            if spec.method == "bayes":
                raise BadInputError("method: bayes needs the W&B server (--mode wandb); use grid or random here")
            if spec.method == "grid":
                trials = grid_trials(spec)[:count] if count else grid_trials(spec)
            elif count is None:
                raise BadInputError("random search needs a number of trials: --count N, or run_cap in the file")
            else:
                trials = random_trials(spec, count, options.seed)
        else:
            trials = []  # W&B draws them; the keys and their bounds are still checked below
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
        sys.stderr.write(f"error: {error}\n")
        return 2
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
