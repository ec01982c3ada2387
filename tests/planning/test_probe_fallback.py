"""A model whose step cannot run on the meta device is planned without activations, with one line saying so.

Hugging Face models do this (``transformers``' mask code asks ``.all()`` of a tensor, a ``.item()`` that a meta
tensor cannot answer): ``plan`` used to end in an 80-line traceback, ``strategy: auto`` in DDP whatever the size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from jsonargparse import Namespace, dict_to_namespace
from torch import Tensor, nn

from lightning_mlopt.demos import TokenDataModule
from lightning_mlopt.planning.probe import MetaProbeError, measure_activations
from tests.conftest import run_tool_here
from tests.support.user_models import llama, write_user_config

NOTE = "note: activations not measured: the model's training_step does not run on the meta device"
META_ITEM = "RuntimeError: Tensor.item() cannot be called on meta tensors"


class BranchesOnItsData(pl.LightningModule):
    """A step that branches on its batch's values, as ``transformers``' packed-sequence check does."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(256, 8)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        inputs, _ = batch
        if (inputs == 0).all():  # a Python bool of a tensor: .item(), which a meta tensor has no data for
            return torch.zeros(())
        return self.embedding(inputs).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_data_dependent_step_raises_a_one_line_probe_error_and_logging_comes_back():
    with torch.device("meta"):
        model = BranchesOnItsData()
    log = model.log
    with pytest.raises(MetaProbeError) as raised:
        measure_activations(model, TokenDataModule(num_sequences=16, batch_size=4))
    assert str(raised.value) == f"{NOTE.removeprefix('note: ')} ({META_ITEM})"
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert model.log == log  # silenced for the probe only


def test_plan_falls_back_to_parameter_arithmetic_with_one_note(tmp_path, monkeypatch):
    model = {"class_path": f"{__name__}.BranchesOnItsData"}
    config = write_user_config(tmp_path, model, "branches.yaml", accelerator="cpu", devices=2)
    result = run_tool_here("plan", ["--config", config, "--format", "json"], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)  # the note goes to stderr: stdout stays one JSON document
    assert plan["num_params"] == 256 * 8 and plan["world_size"] == 2 and plan["optimizer"] == "sgd"
    assert all(row["activations"] == 0 for row in plan["rows"])
    ddp = next(row for row in plan["rows"] if row["strategy"] == "ddp")
    assert ddp["total"] == ddp["parameters"] + ddp["gradients"] + ddp["optimizer_state"] == 256 * 8 * 8  # fp32 SGD
    (note,) = result.stderr.strip().splitlines()
    assert note.startswith(NOTE) and META_ITEM in note and note.endswith("give --activation_memory SIZE to add them")
    table = run_tool_here("plan", ["--config", config], tmp_path, monkeypatch)
    assert table.returncode == 0 and table.stderr == ""
    assert table.stdout.strip().splitlines()[-1] == note  # under the table it qualifies
    given = run_tool_here("plan", ["--config", config, "--activation_memory", "1MB"], tmp_path, monkeypatch)
    assert given.returncode == 0 and NOTE not in given.stdout + given.stderr  # nothing measured, nothing missing


@pytest.mark.slow
def test_plan_on_a_hugging_face_llama_exits_0_with_the_note(tmp_path, monkeypatch):
    config = write_user_config(tmp_path, llama(), "llama.yaml", accelerator="cpu", devices=2)
    result = run_tool_here("plan", ["--config", config], tmp_path, monkeypatch)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    notes = [line for line in output.splitlines() if line.startswith(NOTE)]
    assert len(notes) == 1 and META_ITEM in notes[0], output[-3000:]
    assert "recommendation: ddp" in result.stdout


def _auto_config(folder: Path) -> Namespace:
    """The parsed config of a 2-process ``strategy: auto`` run of a Llama, as the CLI hands it to the planner."""
    config = write_user_config(folder, llama(), "auto.yaml", accelerator="cpu", devices=2, strategy="auto")
    return dict_to_namespace(yaml.safe_load(Path(config).read_text()))


@pytest.mark.parametrize("rank", ["0", "1"])
def test_strategy_auto_plans_a_hugging_face_model_and_rank_zero_says_so_once(tmp_path, monkeypatch, capsys, rank):
    from lightning_mlopt.cli.entry import MLOptCLI

    for variable in ("RANK", "SLURM_PROCID", "SLURM_NTASKS", "LOCAL_RANK"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("RANK", rank)  # as the launcher sets it for each process, before any Trainer
    cli = MLOptCLI.__new__(MLOptCLI)  # the planning step only reads the config it is given
    assert cli._plan_strategy(_auto_config(tmp_path)) == "ddp"  # a 107k-parameter model: the simplest fits
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "could not plan" not in out + err
    if rank == "1":
        assert out == "" and err == ""
        return
    notes = [line for line in out.splitlines() if "activations not measured" in line]
    assert notes == [
        f"strategy: auto: activations not measured: the model's training_step does not run on the meta device "
        f"({META_ITEM}); planned from parameters, gradients and optimizer state only"
    ]
    assert out.strip().splitlines()[-1] == "strategy: auto chose ddp"
