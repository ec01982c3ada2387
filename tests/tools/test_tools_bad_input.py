"""Bad input to a tool never loses data: one line ``error: ...`` naming the cause and the fix, exit 2, and no
file written or changed. An output path that holds a file of the user's (or a folder) is bad input too; a file a
tool wrote earlier (its ``# Written by lightning_mlopt`` header) is replaced by a rerun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_mlopt.checkpoint import CheckpointStore
from lightning_mlopt.tools._preamble import WRITTEN_BY
from tests.conftest import CONFIGS, REPO_PYTHONPATH, run_tool_here

SLURM_CPU_JOB = ["--config", str(CONFIGS / "quickstart.yaml"), "--nodes", "1", "--gpus_per_node", "0"]
K8S_CPU_JOB = ["--config", str(CONFIGS / "quickstart.yaml"), "--image=x", "--checkpoint_claim=ckpt"]
K8S_CPU_JOB += ["--gpus_per_node=0"]


def _files(folder: Path) -> dict[Path, bytes | None]:
    """Every path under ``folder`` with its bytes (None for a folder): equal before and after = nothing changed."""
    return {path: path.read_bytes() if path.is_file() else None for path in sorted(folder.rglob("*"))}


def _refused(result: subprocess.CompletedProcess[str], says: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], result.stderr


@pytest.mark.parametrize(
    "tool,job,written",
    [("slurm", SLURM_CPU_JOB, "job.sbatch"), ("k8s", K8S_CPU_JOB, "manifest.yaml")],
)
def test_output_is_never_a_users_file_or_a_folder(tmp_path, monkeypatch, tool, job, written):
    precious = tmp_path / "precious.txt"
    precious.write_text("months of notes\n")
    (tmp_path / "folder").mkdir()
    before = _files(tmp_path)
    refused = run_tool_here(tool, [*job, "--output", str(precious)], tmp_path, monkeypatch)
    _refused(refused, f"{precious} exists and no lightning_mlopt tool wrote it (nothing overwritten): give another")
    _refused(
        run_tool_here(tool, [*job, "--output", "folder"], tmp_path, monkeypatch),
        f"folder is a folder, not a file: give --output a file path, e.g. {Path('folder', written)}",
    )
    assert _files(tmp_path) == before  # no run directory either

    # A file the tool wrote is its own: a rerun (another config, a fix) replaces it.
    output = tmp_path / written
    assert run_tool_here(tool, [*job, "--output", str(output)], tmp_path, monkeypatch).returncode == 0
    assert any(line.startswith(WRITTEN_BY) for line in output.read_text().splitlines()[:2])
    output.write_text(output.read_text() + "# an edit the rerun replaces\n")
    again = run_tool_here(tool, [*job, "--output", str(output)], tmp_path, monkeypatch)
    assert again.returncode == 0, again.stderr
    assert "an edit the rerun replaces" not in output.read_text()


@pytest.mark.parametrize(
    "overlay,says",
    [
        ("trainer: {devices: [1\n", "overlay.yaml: invalid YAML at line 2, column 1"),
        ("- trainer\n- model\n", "overlay.yaml: a config file must be a mapping of keys, got list"),
        ("trainer: {strategy: zero4}\n", "trainer.strategy: unknown strategy 'zero4'. Did you mean: zero3"),
    ],
)
def test_plan_checks_its_config_files_as_fit_does(tmp_path, monkeypatch, overlay, says):
    (tmp_path / "overlay.yaml").write_text(overlay)
    before = _files(tmp_path)
    args = ["--config", str(CONFIGS / "quickstart.yaml"), "--config", "overlay.yaml"]
    _refused(run_tool_here("plan", args, tmp_path, monkeypatch), says)
    assert _files(tmp_path) == before


@pytest.mark.parametrize("method", ["grid", "random"])
def test_a_sweep_parameter_with_no_values_is_refused_before_anything_runs(tmp_path, monkeypatch, method):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        f"method: {method}\nmetric: {{name: val/acc}}\nparameters:\n  model.init_args.lr: {{values: []}}\n"
    )
    before = _files(tmp_path)
    args = ["--config", str(CONFIGS / "quickstart.yaml"), "--sweep", str(sweep), "--count=2", "--sweep_dir=out"]
    _refused(
        run_tool_here("sweep", [*args, "--no_probe"], tmp_path, monkeypatch),
        "sweep.yaml: parameters.model.init_args.lr.values must be a non-empty list, got []; give at least one",
    )
    assert _files(tmp_path) == before


def test_sweep_results_of_a_folder_that_does_not_exist(tmp_path, monkeypatch):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("metric: {name: val/acc}\nparameters:\n  model.init_args.lr: {values: [0.1]}\n")
    before = _files(tmp_path)
    args = ["--config", str(CONFIGS / "quickstart.yaml"), "--sweep", str(sweep), "--results", "--sweep_dir=nope"]
    _refused(run_tool_here("sweep", args, tmp_path, monkeypatch), "--results: no sweep folder nope; give --sweep_dir")
    assert _files(tmp_path) == before


def test_checkpoint_paths_that_are_no_checkpoint_or_no_folder(tmp_path, monkeypatch):
    from tests.checkpoint.test_checkpoint_store import _commit

    _commit(CheckpointStore(tmp_path / "run" / "checkpoints"), 2)
    (tmp_path / "config.yaml").write_text((CONFIGS / "quickstart.yaml").read_text())
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not a checkpoint\n")
    (tmp_path / "afile").write_text("kept\n")
    before = _files(tmp_path)

    def checkpoint(*args: str) -> subprocess.CompletedProcess[str]:
        return run_tool_here("checkpoint", args, tmp_path, monkeypatch)

    yaml_file = checkpoint("consolidate", "config.yaml", "out.ckpt")
    _refused(yaml_file, "config.yaml: not a checkpoint torch.load reads with weights_only=True (UnpicklingError)")
    assert "weights_only=False" not in yaml_file.stderr  # torch's advice would run whatever the file holds
    _refused(checkpoint("consolidate", "notes", "out.ckpt"), "notes: not a checkpoint in any known layout")
    _refused(checkpoint("export", "run/checkpoints", "afile"), "afile is a file; give a new folder for the export")
    _refused(checkpoint("list", "nope"), "nope does not exist; give a run's checkpoints folder")
    assert _files(tmp_path) == before

    # A folder with no checkpoints in it (yet) is not bad input: nothing valid, exit 1, and where they are.
    empty = checkpoint("list", "run")
    assert (
        empty.returncode == 1 and empty.stderr == f"error: no checkpoints in run; list {Path('run', 'checkpoints')}\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("args,value", [(["--nproc-per-node", "0"], "0"), (["--nproc-per-node=abc"], "abc")])
def test_launch_refuses_a_worker_count_it_cannot_start(tmp_path, args, value):
    env = {**os.environ, "PYTHONPATH": REPO_PYTHONPATH}
    command = [sys.executable, "-m", "lightning_mlopt", "launch", *args, "fit", "--config", "x.yaml"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    _refused(
        done,
        f"--nproc-per-node must be a number of workers >= 1, or one of auto, cpu, gpu, xpu; got {value!r}",
    )
    assert not done.stdout and not any(tmp_path.iterdir())
