"""See through sharding: the full parameters of a model, and the bytes of state this rank holds.

Works for plain modules, DDP, FSDP2 (DTensor parameters) and DeepSpeed ZeRO 1-3 (partitioned flat buffers),
so tests, benchmarks and the memory planner measure every strategy the same way.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def _local(tensor: Tensor) -> Tensor:
    """Return the rank-local storage of a tensor: the local shard of a DTensor, the partition of a ZeRO-3 parameter."""
    if isinstance(tensor, DTensor):
        return tensor.to_local()
    partition = getattr(tensor, "ds_tensor", None)
    return partition if partition is not None else tensor


def _held(tensor: Tensor) -> Iterator[Tensor]:
    """The plain tensors that hold ``tensor``'s bytes on this rank.

    A wrapper subclass (torchao's float8 weights under FSDP's float8 all-gather) has no storage of its own: its
    inner tensors (``__tensor_flatten__``, the protocol of traceable subclasses) hold the bytes.
    """
    local = _local(tensor)
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is None or isinstance(local, DTensor):
        yield local
        return
    names, _ = flatten()
    for name in names:
        yield from _held(getattr(local, name))


def _nbytes(tensors: Iterable[Any]) -> int:
    seen: set[int] = set()
    total = 0
    for local in (held for tensor in tensors if isinstance(tensor, Tensor) for held in _held(tensor)):
        # Count shared storage once (ZeRO's flat buffers are viewed by many parameters).
        key = local.untyped_storage().data_ptr() if local.numel() else id(local)
        if key in seen and key != 0:
            continue
        seen.add(key)
        total += local.untyped_storage().nbytes() if local.numel() else 0
    return total


def full_parameters(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter of ``module`` unsharded, detached, on CPU, by name.

    Collective under FSDP and ZeRO-3: every rank must call it (each rank gets the full result).

    Example::

        params = full_parameters(trainer.strategy.model)  # DDP, FSDP and DeepSpeed alike
    """
    named = dict(module.named_parameters())
    zero3 = [p for p in named.values() if hasattr(p, "ds_id")]
    if zero3:
        import deepspeed

        context: Any = deepspeed.zero.GatheredParameters(zero3, modifier_rank=None)
    else:
        context = nullcontext()
    with context, torch.no_grad():
        full = {
            _strip_wrapper_prefix(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in named.items()
        }
    return gathered_over_pipeline(module, full)


def gathered_over_pipeline(module: nn.Module, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` (by parameter name, on CPU) merged with the other pipeline stages' when ``module`` is a stage.

    Collective over the pipeline when it is one (every rank of it must call); else ``tensors`` as they are.

    Example::

        gradients = gathered_over_pipeline(pl_module, {name: p.grad.cpu() for name, p in named})
    """
    group = _PIPELINE_GROUPS.get(module)
    if group is None:
        return tensors
    import torch.distributed as dist

    stages: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(stages, tensors, group=group)
    return {name: tensor for stage in stages for name, tensor in stage.items()}


_PIPELINE_GROUPS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def register_pipeline_stage(module: nn.Module, group: Any) -> None:
    """``module`` holds this rank's pipeline stages; ``group`` the ranks holding the others (one pipeline).

    :func:`full_parameters` then gathers the whole model's parameters over that group.
    """
    _PIPELINE_GROUPS[module] = group


def _strip_wrapper_prefix(name: str) -> str:
    """Parameter names as the plain module has them (DDP and DeepSpeed add ``module.``)."""
    return name.removeprefix("module.")


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state held by one rank.

    Attributes:
        parameters: the model parameters this rank stores (its shard under FSDP/ZeRO-3).
        gradients: gradients held at the time of measuring (ZeRO-2/3 partitions included).
        optimizer_state: optimizer moments and counters (e.g. Adam's ``exp_avg``, ``exp_avg_sq``).
        master_weights: fp32 copies of the parameters kept by the optimizer (DeepSpeed keeps them even in fp32).

    """

    parameters: int
    gradients: int
    optimizer_state: int
    master_weights: int

    @property
    def total(self) -> int:
        """All four together."""
        return self.parameters + self.gradients + self.optimizer_state + self.master_weights


def local_state_bytes(module: nn.Module, optimizer: Any) -> StateBytes:
    """Measure the parameter, gradient and optimizer bytes this rank holds (not collective)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    inner = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer  # unwrap Lightning's
    masters = [
        *getattr(inner, "single_partition_of_fp32_groups", []),  # ZeRO-1/2
        *getattr(inner, "fp32_partitioned_groups_flat", []),  # ZeRO-3
    ]
    torch_optimizer = inner
    while not isinstance(torch_optimizer, torch.optim.Optimizer) and hasattr(torch_optimizer, "optimizer"):
        torch_optimizer = torch_optimizer.optimizer  # a ZeRO optimizer wraps the torch one
    state_tensors = [value for state in torch_optimizer.state.values() for value in state.values()]
    gradients: list[Any] = [p.grad for p in module.parameters() if p.grad is not None]
    gradients += [m.grad for m in masters if m.grad is not None]
    averaged = getattr(inner, "averaged_gradients", {}) or {}
    gradients += [g for group in averaged.values() for g in (group if isinstance(group, list) else [group])]
    return StateBytes(
        parameters=_nbytes(module.parameters()),
        gradients=_nbytes(gradients),
        optimizer_state=_nbytes(state_tensors),
        master_weights=_nbytes(masters),
    )
