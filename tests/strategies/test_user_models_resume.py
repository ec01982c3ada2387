"""The Hugging Face Llama users bring, past the happy path: ZeRO-3, a preempted relaunch, ``checkpoint convert``.

Issue 58's last claims on the tiny Llama of ``tests/support/user_models.py`` (grouped-query attention, a
non-persistent rotary buffer): ZeRO-3 on 2 processes reaches the one-process result and checkpoints the model's
``state_dict()`` and nothing more; an FSDP run preempted by SIGTERM and relaunched with the same command ends
bitwise where the uninterrupted run ends; and ``checkpoint convert`` turns that run's DCP shards into one file
holding its final weights, which a fresh ``HFCausalLM`` loads strictly and DDP on one process trains on to the
uninterrupted run's result. Six launches in all, shared by the tests through one module fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_mlopt.checkpoint.layout import DCP_SHARDS, ONE_FILE
from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, Manifest
from lightning_mlopt.checkpoint.store import STATE_NAME, CheckpointStore
from tests.conftest import run_tool_here
from tests.strategies.test_user_models import (
    DATA_PARALLEL,
    LLAMA_LAYER,
    STEPS,
    WRAP,
    _assert_reaches,
    _checkpointed_names,
    _mean_losses,
    _Runs,
)
from tests.support.strategy_runs import TrainedRun, train
from tests.support.user_models import HFCausalLM, llama, write_user_config

EVERY_2 = "--checkpoint.every_n_steps=2"
SIGNALLED_AT = 3  # a step no save falls on: the checkpoint a relaunch resumes from is the signal's own
SIGNAL = ("--trainer.callbacks+=tests.support.faults.SignalAtStep", f"--trainer.callbacks.step={SIGNALLED_AT}")


class _Llama(_Runs):
    """The Llama's runs, launched on first use; ``config`` is the command-line start every run shares."""

    def __init__(self, root: Path) -> None:
        self.config = ("--config", write_user_config(root, llama(), "llama.yaml"))
        self.fsdp = (*self.config, *DATA_PARALLEL, f"{WRAP}[{LLAMA_LAYER}]", EVERY_2)
        super().__init__(root, {
            "one": ("ddp", 1, self.config),
            "zero3": ("zero3", 2, (*self.config, *DATA_PARALLEL)),
            "fsdp": ("fsdp", 2, self.fsdp),  # the uninterrupted run, saved every 2 steps
        })  # fmt: skip

    def relaunched(self) -> TrainedRun:
        """The FSDP run preempted at step 3 (exit 75), then launched again with the very same command."""
        if "relaunched" not in self:
            extra = (*self.fsdp, *SIGNAL)
            # The same call both times, so the relaunch is the same command line: the first one must fail.
            with pytest.raises(AssertionError, match=r"preempted failed \(exit 75\)"):
                train(self.root, "preempted", "fsdp", STEPS, extra=extra)
            checkpoints = self.root / "runs" / "preempted" / "checkpoints"
            self.saved_on_signal = [step for step, _ in CheckpointStore(checkpoints).committed()]
            self.newest_on_signal = CheckpointStore(checkpoints).newest_valid()
            self.params_on_signal = (self.root / "preempted" / "params.pt").exists()
            self["relaunched"] = train(self.root, "preempted", "fsdp", STEPS, extra=extra)
        return self["relaunched"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> _Llama:
    return _Llama(tmp_path_factory.mktemp("llama_resume"))


def _step(run: TrainedRun, step: int) -> Path:
    return run.run_dir / "checkpoints" / f"step-{step:09d}"


@pytest.mark.multiprocess
def test_a_hugging_face_llama_under_zero3_reaches_the_one_process_result_and_checkpoints_only_its_state(runs):
    _assert_reaches(runs["zero3"], runs["one"])
    names = _checkpointed_names(runs["zero3"])
    expected = set(HFCausalLM().state_dict())
    assert names == expected, sorted(names ^ expected)
    assert not [name for name in names if "rotary_emb" in name]


@pytest.mark.multiprocess
def test_a_preempted_fsdp_llama_relaunched_with_the_same_command_ends_bitwise_as_the_uninterrupted_run(runs):
    reference, relaunched = runs["fsdp"], runs.relaunched()
    # The signal's step was saved as a checkpoint of its own, in DCP shards, and the run stopped there.
    assert runs.saved_on_signal == [2, SIGNALLED_AT]
    newest = runs.newest_on_signal
    assert newest is not None and newest.step == SIGNALLED_AT
    assert newest.manifest.reason == "signal" and newest.manifest.layout == DCP_SHARDS
    assert any(newest.path.rglob("*.distcp")) and not newest.manifest.final
    assert not runs.params_on_signal, "the preempted launch finished its fit: nothing was interrupted"

    said = (runs.root / "preempted" / "output.txt").read_text()
    assert f"Auto-resuming from {_step(relaunched, SIGNALLED_AT)}" in said, said[-3000:]
    start = torch.load(runs.root / "preempted" / "start_params.pt")
    assert start["step"] == SIGNALLED_AT
    for rank, record in enumerate(relaunched.records):  # each rank's losses of the steps after the checkpoint
        assert record["losses"] == reference.records[rank]["losses"][SIGNALLED_AT:], f"rank {rank}"
    assert relaunched.params.keys() == reference.params.keys()
    differ = [name for name in reference.params if not torch.equal(relaunched.params[name], reference.params[name])]
    assert not differ, f"{len(differ)} parameters differ from the uninterrupted run, first {differ[:3]}"
    final = CheckpointStore(relaunched.run_dir / "checkpoints").newest_valid()
    assert final is not None and final.step == STEPS and final.manifest.final


def _convert(source: Path, output: Path, to: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """``checkpoint convert SOURCE OUTPUT --to TO`` as a user runs it; the one file it wrote, loaded."""
    done = run_tool_here("checkpoint", ["convert", str(source), str(output), "--to", to], cwd, monkeypatch)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resume it with --trainer.strategy={to}: --ckpt_path={output}" in done.stdout
    verified = run_tool_here("checkpoint", ["verify", str(output)], cwd, monkeypatch)
    assert verified.returncode == 0 and verified.stdout.startswith("OK"), verified.stdout
    assert Manifest.from_json((output / MANIFEST_NAME).read_bytes()).layout == ONE_FILE
    return torch.load(output / STATE_NAME, map_location="cpu", weights_only=False)


@pytest.mark.multiprocess
def test_checkpoint_convert_turns_the_llamas_fsdp_shards_into_one_file_that_ddp_trains_on(runs, tmp_path, monkeypatch):
    source = runs["fsdp"]
    final = _convert(_step(source, STEPS), tmp_path / "final", "ddp", tmp_path, monkeypatch)
    weights = final["state_dict"]
    # Exactly the model's state: the run's final parameters, bit for bit, and no rotary buffer.
    assert set(weights) == set(HFCausalLM().state_dict()), sorted(set(weights) ^ set(HFCausalLM().state_dict()))
    assert not [name for name in weights if "rotary_emb" in name]
    assert weights.keys() == source.params.keys()
    assert all(torch.equal(weights[name], source.params[name]) for name in weights), "a converted weight differs"
    assert final["global_step"] == STEPS
    fresh = HFCausalLM()
    fresh.load_state_dict(weights, strict=True)  # the user's own module takes it as it is
    assert all(torch.equal(p, source.params[name]) for name, p in fresh.named_parameters())

    # Step 4's shards, converted, resumed under DDP on one process: on to the uninterrupted run's end.
    middle = _convert(_step(source, 4), tmp_path / "middle", "ddp", tmp_path, monkeypatch)
    assert middle["global_step"] == 4 and "optimizer_states" in middle
    resumed = train(tmp_path, "ddp", "ddp", STEPS, devices=1,
                    extra=(*runs.config, f"--ckpt_path={tmp_path / 'middle'}"))  # fmt: skip
    said = (tmp_path / "ddp" / "output.txt").read_text()
    assert "Resuming mid-epoch with 1 data-parallel processes (saved by 2): the epoch used 32 samples" in said
    # The uninterrupted run's last two steps, its losses as the mean of its two ranks' (see _assert_reaches).
    torch.testing.assert_close(torch.tensor(resumed.records[0]["losses"]), _mean_losses(source)[4:], rtol=1e-4, atol=0)
    for name, value in source.params.items():
        torch.testing.assert_close(resumed.params[name], value, rtol=0, atol=1e-4, msg=name)
    newest = CheckpointStore(resumed.run_dir / "checkpoints").newest_valid()
    assert newest is not None and newest.step == STEPS and newest.manifest.layout == ONE_FILE
