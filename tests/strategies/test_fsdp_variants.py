"""FSDP's other knobs on 2 CPU processes: hybrid sharding, activation checkpointing, offload, mixed precision."""

from __future__ import annotations

import pytest
import torch

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
        ("--trainer.strategy.init_args.replicate_group_size=2",),
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
