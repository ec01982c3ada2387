"""Any checkpoint resumes under any strategy at any world size: weights, optimizer state, LR schedule, data position.

Through the real CLI on CPU processes, each pair of the issue (44): ZeRO-2 (2) -> FSDP (2) -> ZeRO-1 (2), ZeRO-2 (2)
-> ZeRO-2 (1), ZeRO-3 (2) -> DDP (1) -> ZeRO-3 (2). Each resumed run's Adam moments, as its own strategy gathers
them (``tests/support/optimizer_state.py``), equal the source's at the saved step (a reset, or moments on the
wrong parameters, fails it); at the same world size the resumed losses are the uninterrupted run's. The ledger
tests resume 2 -> 1 and 1 -> 2 processes mid-epoch and check that every sample of the epoch is trained on once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import failure_report, run_cli, run_tool_here
from tests.support.cli_args import QUIET
from tests.support.ledger import read_ledger
from tests.support.recorders import read_records
from tests.support.strategy_runs import train

pytestmark = pytest.mark.multiprocess

SOURCE_STEPS = 6  # the uninterrupted ZeRO-2 run; checkpoints every 2 steps


def _fit(tmp: Path, name: str, strategy: str, devices: int, steps: int, *extra: str, dump: tuple[int, ...] = ()) -> str:
    """Fit the GPT demo under ``runs/<name>``, writing the optimizer state at the ``dump`` steps; what it said."""
    dumps: list[str] = []
    for step in dump:
        dumps += [
            "--trainer.callbacks+=tests.support.optimizer_state.DumpOptimizerState",
            f"--trainer.callbacks.out_dir={tmp / name}",
            f"--trainer.callbacks.at_step={step}",
        ]
    train(tmp, name, strategy, steps, devices, extra=("--checkpoint.every_n_steps=2", *dumps, *extra))
    return (tmp / name / "output.txt").read_text()


def _losses(tmp: Path, name: str) -> list[float]:
    return read_records(tmp / name)[0]["losses"]


def _step(tmp: Path, run: str, step: int) -> Path:
    return tmp / "runs" / run / "checkpoints" / f"step-{step:09d}"


def _assert_same_moments(resumed: Path, source: Path) -> None:
    got, want = torch.load(resumed), torch.load(source)
    assert set(got) == set(want) and len(want) == 53  # every parameter of the GPT demo
    for name, state in want.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].abs().sum() > 0, f"{name}.{key} is zero in the source: nothing would be shown"
            torch.testing.assert_close(got[name][key].view_as(state[key]), state[key], rtol=1e-5, atol=1e-9)


@pytest.fixture(scope="module")
def zero2_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted ZeRO-2 run on 2 processes, its optimizer state written at step 2."""
    tmp = tmp_path_factory.mktemp("conversion")
    _fit(tmp, "zero2", "zero2", 2, SOURCE_STEPS, dump=(2,))
    return tmp


def test_zero2_resumes_under_fsdp_then_zero1_with_its_moments_at_the_uninterrupted_loss(zero2_source: Path):
    tmp = zero2_source
    # To step 5, so that step 4's checkpoint is a mid-epoch one (a run's last save starts a new epoch on resume).
    said = _fit(tmp, "fsdp", "fsdp", 2, 5, f"--ckpt_path={_step(tmp, 'zero2', 2)}", dump=(2, 4))
    # Said once (rank zero), naming what was converted; the ZeRO run's folder is left as it was.
    assert said.count("is in ZeRO partitions; loading its one-file copy") == 1, said[-3000:]
    assert "optimizer state of 53 parameters (exp_avg, exp_avg_sq, step), 1 LR scheduler" in said
    assert (tmp / "runs" / "fsdp" / "checkpoints" / "converted" / "step-000000002" / "manifest.json").is_file()
    _assert_same_moments(tmp / "fsdp" / "optimizer-step2.pt", tmp / "zero2" / "optimizer-step2.pt")
    uninterrupted = _losses(tmp, "zero2")
    assert _losses(tmp, "fsdp") == pytest.approx(uninterrupted[2:5], abs=1e-5)

    # FSDP's own DCP checkpoint of step 4 under ZeRO-1: converted again, and on to the uninterrupted run's end.
    _fit(tmp, "zero1", "zero1", 2, SOURCE_STEPS, f"--ckpt_path={_step(tmp, 'fsdp', 4)}", dump=(4,))
    _assert_same_moments(tmp / "zero1" / "optimizer-step4.pt", tmp / "fsdp" / "optimizer-step4.pt")
    assert _losses(tmp, "zero1") == pytest.approx(uninterrupted[4:6], abs=1e-5)


