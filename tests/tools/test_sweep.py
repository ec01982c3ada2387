"""Sweeps: keys checked before anything runs, local grid/random on 2-process trials, the W&B agent contract."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lightning_mlopt.cli.check import ArgumentChecker, check_arguments
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.tools.sweep import SweepSpec, grid_trials, load_sweep, random_trials, trial_arguments
from tests.conftest import CONFIGS, run_cli, run_tool_here
from tests.support.preloaded import fork_tools_child_fits
from tests.support.slurm_cluster import missing_requirement
from tests.support.slurm_standins import slurm_environment

BASE = ["--config", str(CONFIGS / "quickstart.yaml")]


def _sweep_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def test_grid_and_random_trials_and_their_arguments(tmp_path):
    spec = load_sweep(
        _sweep_file(
            tmp_path,
            "method: random\nmetric: {name: val/acc, goal: maximize}\nparameters:\n"
            "  model.init_args.lr: {distribution: log_uniform_values, min: 0.001, max: 0.1}\n"
            "  model.init_args.width: {values: [8, 16]}\n"
            "  trainer.deterministic: {value: true}\n",
        )
    )
    trials = random_trials(spec, count=20, seed=3)
    assert trials == random_trials(spec, count=20, seed=3)  # a relaunched sweep draws the same trials
    assert all(0.001 <= t["model.init_args.lr"] <= 0.1 and t["model.init_args.width"] in (8, 16) for t in trials)
    assert len({t["model.init_args.lr"] for t in trials}) == 20
    assert trial_arguments(trials[0])[1:] == [
        f"--model.init_args.width={trials[0]['model.init_args.width']}",
        "--trainer.deterministic=true",
    ]
    grid = SweepSpec("grid", "m", "minimize", {"a": {"values": [1, 2]}, "b": {"values": ["x", "y"]}}, None, {})
    assert grid_trials(grid) == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("method: grid\nparameters: {a: {values: [1]}}\n", "metric.name is required"),
        ("method: hyperband\nmetric: {name: m}\nparameters: {a: {values: [1]}}\n", "method must be grid, random"),
        ("metric: {name: m}\nparameters: {model: {parameters: {lr: {value: 1}}}}\n", "write nested keys dotted"),
        ("metric: {name: m, goal: up}\nparameters: {a: {value: 1}}\n", "goal must be maximize or minimize"),
        ("metric: {name: m}\nparameters: {}\n", "parameters is empty"),
    ],
)
def test_bad_sweep_files_are_named(tmp_path, text, message):
    with pytest.raises(BadInputError, match=message):
        load_sweep(_sweep_file(tmp_path, text))


def _refused_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parameters: str) -> tuple[Path, str]:
    """A grid sweep of ``parameters`` (YAML lines), refused with exit 2 before anything is created: its stderr."""
    sweep = _sweep_file(tmp_path, "method: grid\nmetric: {name: val/acc, goal: maximize}\nparameters:\n" + parameters)
    result = run_tool_here("sweep", [*BASE, "--sweep", str(sweep)], tmp_path, monkeypatch)
    assert result.returncode == 2, result.stderr
    assert not (tmp_path / "runs").exists()
    return sweep, result.stderr


@pytest.mark.slow
def test_one_parser_checks_many_command_lines_as_a_fresh_one_does():
    # A sweep checks dozens of command lines: the parser is built once (a third of a second each otherwise).
    base = ["--config", str(CONFIGS / "quickstart.yaml")]
    check = ArgumentChecker()
    lrs = [check([*base, f"--model.init_args.lr={lr}"])["model"]["init_args"]["lr"] for lr in (0.01, 0.1)]
    assert lrs == [0.01, 0.1] and check(base)["model"]["init_args"]["lr"] == 0.05  # no value left from before
    with pytest.raises(BadInputError) as reused:
        check([*base, "--model.init_args.learning_rate=0.1"])
    with pytest.raises(BadInputError) as fresh:
        check_arguments([*base, "--model.init_args.learning_rate=0.1"])
    assert str(reused.value) == str(fresh.value) and "learning_rate" in str(fresh.value)


def test_a_typo_in_a_swept_key_fails_at_once_naming_it_and_nothing_is_created(tmp_path, monkeypatch):
    _, stderr = _refused_grid(
        tmp_path,
        monkeypatch,
        "  model.init_args.lr: {values: [0.01, 0.1]}\n  model.init_args.widht: {values: [8, 16]}\n",
    )
    assert "sweep parameter 'model.init_args.widht'" in stderr
    assert "valid keys under model.init_args:" in stderr and "width" in stderr
    assert len(stderr.splitlines()) <= 15


def test_a_value_of_the_wrong_type_fails_naming_key_and_value(tmp_path, monkeypatch):
    sweep = _sweep_file(
        tmp_path, "metric: {name: val/acc}\nparameters:\n  model.init_args.lr: {values: [0.01, fast]}\n"
    )
    result = run_tool_here("sweep", [*BASE, "--sweep", str(sweep)], tmp_path, monkeypatch)
    assert result.returncode == 2
    assert "sweep parameter 'model.init_args.lr' (value 'fast')" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_key_written_as_another_tool_names_it_is_named_in_the_sweep_file_with_the_key_it_means(tmp_path, monkeypatch):
    # The workshop's sweep file: its keys are its own script's names, not the CLI's dotted keys.
    sweep, stderr = _refused_grid(
        tmp_path, monkeypatch, "  learning_rate: {values: [0.1, 0.01]}\n  batch_size: {values: [64, 128]}\n"
    )
    lines = stderr.splitlines()
    assert lines[0] == f"error: sweep parameter 'learning_rate' (value 0.1) in {sweep}:"
    assert "command line" not in stderr, "it was set in the sweep file, not on the command line"
    assert "did you mean: model.init_args.lr?" in lines
    assert any(line.startswith("valid keys under model.init_args: depth, width,") for line in lines)
    assert any(line.startswith("valid keys under data.init_args:") and "batch_size" in line for line in lines)
    assert not (tmp_path / "runs").exists()


def _small_model_config(tmp_path: Path) -> list[str]:
    """A user's model (train_loss and val_loss, its own dataloaders) that fits in seconds."""
    path = tmp_path / "lm.yaml"
    path.write_text("trainer: {accelerator: cpu, devices: 1}\nmodel: {class_path: tests.support.models.ThirdPartyLM}\n")
    return ["--config", str(path)]


