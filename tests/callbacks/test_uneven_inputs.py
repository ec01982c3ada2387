"""UnevenInputs through the real CLI on 2 CPU processes: ranks whose data differs in length end together.

An IterableDataset gives rank 0 ten training batches and rank 1 six, and four and two validation batches
(under ``limit_val_batches=4``, which gives Lightning a count that is not the data's): without the callback
DDP hangs and FSDP crashes; with it (on by default in the CLI) every rank ends each epoch at rank 1's last
batch, 2 epochs make 12 steps on every rank, and one line per loop names rank 1.
"""

from __future__ import annotations

import pytest

from lightning_mlopt.callbacks.uneven_inputs import EarlyEnd
from lightning_mlopt.checkpoint import CheckpointStore
from tests.conftest import failure_report, run_cli
from tests.support.cli_args import fit_args
from tests.support.helpers import read_records


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2"])
def test_uneven_training_and_validation_data_end_every_epoch_together(tmp_path, strategy):
    out, run_dir = tmp_path / "records", tmp_path / "run"
    result = run_cli(
        fit_args(
            "--data=tests.support.uneven.UnevenTokens",
            "--trainer.max_epochs=2",
            "--trainer.val_check_interval=null",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.callbacks+=tests.support.helpers.RecordEverything",
            f"--trainer.callbacks.out_dir={out}",
            # A regression would hang: the watchdog bounds it (exit 124 instead of the test's timeout).
            "--trainer.callbacks+=lightning_mlopt.callbacks.NCCLHealthCheck",
            "--trainer.callbacks.watchdog.timeout=60",
            strategy=strategy,
            run_dir=run_dir,
        ),
        cwd=tmp_path,
        timeout=240,
    )
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


def test_the_line_counts_what_sized_loaders_left_and_names_every_short_rank():
    early = EarlyEnd("train", 3, 40, (1, 2), {0: 8, 3: 1})
    assert early.describe().startswith(
        "UnevenInputs: train epoch 3 ended on every rank after 40 batches: the data of ranks 1, 2 ran out there, "
        "and the others stopped with it, leaving unused rank 0: 8 batches; rank 3: 1 batch. Give every rank"
    )
    assert "drop_last=True" in early.describe() and "\n" not in early.describe()
