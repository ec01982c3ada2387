"""validate / test / predict from our checkpoints: a step folder, a checkpoints folder, ``last``; every strategy.

The model is a user's (tests.support.models.ThirdPartyLM: its own dataloaders, no datamodule), not one of our demos.
"""

from __future__ import annotations

import pytest

from lightning_mlopt.checkpoint import STATE_NAME, CheckpointStore
from tests.conftest import failure_report, run_cli
from tests.support.cli_args import QUIET


def _run(tmp_path, subcommand: str, strategy: str, *extra: str):  # type: ignore[no-untyped-def]
    return run_cli(
        [
            subcommand,
            "--model=tests.support.models.ThirdPartyLM",
            f"--trainer.strategy={strategy}",  # a short name: the overlays name our demo's block classes
            "--trainer.accelerator=cpu",
            "--trainer.devices=2",
            "--trainer.limit_val_batches=2",
            "--trainer.limit_test_batches=2",
            "--trainer.limit_predict_batches=2",
            f"--run_dir={tmp_path / 'run'}",
            *QUIET,
            *extra,
        ],
        cwd=tmp_path,
        preloaded=True,
    )


@pytest.mark.multiprocess
# One strategy per checkpoint layout (one file, DCP shards, ZeRO partitions): ZeRO-1 and -2 write the same
# partitioned layout as ZeRO-3 through the same code, and the suite's time budget is spent where paths differ.
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_evaluate_from_a_step_folder_and_a_checkpoints_folder(tmp_path, strategy):
    trained = _run(tmp_path, "fit", strategy, "--trainer.max_steps=2", "--trainer.num_sanity_val_steps=0")
    assert trained.returncode == 0, failure_report(trained)
    checkpoints = tmp_path / "run" / "checkpoints"
    entry = CheckpointStore(checkpoints).newest_valid()
    assert entry is not None and entry.step == 2
    state = entry.path / STATE_NAME
    # DDP gave IsADirectoryError, FSDP "not a valid checkpoint", ZeRO-3 a TypeError inside DeepSpeed on CPU.
    # validate loads each layout; test and predict load the same way (once each is enough), and they name the
    # checkpoint differently: a checkpoints folder, and Lightning's "last".
    cases = [("validate", str(entry.path))]
    if strategy == "ddp":
        cases.append(("test", str(checkpoints)))
    if strategy == "zero3":
        cases.append(("predict", "last"))
    for subcommand, ckpt_path in cases:
        result = _run(tmp_path, subcommand, strategy, f"--ckpt_path={ckpt_path}")
        assert result.returncode == 0, f"{subcommand} {ckpt_path}:\n{failure_report(result)}"
        output = result.stdout + result.stderr
        assert f"ckpt_path: {entry.path} (step 2, saved by " in output and "verified" in output
        assert f"Restoring states from the checkpoint path at {state}" in output
        if subcommand != "predict":
            assert {"validate": "val_loss", "test": "test_loss"}[subcommand] in output


def test_a_step_folder_that_fails_verification_is_refused_before_loading(tmp_path):
    from lightning_mlopt.checkpoint.locate import resolve_checkpoint_path
    from lightning_mlopt.exceptions import BadInputError

    folder = tmp_path / "checkpoints" / "step-000000002"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{not json")

    with pytest.raises(BadInputError, match=r"step-000000002 failed verification .*nothing was loaded"):
        resolve_checkpoint_path(str(folder), None)
    with pytest.raises(BadInputError, match=r"no checkpoint in .* verifies"):
        resolve_checkpoint_path(str(tmp_path / "checkpoints"), None)
    assert resolve_checkpoint_path("last", tmp_path / "elsewhere") == ("last", None), "Lightning's own meaning"
