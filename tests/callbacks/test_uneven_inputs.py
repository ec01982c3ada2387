"""UnevenInputs through the real CLI on 2 CPU processes: ranks whose data differs in length end together.

An IterableDataset gives rank 0 ten training batches and rank 1 six, and four and two validation batches
(under ``limit_val_batches=4``, which gives Lightning a count that is not the data's): without the callback
DDP hangs and FSDP crashes; with it (on by default in the CLI) every rank ends each epoch at rank 1's last
batch, 2 epochs make 12 steps on every rank, and one line per loop names rank 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_mlopt.callbacks.uneven_inputs import EarlyEnd
from lightning_mlopt.checkpoint import CheckpointStore
from tests.conftest import failure_report, run_cli
from tests.support.cli_args import fit_args
from tests.support.recorders import read_records


def _fit(tmp_path: Path, run: str, out: str, *extra: str, strategy: str = "ddp"):  # type: ignore[no-untyped-def]
    """The GPT demo on UnevenTokens (2 CPU processes), recording each rank's losses into ``tmp_path/out``.

    A regression would hang: NCCLHealthCheck's watchdog bounds it (exit 124 instead of the test's timeout).
    """
    return run_cli(
        fit_args(
            "--data=tests.support.uneven.UnevenTokens",
            "--trainer.max_epochs=2",
            "--trainer.callbacks+=tests.support.recorders.RecordEverything",
            f"--trainer.callbacks.out_dir={tmp_path / out}",
            "--trainer.callbacks+=lightning_mlopt.callbacks.NCCLHealthCheck",
            "--trainer.callbacks.watchdog.timeout=60",
            *extra,
            strategy=strategy,
            run_dir=tmp_path / run,
        ),
        cwd=tmp_path,
        preloaded=True,
        timeout=240,
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_uneven_training_and_validation_data_end_every_epoch_together(tmp_path, strategy):
    out, run_dir = tmp_path / "records", tmp_path / "run"
    extra = ("--trainer.val_check_interval=null", "--trainer.num_sanity_val_steps=0")
    result = _fit(tmp_path, "run", "records", *extra, strategy=strategy)
    assert result.returncode == 0, failure_report(result)
    records = read_records(out)
    assert [len(record["losses"]) for record in records] == [12, 12], "6 steps an epoch on every rank"
    newest = CheckpointStore(run_dir / "checkpoints").newest_valid()
    assert newest is not None and newest.step == 12
    printed = result.stdout + result.stderr
    for epoch in (0, 1):
        assert (
            f"UnevenInputs: train epoch {epoch} ended on every rank after 6 batches: the data of rank 1 ran out "
            "there, and the others stopped with it, leaving unused rank 0: at least 1 (its loader has no length)"
        ) in printed
        assert (
            f"UnevenInputs: validate epoch {epoch} ended on every rank after 2 batches: the data of rank 1" in printed
        )
    assert printed.count("UnevenInputs:") == 4, "one line a loop"


@pytest.mark.multiprocess
def test_loaders_of_known_unequal_lengths_end_together_and_validate_at_the_same_batch(tmp_path):
    # Map-style datasets of 10 and 6 batches, no DistributedSampler: Lightning knows each rank's length, and
    # would validate at each rank's own last batch (10 and 6) with the default val_check_interval of 1.0.
    out = tmp_path / "records"
    sized = ("--data.sized=true", "--trainer.use_distributed_sampler=false", "--trainer.num_sanity_val_steps=0")
    result = _fit(tmp_path, "run", "records", *sized, "--trainer.val_check_interval=1.0")
    assert result.returncode == 0, failure_report(result)
    assert [len(record["losses"]) for record in read_records(out)] == [12, 12]
    printed = result.stdout + result.stderr
    assert "train epoch 1 ended on every rank after 6 batches: the data of rank 1 ran out there, and the " in printed
    assert "leaving unused rank 0: 4 batches." in printed  # a length: the count is known
    assert "validate epoch 1 ended on every rank after 2 batches" in printed  # validation ran on both, together


@pytest.mark.multiprocess
def test_a_run_resumed_mid_epoch_still_ends_the_epoch_together(tmp_path):
    # Lengths 10 and 6, a checkpoint every 3 steps; then a run resumed from step 9 (epoch 1, batch 3), where
    # Lightning calls no on_train_epoch_start: it still ends epoch 1 at rank 1's last batch on both ranks.
    sized = ("--data.sized=true", "--trainer.use_distributed_sampler=false", "--trainer.limit_val_batches=0")
    first = _fit(tmp_path, "run", "first", *sized, "--checkpoint.every_n_steps=3", "--checkpoint.keep.last=10")
    assert first.returncode == 0, failure_report(first)
    step_9 = tmp_path / "run" / "checkpoints" / "step-000000009"
    second = _fit(tmp_path, "resumed", "second", *sized, f"--ckpt_path={step_9}")
    assert second.returncode == 0, failure_report(second)
    assert [len(record["losses"]) for record in read_records(tmp_path / "second")] == [3, 3], "steps 10 to 12"
    assert "train epoch 1 ended on every rank after 6 batches" in second.stdout + second.stderr


def test_the_line_counts_what_sized_loaders_left_and_names_every_short_rank():
    early = EarlyEnd("train", 3, 40, (1, 2), {0: 8, 3: 1})
    assert early.describe().startswith(
        "UnevenInputs: train epoch 3 ended on every rank after 40 batches: the data of ranks 1, 2 ran out there, "
        "and the others stopped with it, leaving unused rank 0: 8 batches; rank 3: 1 batch. Give every rank"
    )
    assert "drop_last=True" in early.describe() and "\n" not in early.describe()
