"""Messages name a setting the way the user set it: YAML keys under the CLI, constructor calls in a script."""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path

import pytest
import torch

from lightning_mlopt.callbacks import FaultTolerantCheckpoint, Tiers
from lightning_mlopt.checkpoint import CheckpointStore, Manifest
from lightning_mlopt.checkpoint.manifest import describe_files
from lightning_mlopt.checkpoint.resume import ResumingStrategy, choose_checkpoint
from lightning_mlopt.checkpoint.settings import CHECKPOINT
from lightning_mlopt.spelling import CLI_ENV, spelled_for_the_cli
from lightning_mlopt.strategies import LAYOUTS
from tests.conftest import CONFIGS

KNOWN = tuple(LAYOUTS.values())
DDP = ResumingStrategy("DDPStrategy", LAYOUTS["one file"], KNOWN)


@pytest.fixture(autouse=True)
def _unmarked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CLI_ENV, raising=False)  # this process is pytest's, not the CLI's


def test_a_setting_is_spelled_as_a_constructor_call_in_a_script_and_as_a_yaml_key_under_the_cli() -> None:
    assert CHECKPOINT.setting("resume.final", True) == "FaultTolerantCheckpoint(resume=Resume(final=True))"
    assert CHECKPOINT.setting("dirpath", "s3://b/p") == "FaultTolerantCheckpoint(dirpath='s3://b/p')"
    assert CHECKPOINT.setting("keep.monitor") == "FaultTolerantCheckpoint(keep=Keep(monitor=...))"
    with spelled_for_the_cli():
        assert os.environ[CLI_ENV] == "1"  # inherited by the ranks a launcher starts meanwhile
        assert CHECKPOINT.setting("resume.final", True) == "checkpoint.resume.final: true"
        assert CHECKPOINT.setting("preemption.deadline_s", None) == "checkpoint.preemption.deadline_s: null"
        assert CHECKPOINT.setting("dirpath") == "checkpoint.dirpath"
    assert CLI_ENV not in os.environ


def test_every_group_the_spelling_names_is_an_argument_of_the_callback() -> None:
    arguments = inspect.signature(FaultTolerantCheckpoint).parameters
    for group, class_name in CHECKPOINT.groups.items():
        assert arguments[group].annotation == class_name, group


def _commit_final(store: CheckpointStore, step: int) -> None:
    staging = store.stage(step)
    torch.save({"global_step": step, "state_dict": {}}, staging / "state.ckpt")
    manifest = Manifest(step=step, epoch=0, world_size=1, strategy="DDPStrategy", reason="final", layout="one file")
    manifest.files, manifest.final = describe_files(staging), True
    store.commit(staging, manifest)


def test_a_finished_run_says_how_to_train_on_as_the_user_would_write_it(tmp_path: Path, caplog) -> None:
    store = CheckpointStore(tmp_path / "checkpoints")
    _commit_final(store, 4)
    with caplog.at_level(logging.INFO):
        choose_checkpoint(store, DDP, False, resume_final=False)  # a plain Trainer's FaultTolerantCheckpoint
    assert "set FaultTolerantCheckpoint(resume=Resume(final=True))." in caplog.text
    assert "checkpoint.resume.final" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO), spelled_for_the_cli():
        choose_checkpoint(store, DDP, False, resume_final=False)
    assert "set checkpoint.resume.final: true." in caplog.text


def test_a_plain_trainer_relaunched_into_its_finished_run_is_told_the_constructor_call(tmp_path: Path, caplog) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    def fit() -> None:
        callback = FaultTolerantCheckpoint(dirpath=str(tmp_path / "ckpt"), async_save=False)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, default_root_dir=tmp_path, callbacks=[callback],
        )  # fmt: skip
        trainer.fit(BoringModel())

    fit()
    with caplog.at_level(logging.INFO):
        fit()
    assert "is marked final: this run already finished at step 2" in caplog.text
    assert "To train on (e.g. with a larger max_steps), set FaultTolerantCheckpoint(resume=Resume(final=True))." in (
        caplog.text
    )


def test_settings_refused_at_construction_are_named_as_written(tmp_path: Path, monkeypatch, capsys) -> None:
    with pytest.raises(ValueError, match=r"^FaultTolerantCheckpoint\(tiers=Tiers\(local_dirpath=\.\.\.\)\) sets the "):
        FaultTolerantCheckpoint(dirpath=str(tmp_path), tiers=Tiers(local_dirpath=str(tmp_path / "local")))
    with pytest.raises(ValueError, match=r"set FaultTolerantCheckpoint\(dirpath='s3://bucket/prefix'\), or remove"):
        FaultTolerantCheckpoint(tiers=Tiers(local_dirpath=str(tmp_path / "local")))
    # The CLI builds the same callback from YAML: its keys (exit 2 before anything runs); the mark goes with it.
    from lightning_mlopt.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), f"--checkpoint.tiers.local_dirpath={tmp_path}"])
    message = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "checkpoint.tiers.local_dirpath sets the local tier of an object store" in message
    assert "set checkpoint.dirpath: s3://bucket/prefix, or remove it" in message
    assert CLI_ENV not in os.environ
