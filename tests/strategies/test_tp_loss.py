"""The loss on vocabulary-split logits (``loss_parallel`` plan styles), in this process on a one-rank mesh.

A one-rank mesh runs the same DTensor code as a larger one (the split, the custom loss ops, their backward);
that the pieces add up across ranks is shown by the ``tp_sp`` run of test_tensor_parallel.py, whose plan
leaves the LM head's logits split into the loss and which trains as one process does.
"""

from __future__ import annotations

from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn import functional

from lightning_mlopt.strategies import TensorParallelStrategy
from lightning_mlopt.strategies.tensor.tp_loss import split_logits_loss
from lightning_mlopt.strategies.tensor.tp_plan import STYLES, resolve


@pytest.fixture
def mesh(tmp_path) -> Iterator[DeviceMesh]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_the_loss_on_split_logits_is_a_plain_tensor_with_the_plain_value_and_gradient(mesh):
    torch.manual_seed(0)
    logits = torch.randn(6, 10, 32, requires_grad=True)
    targets = torch.randint(0, 32, (6, 10))
    expected = functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    (expected_grad,) = torch.autograd.grad(expected, logits)

    split = distribute_tensor(logits.detach(), mesh, [Shard(-1)]).requires_grad_()
    with split_logits_loss():
        loss = functional.cross_entropy(split.flatten(0, 1), targets.flatten())
        loss.backward()
    assert type(loss) is torch.Tensor, "Lightning's logging and loss bookkeeping take plain tensors only"
    torch.testing.assert_close(loss, expected)
    assert isinstance(split.grad, DTensor) and split.grad.placements == (Shard(2),)
    torch.testing.assert_close(split.grad.full_tensor(), expected_grad)

    with split_logits_loss():  # nn.CrossEntropyLoss calls the same function; a plain input is left alone
        assert type(nn.CrossEntropyLoss()(split.flatten(0, 1), targets.flatten())) is torch.Tensor
        assert type(functional.cross_entropy(logits.flatten(0, 1), targets.flatten())) is torch.Tensor
    with pytest.raises(RuntimeError, match=r"mixed torch\.Tensor and DTensor"):  # what a model meets without it
        functional.cross_entropy(split.flatten(0, 1), targets.flatten())


def test_a_loss_parallel_lm_head_leaves_its_logits_split(mesh):
    head = nn.Sequential(nn.Linear(8, 32, bias=False))
    plan = resolve(head, {"0": "loss_parallel"}, 1)
    assert plan.splits_logits and not resolve(head, {"0": "colwise_replicated"}, 1).splits_logits
    parallelize_module(head, mesh, plan.parallelize_plan())
    logits = head(torch.randn(4, 5, 8))
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
    assert {name for name, style in STYLES.items() if style.splits_logits} == {
        "loss_parallel",
        "loss_parallel_from_sequence",
    }


class _Head(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(8, 32, bias=False)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        logits = self.lm_head(batch)
        return {"tokens": logits.argmax(dim=-1), "logits": logits}


def test_a_prediction_made_from_split_logits_is_handed_over_whole(mesh):
    torch.manual_seed(0)
    module, batch = _Head(), torch.randn(4, 5, 8)
    expected = module.lm_head(batch).detach()
    parallelize_module(module, mesh, resolve(module, {"lm_head": "loss_parallel"}, 1).parallelize_plan())
    strategy = TensorParallelStrategy(tensor_parallel_size=1)
    strategy.connect(module)  # what the Trainer does first, without the rest of its setup
    with torch.no_grad():
        prediction = strategy.predict_step(batch, 0)
    assert type(prediction["logits"]) is torch.Tensor and type(prediction["tokens"]) is torch.Tensor
    torch.testing.assert_close(prediction["logits"], expected)
    assert torch.equal(prediction["tokens"], expected.argmax(dim=-1))


def test_the_strategys_loss_context_nests_as_manual_backward_needs(mesh):
    # manual_backward calls the strategy's backward inside its training_step: torch's own context cannot nest
    # (its exit removes handlers the outer exit removes again, a KeyError).
    torch.manual_seed(0)
    strategy = TensorParallelStrategy(tensor_parallel_size=1)
    head = nn.Sequential(nn.Linear(8, 32, bias=False))
    plan = resolve(head, {"0": "loss_parallel"}, 1)
    parallelize_module(head, mesh, plan.parallelize_plan())
    strategy._splits_logits = plan.splits_logits  # what sharding sets
    targets = torch.randint(0, 32, (4,))
    with strategy._loss_context():  # training_step
        loss = functional.cross_entropy(head(torch.randn(4, 8)), targets)
        with strategy._loss_context():  # manual_backward -> backward
            loss.backward()
    assert type(loss) is torch.Tensor and head[0].weight.grad is not None
