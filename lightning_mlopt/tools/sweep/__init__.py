"""``python -m lightning_mlopt sweep --config BASE --sweep SWEEP.yaml``: hyperparameter sweeps over our CLI.

The sweep file is a W&B sweep configuration whose parameter names are the CLI's dotted keys::

    method: grid                     # grid | random (here or on W&B) | bayes (W&B only)
    metric: {name: val/acc, goal: maximize}

Parameters
----------
      model.init_args.lr: {values: [0.01, 0.05, 0.1]}
      model.init_args.weight_decay: {distribution: log_uniform_values, min: 1.0e-5, max: 1.0e-3}

Every trial's arguments are checked against the CLI's parser before the first trial starts, so a typo in a
key or a value of the wrong type fails at once, naming it (and the key it may have meant: ``learning_rate``
-> ``model.init_args.lr``); a two-batch fit of trial 0 then checks that the model logs the metric, and the
first trial that ends without it stops the sweep, naming what it logged. ``--mode local`` (the default) needs no W&B
server: trials run one after another as ``python -m lightning_mlopt fit ... --key=value`` (each launches its
own ranks, so every rank gets the same values), each in ``<sweep_dir>/trial-NNN``, and the sweep ends with a
results table, best first (also ``results.csv``). Running the same sweep again skips finished trials and
resumes interrupted ones. ``--mode wandb`` creates the sweep on the W&B server and runs a W&B agent whose
command is our CLI with W&B's ``${args}`` (``--key=value``).

The package: ``spec.py`` (the sweep file and its trials), ``probe.py`` (the metric check before the first
trial), ``runner.py`` (local runs), ``results.py`` (what each trial left, the table), ``wandb_agent.py`` (the
W&B server), ``tool.py`` (the command line and the SLURM job array).

"""

from lightning_mlopt.tools.sweep.probe import ProbeResult, probe_metrics
from lightning_mlopt.tools.sweep.results import (
    TrialResult,
    collect_results,
    collect_run_dirs,
    logged_metrics,
    ranked,
    results_table,
    trial_name,
    write_results,
)
from lightning_mlopt.tools.sweep.runner import run_local
from lightning_mlopt.tools.sweep.spec import (
    SweepSpec,
    Trial,
    check_trials,
    grid_trials,
    load_sweep,
    local_trials,
    random_trials,
    trial_arguments,
)
from lightning_mlopt.tools.sweep.tool import main, slurm_array
from lightning_mlopt.tools.sweep.wandb_agent import run_wandb, wandb_sweep_config

__all__ = [
    "ProbeResult",
    "SweepSpec",
    "Trial",
    "TrialResult",
    "check_trials",
    "collect_results",
    "collect_run_dirs",
    "grid_trials",
    "load_sweep",
    "local_trials",
    "logged_metrics",
    "main",
    "probe_metrics",
    "random_trials",
    "ranked",
    "results_table",
    "run_local",
    "run_wandb",
    "slurm_array",
    "trial_arguments",
    "trial_name",
    "wandb_sweep_config",
    "write_results",
]