@pytest.mark.slow
def test_a_metric_the_model_never_logs_fails_before_any_trial_naming_what_it_logs(tmp_path, monkeypatch):
    sweep = _sweep_file(
        tmp_path,
        "method: grid\nmetric: {name: Validation Accuracy, goal: maximize}\nparameters:\n"
        "  model.init_args.lr: {values: [0.01, 0.001]}\n",
    )
    # A dry run too: it checks what a run would, the metric included.
    args = [*_small_model_config(tmp_path), "--sweep", str(sweep), "--sweep_dir=sweep", "--dry_run"]
    fork_tools_child_fits(monkeypatch)
    result = run_tool_here("sweep", args, tmp_path, monkeypatch)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "metric.name 'Validation Accuracy'" in result.stderr
    assert "a two-batch fit of trial 0 logged train_loss, val_loss. Set metric.name to one of them" in result.stderr
    assert not (tmp_path / "sweep").exists(), "no trial ran, nothing was written"


@pytest.mark.slow
def test_a_trial_that_ends_without_the_metric_stops_the_sweep_listing_what_it_logged(tmp_path, monkeypatch):
    sweep = _sweep_file(
        tmp_path,
        "method: grid\nmetric: {name: val/acc, goal: maximize}\nparameters:\n"
        "  model.init_args.lr: {values: [0.01, 0.001]}\n",
    )
    fork_tools_child_fits(monkeypatch)
    result = run_tool_here(
        "sweep",
        [
            *_small_model_config(tmp_path),
            "--sweep",
            str(sweep),
            "--sweep_dir=sweep",
            "--no_probe",
            "--trainer.max_steps=1",
            "--trainer.enable_progress_bar=false",
        ],
        tmp_path,
        monkeypatch,
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "trial-000 logged train_loss. Set metric.name to one of them" in result.stderr
    assert "the sweep stopped after trial-000" in result.stderr
    assert (tmp_path / "sweep" / "trial-000" / "metrics.json").is_file()
    assert not (tmp_path / "sweep" / "trial-001").exists(), "the second trial would log the same names"


@pytest.mark.slow
def test_slurm_needs_an_allocation_and_a_dry_run_shows_the_script_without_writing_it(tmp_path, monkeypatch):
    sweep = _sweep_file(
        tmp_path,
        "method: grid\nmetric: {name: val/acc, goal: maximize}\nparameters:\n"
        "  model.init_args.lr: {values: [0.1, 0.01]}\n  data.init_args.batch_size: {values: [32, 64]}\n",
    )
    args = [*BASE, "--sweep", str(sweep), "--sweep_dir=sweep", "--slurm"]
    missing = run_tool_here("sweep", args, tmp_path, monkeypatch)
    assert missing.returncode == 2
    assert "needs --nodes N (nodes) and --gpus_per_node G" in missing.stderr
    assert "e.g. --nodes 1 --gpus_per_node 0 --cpu_workers 1 (this config trains on the CPU)" in missing.stderr

    allocation = ["--nodes", "1", "--gpus_per_node", "0", "--cpu_workers", "1", "--max_parallel", "2"]
    job = ["--sbatch_option=--mem=128G", "--setup", "module load cuda/12.4", "--python", "python", "--error_log"]
    shown = run_tool_here("sweep", [*args, *allocation, *job, "--dry_run"], tmp_path, monkeypatch)
    assert shown.returncode == 0, shown.stderr
    assert "sweep.sbatch not written" in shown.stdout.splitlines()[-1]
    assert not (tmp_path / "sweep").exists()
    script = shown.stdout[shown.stdout.index("#!/bin/bash") : shown.stdout.index("\nDry run:")]
    assert "#SBATCH --array=0-3%2" in script.splitlines() and "#SBATCH --mem=128G" in script.splitlines()
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert srun.startswith("srun python -m lightning_mlopt sweep ")
    for sbatch_only in ("--mem", "--sbatch_option", "--setup", "--python", "--error_log", "--cpu_workers", "--slurm"):
        assert sbatch_only not in srun, f"{sbatch_only} is the allocation's, not the job step's"
    (tmp_path / "shown.sbatch").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "shown.sbatch")]).returncode == 0

    written = run_tool_here("sweep", [*args, *allocation, *job], tmp_path, monkeypatch)
    assert written.returncode == 0, written.stderr
    assert (tmp_path / "sweep" / "sweep.sbatch").read_text() == script
    assert "metric.name 'val/acc': the first array task to finish checks it" in written.stdout


