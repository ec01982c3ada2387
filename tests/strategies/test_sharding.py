"""Which pieces each strategy says a rank holds; the fallback for strategies that are not ours; packed slots."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy as LightningDDP
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeed
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_mlopt.distributed.grad_norm import global_grad_norm
from lightning_mlopt.distributed.packed import Packed
from lightning_mlopt.distributed.sharding import PipelineSharding, Sharding, TensorSharding
from lightning_mlopt.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from lightning_mlopt.strategies.contract import contract_of
from lightning_mlopt.strategies.deepspeed.zero_sharding import ZeroSharding


def sharding_of(strategy):  # type: ignore[no-untyped-def]
    return contract_of(strategy).sharding


def test_ours_declare_and_others_get_the_documented_fallback():
    assert isinstance(sharding_of(DDPStrategy()), TensorSharding)
    assert isinstance(sharding_of(FSDPStrategy()), TensorSharding)
    assert isinstance(sharding_of(DeepSpeedStrategy()), ZeroSharding)
    assert isinstance(sharding_of(LightningDeepSpeed()), ZeroSharding)  # Lightning's own: read through ZeRO
    assert isinstance(sharding_of(LightningDDP()), TensorSharding)
    assert isinstance(sharding_of(SingleDeviceStrategy(device=torch.device("cpu"))), TensorSharding)
    for strategy in (DDPStrategy(), DeepSpeedStrategy()):
        assert isinstance(sharding_of(strategy), Sharding)
    assert not sharding_of(DeepSpeedStrategy()).can_skip_step and sharding_of(DDPStrategy()).can_skip_step


def test_a_strategy_that_declares_its_own_sharding_is_asked():
    class Halves(TensorSharding):
        def gradient_pieces(self, params):  # pretend each rank holds half of every gradient, disjointly
            return (
                piece._replace(tensor=piece.tensor[: piece.tensor.numel() // 2], replication=1)
                for piece in super().gradient_pieces(params)
            )

        def gradients_replicated(self, params):
            return False

    class Custom(SingleDeviceStrategy):
        sharding = Halves()

    assert isinstance(sharding_of(Custom(device=torch.device("cpu"))), Halves)
    weight = torch.nn.Parameter(torch.zeros(4))
    weight.grad = torch.tensor([3.0, 4.0, 100.0, 100.0])
    assert global_grad_norm([weight], Halves()).item() == pytest.approx(5.0)  # one process: its half only
    assert global_grad_norm([weight]).item() == pytest.approx(float(weight.grad.norm()))


def test_a_piece_held_by_several_ranks_counts_once_in_the_norm():
    class HeldTwice(TensorSharding):  # HSDP-like: the first gradient replicated on 2 ranks, the second held once
        def gradient_pieces(self, params):
            pieces = list(super().gradient_pieces(params))
            return [pieces[0]._replace(replication=2), pieces[1]]

        def gradients_replicated(self, params):
            return False

    twice, once = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    twice.grad, once.grad = torch.tensor([6.0, 8.0]), torch.tensor([2.0])
    # One process holds its copy of `twice`: half of it (100 / 2) belongs to this rank's sum, plus 4.
    assert global_grad_norm([twice, once], HeldTwice()).item() == pytest.approx((100 / 2 + 4) ** 0.5)


def test_packed_slots_are_read_back_by_name_and_checked():
    packed = Packed()
    packed.add("a", torch.tensor(1.0))
    packed.add("b", torch.tensor([2.0, 3.0], dtype=torch.bfloat16))
    assert "b" in packed and "c" not in packed
    vector = packed.tensor(torch.device("cpu"))
    assert vector.dtype == torch.float32
    assert packed.unpack((vector * 2).tolist()) == {"a": [2.0], "b": [4.0, 6.0]}
    with pytest.raises(ValueError, match="added twice"):
        packed.add("a", torch.tensor(0.0))
    with pytest.raises(ValueError, match="4 values for 3 slots"):
        packed.unpack([0.0] * 4)


def test_pipeline_stages_compare_nothing_alone_and_leave_out_local_statistics_by_name():
    # What torch.export leaves of a BatchNorm in a stage: its buffers on a plain module, no BatchNorm to tell them.
    stage = torch.nn.Module()
    stage.norm = torch.nn.Module()
    stage.norm.register_buffer("running_mean", torch.zeros(4))
    stage.norm.register_buffer("mask", torch.ones(4))
    sharding = PipelineSharding(pipeline_parallel_size=2)
    sharding.local_statistics = frozenset({"norm.running_mean"})
    assert [buffer.name for buffer in sharding.compared_buffers(stage)] == ["norm.mask"]
    nothing = sharding.replicas(stage, [])  # no stage group: a stage's ranks hold nothing alike (no TP)
    assert nothing.replicas == [] and nothing.process_group is None
    assert nothing.description.startswith("nothing (pipeline stages")


def test_the_scale_zeros_gradients_still_carry_is_the_fp16_engines_loss_scale_and_none_elsewhere():
    from types import SimpleNamespace

    from lightning_mlopt.strategies.deepspeed.zero_sharding import ZeroSharding

    def engine(fp16: bool, scale: float | None) -> SimpleNamespace:
        return SimpleNamespace(fp16_enabled=lambda: fp16, optimizer=SimpleNamespace(loss_scale=scale))

    assert ZeroSharding(SimpleNamespace(model=engine(True, 4096.0))).gradient_scale() == 4096.0
    assert ZeroSharding(SimpleNamespace(model=engine(False, 4096.0))).gradient_scale() is None  # bf16, fp32
    assert ZeroSharding(SimpleNamespace(model=engine(True, None))).gradient_scale() is None  # a static scale off
    assert ZeroSharding(SimpleNamespace(model=None)).gradient_scale() is None  # before the engine is built
    assert TensorSharding().gradient_scale() is None  # AMP unscales before the hooks
