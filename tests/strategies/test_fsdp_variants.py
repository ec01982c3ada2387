"""FSDP's other knobs on CPU processes: hybrid sharding, activation checkpointing, offload, mixed precision."""

from __future__ import annotations

import pytest
import torch

from lightning_mlopt.checkpoint.store import STATE_NAME
from tests.conftest import SHARED_RUN_CLIP, run_tool_here
from tests.support.strategy_runs import train

STEPS = 4


@pytest.fixture(scope="module")
def ddp_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    records = train(tmp_path_factory.mktemp("ddp"), "ddp", "ddp", STEPS).records
    return records[0]["losses"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "knobs",
    [
        # HSDP with 2 replicas of 1 shard each: replicate across "nodes", shard within.
        ("--trainer.strategy.init_args.replicate_size=2",),
        # Recompute each block's activations in backward: same numbers, less memory.
        ("--trainer.strategy.init_args.activation_checkpointing=[lightning_mlopt.demos.gpt.TransformerBlock]",),
        # Shard-grad-op behaviour and CPU offload of shards.
        ("--trainer.strategy.init_args.reshard_after_forward=false", "--trainer.strategy.init_args.cpu_offload=true"),
    ],
    ids=["hsdp", "activation_checkpointing", "no_reshard_cpu_offload"],
)
def test_fsdp_knob_trains_like_ddp(tmp_path, ddp_losses, knobs):
    records, params, _ = train(tmp_path, "fsdp", "fsdp", STEPS, extra=knobs)
    torch.testing.assert_close(torch.tensor(records[0]["losses"]), torch.tensor(ddp_losses), rtol=1e-4, atol=0)
    assert all(torch.isfinite(value).all() for value in params.values())


@pytest.mark.multiprocess
def test_fsdp_bf16_mixed_precision_trains(tmp_path, ddp_losses):
    knobs = ("--trainer.strategy.init_args.param_dtype=bfloat16", "--trainer.strategy.init_args.reduce_dtype=float32")
    records = train(tmp_path, "fsdp", "fsdp", STEPS, extra=knobs).records
    losses = records[0]["losses"]
    # bf16 compute: close to the fp32 curve, not equal (8 bits of mantissa).
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), rtol=2e-2, atol=0)
    assert losses[-1] < losses[0]


@pytest.mark.multiprocess
def test_hsdp_2x2_on_4_processes_reaches_the_one_process_result_and_converts_to_it(tmp_path, monkeypatch):
    """``configs/strategies/hsdp.yaml`` on 4 processes: 2 replicas x 2 shards, each rank a batch of 8; one process
    reads the same 32 samples a step (DistributedSampler's one permutation, split four ways), with the clip active at
    every step (the global norm over shards and replicas, each counted once). The HSDP checkpoint converts to one
    file, which one process resumes to the one-process run's end."""
    clip = SHARED_RUN_CLIP
    hsdp = train(tmp_path, "hsdp", "hsdp", STEPS, devices=4, extra=(clip, "--data.init_args.batch_size=8"))
    one = train(tmp_path, "one", "ddp", STEPS + 2, devices=1, extra=(clip, "--data.init_args.batch_size=32"))
    said = (tmp_path / "hsdp" / "output.txt").read_text()
    assert "hybrid sharding (HSDP): 2 replicas x 2 shards (replicate 2 x shard 2)" in said
    # Each rank's loss is its own batch's: their mean is the one process's loss over the same 32 samples.
    per_rank = torch.tensor([record["losses"] for record in hsdp.records])
    expected = torch.tensor(one.records[0]["losses"])
    torch.testing.assert_close(per_rank.mean(dim=0), expected[:STEPS], rtol=1e-5, atol=0)
    assert expected[-1] < expected[0], "the reference trained: agreeing on doing nothing proves nothing"
    assert hsdp.params.keys() == one.params.keys()

    # The sharded checkpoint as one file (the layout DDP reads), weights bit for bit; one process trains on.
    source = hsdp.run_dir / "checkpoints" / f"step-{STEPS:09d}"
    converted = run_tool_here("checkpoint", ["convert", str(source), str(tmp_path / "one-file"), "--to", "ddp"],
                              tmp_path, monkeypatch)  # fmt: skip
    assert converted.returncode == 0, converted.stdout + converted.stderr
    weights = torch.load(tmp_path / "one-file" / STATE_NAME, map_location="cpu", weights_only=False)["state_dict"]
    assert weights.keys() == hsdp.params.keys()
    assert all(torch.equal(weights[name], hsdp.params[name]) for name in weights), "a converted weight differs"
    resumed = train(tmp_path, "resumed", "ddp", STEPS + 2, devices=1,
                    extra=(clip, "--data.init_args.batch_size=32", f"--ckpt_path={tmp_path / 'one-file'}"))  # fmt: skip
    torch.testing.assert_close(torch.tensor(resumed.records[0]["losses"]), expected[STEPS:], rtol=1e-5, atol=0)
    for name, value in one.params.items():
        torch.testing.assert_close(resumed.params[name], value, rtol=0, atol=1e-5, msg=name)