@pytest.mark.multiprocess
def test_local_grid_on_two_process_trials_ranks_results_and_every_rank_gets_the_same_values(tmp_path, monkeypatch):
    sweep = _sweep_file(
        tmp_path,
        "method: grid\nmetric: {name: train/loss, goal: minimize}\nparameters:\n"
        "  model.init_args.lr: {values: [0.0001, 0.1]}\n",
    )
    args = [
        *BASE,
        "--sweep",
        str(sweep),
        "--sweep_dir=sweep",
        "--trainer.devices=2",
        "--trainer.max_steps=4",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=tests.support.recorders.RecordHyperparameters",
        "--no_probe",  # the probe's two-batch fit: docs/sweeps.md's example runs it, and the next tests fail it
    ]
    fork_tools_child_fits(monkeypatch)
    result = run_tool_here("sweep", args, tmp_path, monkeypatch)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for number, lr in enumerate([0.0001, 0.1]):
        folder = tmp_path / "sweep" / f"trial-{number:03d}"
        seen = [json.loads((folder / f"hparams-rank{rank}.json").read_text())["lr"] for rank in (0, 1)]
        assert seen == [lr, lr], "both ranks of a trial train with the trial's values"
    losses = {
        number: json.loads((tmp_path / "sweep" / f"trial-{number:03d}" / "metrics.json").read_text())["metrics"][
            "train/loss"
        ]
        for number in (0, 1)
    }
    best = min(losses, key=losses.get)
    table = result.stdout[result.stdout.index("rank  trial") :].splitlines()
    assert table[1].split()[:3] == ["1", f"trial-{best:03d}", f"{losses[best]:.6g}"]  # best first
    assert table[2].split()[0] == "2" and table[3] == "Results: sweep/results.csv"
    csv_rows = (tmp_path / "sweep" / "results.csv").read_text().splitlines()
    assert csv_rows[0] == "trial,train/loss,model.init_args.lr,status,seconds" and csv_rows[1].startswith(
        f"trial-{best:03d},"
    )
    # The same sweep again: finished trials are read, not trained again.
    again = run_tool_here("sweep", args, tmp_path, monkeypatch)  # nothing to launch
    assert again.returncode == 0 and again.stdout.count(": done earlier") == 2


