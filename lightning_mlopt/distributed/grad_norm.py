"""The global gradient norm of a model whose gradients may be sharded (FSDP2 DTensors) or plain, and clipping.

One fused ``_foreach_norm`` per group of like-sharded gradients and one all-reduce per sharded mesh
dimension: N gradients cost a handful of kernels and collectives, not N.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


def global_grad_norm(parameters: Iterable[Tensor]) -> Tensor:
    """L2 norm of all gradients as if unsharded, accumulated in fp32 whatever the gradients' dtype.

    Collective where gradients are DTensors: every rank must call it with the same parameters.

    Example::

        norm = global_grad_norm(model.parameters())  # a 0-dim fp32 tensor on the gradients' device
    """
    # Gradients sharded the same way share one fused norm and one all-reduce per sharded mesh dimension.
    groups: dict[tuple[int, str] | None, list[Tensor]] = {}
    reduce_over: dict[tuple[int, str] | None, list[dist.ProcessGroup]] = {None: []}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        key: tuple[int, str] | None = None
        local = grad
        if isinstance(grad, DTensor):
            key = (id(grad.device_mesh), repr(grad.placements))
            reduce_over[key] = [
                grad.device_mesh.get_group(dim)
                for dim, placement in enumerate(grad.placements)
                if placement.is_shard() or placement.is_partial()
            ]
            local = grad.to_local()
        groups.setdefault(key, []).append(local)
    total = torch.zeros(())
    for key, grads in groups.items():
        nonempty = [g for g in grads if g.numel()]
        squares = torch.zeros((), device=grads[0].device)
        if nonempty:
            squares = torch.stack(torch._foreach_norm(nonempty, 2.0, dtype=torch.float32)).pow(2).sum()
        for group in reduce_over[key]:
            dist.all_reduce(squares, group=group)
        total = squares + total.to(squares.device)
    return total.sqrt()


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float) -> Tensor:
    """Scale gradients in place so their global norm is at most ``max_norm``; return the pre-clip norm.

    Same rule as ``torch.nn.utils.clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)``, capped at 1),
    for plain and sharded gradients alike.
    """
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    for device_grads in _by_device(grads).values():
        torch._foreach_mul_(device_grads, coefficient.to(device_grads[0].device))
    return norm


def _by_device(tensors: list[Tensor]) -> dict[torch.device, list[Tensor]]:
    grouped: dict[torch.device, list[Tensor]] = {}
    for tensor in tensors:
        grouped.setdefault(tensor.device, []).append(tensor)
    return grouped