def test_zero2_on_two_processes_resumes_as_zero2_on_one_by_auto_resume(zero2_source: Path):
    tmp = zero2_source
    run = tmp / "runs" / "zero2_on_one"
    shutil.copytree(_step(tmp, "zero2", 2), run / "checkpoints" / "step-000000002")  # the run, relaunched smaller
    said = _fit(tmp, "zero2_on_one", "zero2", 1, 3, dump=(2,))
    assert "is in ZeRO partitions; resuming from its one-file copy" in said, said[-3000:]
    assert "the epoch used 64 samples; each rank starts after its 64 (4 batches of this size)" in said, said[-2000:]
    _assert_same_moments(tmp / "zero2_on_one" / "optimizer-step2.pt", tmp / "zero2" / "optimizer-step2.pt")


def test_zero2_resumes_as_zero3_with_offload_at_the_same_world_size(zero2_source: Path):
    # DeepSpeed names stage 3's files per rank and stages 1/2's once: across that line it cannot load them itself.
    # Offloaded (parameters and optimizer state in CPU memory), the partitions are filled the same way.
    tmp = zero2_source
    said = _fit(tmp, "zero3_from_zero2", "zero3_offload", 2, 3, f"--ckpt_path={_step(tmp, 'zero2', 2)}", dump=(2,))
    assert "is in ZeRO partitions; loading its one-file copy" in said, said[-3000:]
    _assert_same_moments(tmp / "zero3_from_zero2" / "optimizer-step2.pt", tmp / "zero2" / "optimizer-step2.pt")
    assert _losses(tmp, "zero3_from_zero2") == pytest.approx(_losses(tmp, "zero2")[2:3], abs=1e-5)


def test_zero3_on_two_resumes_as_ddp_on_one_and_ddp_under_zero3_and_fsdp(tmp_path: Path):
    # The ZeRO-3 source splits each parameter group into partitions of 100k elements (sub_group_size): 5 of them.
    sub_groups = '--trainer.strategy.init_args.config={"zero_optimization": {"sub_group_size": 100000}}'
    _fit(tmp_path, "zero3", "zero3", 2, 2, sub_groups, dump=(2,))
    _fit(tmp_path, "ddp", "ddp", 1, 5, f"--ckpt_path={_step(tmp_path, 'zero3', 2)}", dump=(2, 4))
    _assert_same_moments(tmp_path / "ddp" / "optimizer-step2.pt", tmp_path / "zero3" / "optimizer-step2.pt")
    # DDP's one file under ZeRO-3 on two processes: loaded into the partitions as it is, no conversion.
    said = _fit(tmp_path, "zero3_again", "zero3", 2, 5, f"--ckpt_path={_step(tmp_path, 'ddp', 4)}", dump=(4,))
    assert "one-file copy" not in said
    _assert_same_moments(tmp_path / "zero3_again" / "optimizer-step4.pt", tmp_path / "ddp" / "optimizer-step4.pt")
    # And the DDP run relaunched under FSDP on two processes (auto-resume): the one file was once handed to
    # Lightning unloaded (fresh weights, zero moments). DDP numbers its optimizer state, and the demo's groups
    # (decayed weights, then the rest) are not in the module's order: matched through the live groups.
    shutil.copytree(_step(tmp_path, "ddp", 4), tmp_path / "runs" / "fsdp_from_ddp" / "checkpoints" / "step-000000004")
    _fit(tmp_path, "fsdp_from_ddp", "fsdp", 2, 5, dump=(4,))
    _assert_same_moments(tmp_path / "fsdp_from_ddp" / "optimizer-step4.pt", tmp_path / "ddp" / "optimizer-step4.pt")
    resumed = torch.load(tmp_path / "fsdp_from_ddp" / "start_params.pt")
    saved = torch.load(_step(tmp_path, "ddp", 4) / "state.ckpt", weights_only=False)["state_dict"]
    assert resumed["step"] == 4 and all(torch.equal(resumed["params"][k], saved[k]) for k in resumed["params"])