@pytest.mark.slow
def test_wandb_mode_needs_a_key_and_its_agent_command_is_our_cli(tmp_path, monkeypatch):
    sweep = _sweep_file(
        tmp_path,
        "method: bayes\nmetric: {name: val/acc, goal: maximize}\nparameters:\n"
        "  model.init_args.lr: {distribution: log_uniform_values, min: 0.001, max: 0.1}\n",
    )
    env = {"WANDB_API_KEY": "", "NETRC": str(tmp_path / "no-netrc"), "WANDB_MODE": "offline"}
    refused = run_tool_here("sweep", [*BASE, "--sweep", str(sweep), "--mode", "wandb"], tmp_path, monkeypatch, env)
    assert refused.returncode == 2 and "needs a W&B server and an API key" in refused.stderr
    local_bayes = run_tool_here("sweep", [*BASE, "--sweep", str(sweep)], tmp_path, monkeypatch, env)
    assert local_bayes.returncode == 2 and "bayes needs the W&B server" in local_bayes.stderr

    shown = run_tool_here(
        "sweep",
        [*BASE, "--sweep", str(sweep), "--mode", "wandb", "--dry_run", "--no_probe"],
        tmp_path,
        monkeypatch,
        env,
    )
    assert shown.returncode == 0, shown.stderr
    config = json.loads(shown.stdout[shown.stdout.index("{") :])
    assert config["method"] == "bayes" and config["metric"]["name"] == "val/acc"
    command = config["command"]
    assert command[0] == "${env}" and command[-1] == "${args}" and command[2:5] == ["-m", "lightning_mlopt", "fit"]
    # What a W&B agent runs: ${args} becomes --key=value; our CLI accepts it as is.
    agent_args = [*command[5:-1], "--model.init_args.lr=0.0123"]
    parsed = check_arguments(agent_args)
    assert parsed["model"]["init_args"]["lr"] == pytest.approx(0.0123)


@pytest.mark.multiprocess
@pytest.mark.skipif(missing_requirement() is None, reason="runs on a real SLURM cluster in test_slurm_cluster.py")
def test_a_sweep_as_a_slurm_job_array_runs_one_trial_per_array_task_and_the_results_are_read_back(tmp_path):
    sweep = _sweep_file(
        tmp_path,
        "method: grid\nmetric: {name: train/loss, goal: minimize}\nparameters:\n"
        "  model.init_args.lr: {values: [0.0001, 0.1]}\n",
    )
    fit_args = [
        "--trainer.devices=auto",
        "--trainer.max_steps=3",
        "--trainer.max_epochs=1",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=tests.support.recorders.RecordHyperparameters",
    ]
    sweep_args = ["sweep", *BASE, "--sweep", str(sweep), "--sweep_dir=sweep", *fit_args]
    emitted = run_cli(
        [
            *sweep_args,
            "--slurm",
            *("--nodes", "1", "--gpus_per_node", "0", "--cpu_workers", "2"),
            *("--max_parallel", "1", "--time", "01:00:00"),
        ],
        cwd=tmp_path,
    )
    assert emitted.returncode == 0, emitted.stderr
    script = (tmp_path / "sweep" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-1%1" in script.splitlines() and "--trial=$SLURM_ARRAY_TASK_ID" in script
    assert "--slurm" not in script.split("srun ", 1)[1]  # each array task runs a trial, not another array
    assert not list((tmp_path / "sweep").glob("trial-*"))  # nothing ran yet

    env = slurm_environment(tmp_path, tasks_per_node=2, job_name="sweep")
    for task in ("0", "1"):
        done = subprocess.run(
            ["bash", "sweep/sweep.sbatch"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env={**env, "SLURM_ARRAY_JOB_ID": "777", "SLURM_ARRAY_TASK_ID": task},
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for number, lr in enumerate([0.0001, 0.1]):
        folder = tmp_path / "sweep" / f"trial-{number:03d}"
        assert [json.loads((folder / f"hparams-rank{r}.json").read_text())["lr"] for r in (0, 1)] == [lr, lr]
    table = run_cli([*sweep_args, "--results"], cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    rows = table.stdout[table.stdout.index("rank  trial") :].splitlines()[1:3]
    assert [row.split()[0] for row in rows] == ["1", "2"] and all(row.split()[-1] == "done" for row in rows)


def test_results_of_trials_an_agent_ran_are_read_from_their_run_directories(tmp_path):
    from lightning_mlopt.tools.sweep import collect_run_dirs, results_table

    spec = SweepSpec("bayes", "val/acc", "maximize", {"model.init_args.lr": {"min": 0.001, "max": 0.1}}, None, {})
    for name, lr, acc in (("quickstart-aaaa1111", 0.01, 0.81), ("quickstart-bbbb2222", 0.05, 0.93)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.yaml").write_text(f"model:\n  init_args:\n    lr: {lr}\n")
        (folder / "metrics.json").write_text(json.dumps({"metrics": {"val/acc": acc}}))
    (tmp_path / "quickstart-cccc3333").mkdir()
    (tmp_path / "quickstart-cccc3333" / "config.yaml").write_text("model:\n  init_args:\n    lr: 0.09\n")  # crashed
    rows = results_table(collect_run_dirs(spec, tmp_path), spec).splitlines()[1:]
    assert [row.split()[:4] for row in rows] == [
        ["1", "quickstart-bbbb2222", "0.93", "0.05"],
        ["2", "quickstart-aaaa1111", "0.81", "0.01"],
        ["-", "quickstart-cccc3333", "-", "0.09"],
    ]
