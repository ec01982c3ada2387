"""The gradient and parameter pieces this rank holds, under any strategy, with how often each is replicated.

Dividing a piece's sum of squares by its replication (how many ranks hold the same piece) and summing over
all ranks gives the unsharded model's value with every parameter counted once: DDP replicates everything on
every rank, HSDP replicates each shard across the replica groups, FSDP and ZeRO partitions are disjoint. So
one all-reduce over the world serves every strategy.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


class Piece(NamedTuple):
    """A tensor this rank holds for one parameter, and on how many ranks the same piece lives.

    A NamedTuple, not a dataclass: one is made per parameter per step, and a tuple is the cheapest object.
    """

    param: nn.Parameter
    tensor: Tensor
    replication: int


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _dtensor_replication(tensor: DTensor) -> int:
    replication = 1
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            replication *= tensor.device_mesh.size(dim)
    return replication


def _zero_optimizer(strategy: Any) -> Any | None:
    """The ZeRO optimizer of a DeepSpeed engine, or None for other strategies."""
    engine = getattr(strategy, "model", None)
    optimizer = getattr(engine, "optimizer", None)
    return optimizer if hasattr(optimizer, "averaged_gradients") else None


def gradient_pieces(params: Sequence[nn.Parameter], strategy: Any) -> Iterator[Piece]:
    """Yield every gradient piece this rank holds (before the optimizer step) for ``params``.

    ``params`` is a list the caller keeps (walking ``module.parameters()`` each step costs more than the
    norms on a model of a few hundred tensors).

    DeepSpeed ZeRO keeps reduced gradients in its own partitions, not in ``param.grad``: they are read from
    the ZeRO optimizer (stage 1/2: ``params_in_partition`` aligned with ``averaged_gradients``; stage 3:
    ``fp16_groups``).
    """
    zero = _zero_optimizer(strategy)
    if zero is not None:
        owners: Any = getattr(zero, "params_in_partition", None) or getattr(zero, "fp16_groups", None)
        for group, grads in (zero.averaged_gradients or {}).items():
            for param, grad in zip(owners[group], grads, strict=False):
                if grad is not None:
                    yield Piece(param, grad, 1)
        return
    world = _world()
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            yield Piece(param, grad.to_local(), _dtensor_replication(grad))
        else:
            yield Piece(param, grad, world)  # DDP and single device: every rank holds the whole gradient


def parameter_pieces(params: Sequence[nn.Parameter]) -> Iterator[Piece]:
    """Yield every parameter piece this rank holds (its shard under FSDP and ZeRO-3)."""
    world = _world()
    for param in params:
        if isinstance(param, DTensor):
            yield Piece(param, param.to_local(), _dtensor_replication(param))
        elif (partition := getattr(param, "ds_tensor", None)) is not None:
            yield Piece(param, partition, 1)  # ZeRO-3 partition
        else:
            yield Piece(param, param.detach(), world)
