"""DeepSpeed ZeRO's answers to ``Sharding``: what each rank holds when ZeRO partitions the state.

Our DeepSpeed strategy declares it (its ``sharding``), and ``strategies/contract.py``'s adapter gives it to
Lightning's own DeepSpeed strategy. Every other strategy keeps torch tensors and DTensors in its parameters
and gradients (``TensorSharding``), which is right for single device, DDP, FSDP, HSDP and Lightning's
ModelParallel strategy.

ZeRO keeps reduced gradients in its own partitions, not in ``param.grad``; they are read from the engine's
ZeRO optimizer: stages 1 and 2 align ``params_in_partition`` with ``averaged_gradients``, stage 3 aligns
``fp16_groups``. Stage 3 parameters hold their partition in ``ds_tensor``. Under fp16 those gradients are still
multiplied by the engine's loss scale (``gradient_scale``). These are DeepSpeed's own attribute names (DeepSpeed
0.19); this module is the one place that reads them for norms.

Example::

    sharding = contract_of(trainer.strategy).sharding  # ZeroSharding for DeepSpeed, after the engine is built
    pieces = list(sharding.gradient_pieces(params))  # ZeRO: replication 1, the partitions are disjoint
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_mlopt.distributed.sharding import (
    Piece,
    Replica,
    ReplicaSet,
    synchronized_buffers,
    world_size,
)


class ZeroSharding:
    """Gradients and ZeRO-3 parameters partitioned across the ranks; ZeRO-1/2 parameters replicated.

    Args:
        strategy: a Lightning DeepSpeed strategy (ours or Lightning's); its engine is read at each call.

    """

    can_skip_step = False  # the engine owns the update and keeps gradients in its partitions

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def _zero_optimizer(self) -> Any | None:
        optimizer = getattr(getattr(self.strategy, "model", None), "optimizer", None)
        return optimizer if hasattr(optimizer, "averaged_gradients") else None

    def gradient_pieces(self, params: Sequence[Tensor]) -> Iterator[Piece]:
        """The reduced gradient partitions of this rank (``params`` is unused: the engine knows its partitions)."""
        zero = self._zero_optimizer()
        if zero is None:  # no engine (yet), or an engine without ZeRO: plain replicated gradients
            world = world_size()
            yield from (Piece(p, p.grad, world) for p in params if p.grad is not None)
            return
        owners: Any = getattr(zero, "params_in_partition", None) or getattr(zero, "fp16_groups", None)
        for group, grads in (zero.averaged_gradients or {}).items():
            for param, grad in zip(owners[group], grads, strict=False):
                if grad is not None:
                    yield Piece(param, grad, 1)

    def gradient_scale(self) -> float | None:
        """fp16: the engine's loss scale, which its gradients carry until its ``step`` unscales them; else None.

        Read from the engine's optimizer (``loss_scale``, a property of DeepSpeed's fp16 and ZeRO 1-3 optimizers,
        a host float: no device read), so its value is the one this step's backward was scaled by.
        """
        engine = getattr(self.strategy, "model", None)
        fp16_enabled = getattr(engine, "fp16_enabled", None)
        if fp16_enabled is None or not fp16_enabled():
            return None
        scale = getattr(getattr(engine, "optimizer", None), "loss_scale", None)
        return float(scale) if scale is not None else None

    def parameter_pieces(self, params: Sequence[Tensor]) -> Iterator[Piece]:
        """ZeRO-3: each parameter's partition; ZeRO-1/2: the whole parameter, on every rank."""
        world = world_size()
        for param in params:
            partition = getattr(param, "ds_tensor", None)
            if partition is not None:
                yield Piece(param, partition, 1)
            else:
                yield Piece(param, param.detach(), world)

    def gradients_replicated(self, params: Sequence[Tensor]) -> bool:
        """Never: each rank holds only its partition of the reduced gradients."""
        return False

    def replicas(self, module: nn.Module, optimizers: Sequence[Any]) -> ReplicaSet:
        """ZeRO-1/2: the parameters (re-gathered from their owners' partitions after every step) and buffers.

        ZeRO-3: buffers only. The optimizer state and fp32 master weights are partitions: no replica holds
        another's.
        """
        buffers = synchronized_buffers(module)
        named = list(module.named_parameters())
        if any(getattr(param, "ds_tensor", None) is not None for _, param in named):
            return ReplicaSet(buffers, f"buffers only (ZeRO-3 partitions every parameter): {len(buffers)} tensors")
        replicas = [Replica(name, param, 0) for name, param in named]
        return ReplicaSet(
            replicas + buffers,
            f"parameters and buffers (optimizer state is partitioned): {len(replicas) + len(buffers)} tensors",
        )
