"""The package's one norm algorithm: sums of squares of sharded pieces, as if unsharded; and clipping by it.

Each rank computes the fp32 sum of squares of the pieces it holds (one fused ``_foreach_norm``), each divided
by its replication (see :mod:`lightning_mlopt.distributed.sharding`), and one all-reduce over the world sums
them: every parameter counted once, under any strategy. Where every rank holds the whole, identical gradient
(single device, DDP), the local sums are already the global ones: no weights, no collective.
GradNormMonitor, :func:`global_grad_norm` and our FSDP strategy's clipping all go through
:func:`sums_of_squares`.

Example::

    norm = global_grad_norm(model.parameters())  # DDP, FSDP, HSDP: plain tensors and DTensors
    norm = global_grad_norm(params, contract_of(trainer.strategy).sharding)  # any strategy, DeepSpeed ZeRO included
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mlopt._compat import foreach_mul_, foreach_norm
from lightning_mlopt.distributed.sharding import Sharding, TensorSharding, world_size


def sums_of_squares(
    tensors: list[Tensor],
    device: torch.device,
    weights: Tensor | None = None,
    group_index: Tensor | None = None,
    num_groups: int = 0,
) -> tuple[Tensor, Tensor]:
    """The total and per-group sums of squares of ``tensors``, in fp32, on ``device`` (not collective).

    Args:
        tensors: local pieces; empty ones (a rank's share of a small FSDP parameter) count 0.
        device: where the sums live.
        weights: one factor per tensor (1 / replication for sharded pieces); None: all 1.
        group_index: one group number per tensor, for the per-group sums; None: no per-group sums.
        num_groups: how many groups ``group_index`` numbers.

    Example::

        >>> pieces = [torch.tensor([3.0, 4.0]), torch.tensor([2.0])]
        >>> total, groups = sums_of_squares(pieces, torch.device("cpu"), group_index=torch.tensor([0, 1]), num_groups=2)
        >>> total.item(), groups.tolist()
        (29.0, [25.0, 4.0])

    """
    groups = torch.zeros(num_groups, device=device)
    if not tensors:
        return torch.zeros((), device=device), groups
    squares = torch.stack(foreach_norm(tensors, dtype=torch.float32)).to(device).pow_(2)
    if weights is not None:
        squares.mul_(weights)
    if group_index is not None:
        groups.index_add_(0, group_index, squares)
    return squares.sum(), groups


def global_grad_norm(parameters: Iterable[Tensor], sharding: Sharding | None = None) -> Tensor:
    """L2 norm of all gradients as if unsharded, accumulated in fp32 whatever the gradients' dtype.

    Args:
        parameters: the model's parameters (every rank the same list).
        sharding: what each rank holds (``strategies.contract.contract_of(trainer.strategy).sharding``); None: plain
            tensors and DTensors (``TensorSharding``).

    Collective unless every gradient is replicated: every rank must call it.

    """
    params = list(parameters)
    sharding = sharding or TensorSharding()
    if sharding.gradients_replicated(params):
        tensors = [p.grad for p in params if p.grad is not None]
        return sums_of_squares(tensors, tensors[0].device if tensors else torch.device("cpu"))[0].sqrt()
    pieces = list(sharding.gradient_pieces(params))
    device = pieces[0].tensor.device if pieces else torch.device("cpu")
    weights = None  # every piece held once (FSDP's full sharding): nothing to weigh
    if any(piece.replication != 1 for piece in pieces):
        # Built on the host, then copied without waiting: ``torch.tensor(..., device=cuda)`` synchronizes the
        # stream, a host stall on every clipped step (seen on an H200 under set_sync_debug_mode("error")).
        weights = torch.tensor([1.0 / piece.replication for piece in pieces]).to(device, non_blocking=True)
    total = sums_of_squares([piece.tensor for piece in pieces], device, weights)[0]
    if world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, sharding: Sharding | None = None) -> Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the pre-clip norm.

    Same rule as ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)``, capped at 1),
    for plain and sharded gradients alike (torch's fails on a mix of DTensors and plain tensors). ``sharding``
    as for :func:`global_grad_norm`.
    """
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params, sharding)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [piece.tensor for piece in TensorSharding().gradient_pieces(params)]
    for device_grads in _by_device(grads).values():
        foreach_mul_(device_grads, coefficient.to(device_grads[0].device))
    return norm


def _by_device(tensors: list[Tensor]) -> dict[torch.device, list[Tensor]]:
    grouped: dict[torch.device, list[Tensor]] = {}
    for tensor in tensors:
        grouped.setdefault(tensor.device, []).append(tensor)
    return grouped