def test_checkpoint_convert_writes_a_verified_step_folder_and_refuses_a_corrupted_source(
    zero2_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    source = _step(zero2_source, "zero2", 2)
    converted = run_tool_here(
        "checkpoint", ["convert", str(source), str(tmp_path / "for-fsdp"), "--to", "fsdp"], tmp_path, monkeypatch
    )
    assert converted.returncode == 0, converted.stderr
    assert "ZeRO partitions of 2 rank(s) -> one file: 53 weights" in converted.stdout
    verified = run_tool_here("checkpoint", ["verify", str(tmp_path / "for-fsdp")], tmp_path, monkeypatch)
    assert verified.returncode == 0 and verified.stdout.startswith("OK"), verified.stdout
    full = torch.load(tmp_path / "for-fsdp" / "state.ckpt", weights_only=False)
    assert full["global_step"] == 2 and full["data_position"]["samples"] == 64

    damaged = tmp_path / "damaged"
    shutil.copytree(source, damaged)
    optimizer_file = next(damaged.rglob("zero_pp_rank_1_*optim_states.pt"))
    data = bytearray(optimizer_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    optimizer_file.write_bytes(bytes(data))
    refused = run_tool_here(
        "checkpoint", ["convert", str(damaged), str(tmp_path / "never"), "--to", "ddp"], tmp_path, monkeypatch
    )
    assert refused.returncode == 1 and "checksum" in refused.stderr, refused.stderr
    assert not (tmp_path / "never").exists()
    exists = run_tool_here("checkpoint", ["convert", str(source), str(tmp_path / "for-fsdp"), "--to", "ddp"], tmp_path,
                           monkeypatch)  # fmt: skip
    assert exists.returncode == 2 and "nothing is overwritten" in exists.stderr


LEDGER = [
    "fit", "--model=tests.support.ledger.LedgerModel", "--data=tests.support.ledger.LedgerData",
    "--trainer.accelerator=cpu", "--trainer.max_epochs=1", "--trainer.limit_val_batches=0",
    "--trainer.num_sanity_val_steps=0", "--checkpoint.every_n_steps=3", *QUIET,
]  # fmt: skip


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_mid_epoch_resume_at_another_world_size_trains_on_every_sample_once(tmp_path: Path, before, after):
    ledger, run = tmp_path / "ledger", tmp_path / "run"
    args = [*LEDGER, f"--model.out_dir={ledger}", f"--run_dir={run}"]
    first = run_cli([*args, f"--trainer.devices={before}", "--trainer.max_steps=4"], cwd=tmp_path, preloaded=True)
    assert first.returncode == 0, failure_report(first)
    # Killed after step 4 trained but before it was saved: the newest checkpoint is step 3, and step 4 is redone.
    shutil.rmtree(run / "checkpoints" / "step-000000004")
    for path in ledger.glob("ledger-rank*.txt"):
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
    second = run_cli([*args, f"--trainer.devices={after}"], cwd=tmp_path, preloaded=True)
    assert second.returncode == 0, failure_report(second)
    said = second.stderr + second.stdout
    assert f"Resuming mid-epoch with {after} data-parallel processes (saved by {before})" in said, said[-2000:]
    seen = read_ledger(ledger, epoch=0)
    assert sorted(seen) == list(range(64)), f"repeated or skipped: {sorted(seen)}"
