"""What a strategy answers about its sharding: which pieces of gradients and parameters this rank holds.

Callbacks that measure the model (norms, fingerprints) ask ``strategies.contract.contract_of(strategy).sharding``
and never look inside a strategy. Each piece comes with its replication, how many ranks hold the same piece:
dividing a piece's sum of squares by it and summing over all ranks gives the unsharded model's value with every
parameter counted once. DDP replicates everything on every rank, HSDP each shard across its replica groups, FSDP and
ZeRO partitions are disjoint; so one all-reduce over the world serves every strategy.

This module holds the interface and :class:`TensorSharding` (plain tensors and DTensors: single device,
DDP, FSDP, HSDP, ModelParallel); DeepSpeed's answers live with our strategies
(``strategies/deepspeed/zero_sharding.py``).

Example::

    sharding = TensorSharding()  # or strategies.contract.contract_of(trainer.strategy).sharding
    for piece in sharding.gradient_pieces(params):
        squares += piece.tensor.float().pow(2).sum() / piece.replication
    # then all-reduce ``squares`` over the world, unless sharding.gradients_replicated(params)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_mlopt._compat import norm_layer_base


class Piece(NamedTuple):
    """A tensor this rank holds for one parameter, and on how many ranks the same piece lives.

    A NamedTuple, not a dataclass: one is made per parameter per step, and a tuple is the cheapest object.
    """

    param: Tensor
    tensor: Tensor
    replication: int


class Replica(NamedTuple):
    """A tensor that every rank of its replica group must hold bit for bit identically."""

    name: str
    tensor: Tensor
    group: int  # ranks reporting the same group hold copies of the same tensor (HSDP: one shard's replicas)


@dataclass
class ReplicaSet:
    """What a strategy keeps replicated across data-parallel ranks, and a line saying so for the start-up log.

    ``process_group``: the ranks that compare these (None: the world). Pipeline stages hold other tensors, so
    each stage's ranks compare among themselves; every rank of one group lists the same tensors.
    """

    replicas: list[Replica] = field(default_factory=list)
    description: str = "nothing"
    process_group: Any = None


@runtime_checkable
class Sharding(Protocol):
    """A strategy's answers about what each rank holds; see the module docstring."""

    #: Whether dropping every ``param.grad`` before the optimizer step makes that step a no-op. False where
    #: the engine keeps gradients elsewhere and owns the update (DeepSpeed).
    can_skip_step: bool

    def gradient_pieces(self, params: Sequence[Tensor]) -> Iterator[Piece]:
        """Every gradient piece this rank holds for ``params``, after backward and before the optimizer step."""
        ...

    def parameter_pieces(self, params: Sequence[Tensor]) -> Iterator[Piece]:
        """Every parameter piece this rank holds (its shard where parameters are sharded)."""
        ...

    def gradient_scale(self) -> float | None:
        """The factor the gradient pieces still carry after backward, or None where they are the true gradients.

        An engine's fp16 loss scale, which it undoes inside its own step (DeepSpeed); AMP's GradScaler unscales
        before ``on_before_optimizer_step``, so under it this is None.
        """
        ...

    def gradients_replicated(self, params: Sequence[Tensor]) -> bool:
        """Whether every rank holds the whole, identical gradient of every parameter after an optimizer step.

        Then a value computed from the local gradients is the global one, equal on every rank, and needs no
        collective.
        """
        ...

    def replicas(self, module: nn.Module, optimizers: Sequence[Any]) -> ReplicaSet:
        """The tensors that data-parallel replicas must hold identically after an optimizer step."""
        ...


def world_size() -> int:
    """Ranks in the default process group; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def data_parallel_size(strategy: Any, world: int) -> int:
    """How many different batches a step trains on: ``world`` divided by the ranks that share one batch.

    Tensor parallelism gives every rank of a tensor-parallel group the same batch, so throughput and sample
    counts are per data-parallel rank; the strategy's sampler says how many there are (``num_replicas``).

    Example::

        data_parallel_size(trainer.strategy, trainer.world_size)   # 2 for FSDP x TP = 2 x 2 on 4 ranks
    """
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", world))


def settle_partial_gradients(params: Iterable[Tensor]) -> None:
    """Turn every ``Partial`` placement of the parameters' DTensor gradients into ``Replicate``, in place.

    The partial sums of all of them travel in one all-reduce per mesh (flattened into one buffer), not one
    per gradient. A gradient without a ``Partial`` placement is left as it is.

    Example::

        loss.backward()
        settle_partial_gradients(model.parameters())   # a sequence-parallel norm's gradient is now whole
    """
    partial: dict[Any, list[Tensor]] = {}
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
            partial.setdefault((grad.device_mesh, tuple(grad.placements), grad.dtype), []).append(param)
    for (mesh, placements, _), owners in partial.items():
        dims = [dim for dim, placement in enumerate(placements) if placement.is_partial()]
        locals_ = [owner.grad.to_local() for owner in owners]  # type: ignore[union-attr]
        flat = torch.cat([local.reshape(-1) for local in locals_])
        for dim in dims:
            dist.all_reduce(flat, group=mesh.get_group(dim))
        settled = [Replicate() if placement.is_partial() else placement for placement in placements]
        offset = 0
        for owner, local in zip(owners, locals_, strict=True):
            whole = flat[offset : offset + local.numel()].view_as(local)
            offset += local.numel()
            owner.grad = DTensor.from_local(
                whole, mesh, settled, run_check=False, shape=owner.shape, stride=owner.stride()
            )


class PartialGradients:
    """Sums the gradients backward leaves as partial sums (sequence parallelism's norms) into whole ones, each step.

    A norm under ``sequence_parallel`` holds its weight whole (``Replicate``) but sees this rank's part of the
    sequence only, so its gradient comes out ``Partial``: each rank's share of the sum. Clipping, the optimizer
    and every norm of ours read a gradient as what it is on each rank, so it is made whole before anything
    reads it. Only a parameter with a ``Replicate`` placement can get one: those are found at the first call
    (the plan fixes them), and their gradients' placements are read at every call, so a norm whose gradient
    first appears later (a branch unused at the first step) is settled too. One all-reduce a step for all of
    them; none without sequence parallelism.

    Example::

        partial = PartialGradients()
        loss.backward()
        partial.settle(model)   # every sequence-parallel norm's gradient is now whole
    """

    def __init__(self) -> None:
        self._owners: list[nn.Parameter] | None = None

    def settle(self, module: nn.Module) -> None:
        """Settle ``module``'s partial gradients in place (the owners found at the first call)."""
        if self._owners is None:
            self._owners = [
                param
                for param in module.parameters()
                if isinstance(param, DTensor) and any(p.is_replicate() for p in param.placements)
            ]
        if self._owners:
            settle_partial_gradients(self._owners)  # those whose gradient is Partial now


def synchronized_buffers(module: nn.Module) -> list[Replica]:
    """Buffers every rank keeps identical: all but the running statistics of (non-synchronized) BatchNorm.

    Those are updated from each rank's own batch in every forward, so replicas legitimately differ (DDP
    re-broadcasts them only at the next forward); SyncBatchNorm keeps them equal.
    """
    local_statistics = {
        id(buffer)
        for submodule in module.modules()
        if isinstance(submodule, norm_layer_base()) and not isinstance(submodule, nn.SyncBatchNorm)
        for buffer in submodule.buffers(recurse=False)
    }
    return [Replica(name, buffer, 0) for name, buffer in module.named_buffers() if id(buffer) not in local_statistics]


def dtensor_replication(tensor: DTensor) -> int:
    """On how many ranks each local shard of ``tensor`` lives: the product of its replicated mesh dimensions."""
    replication = 1
    for dim, placement in enumerate(tensor.placements):
        if placement.is_replicate():
            replication *= tensor.device_mesh.size(dim)
    return replication


class TensorSharding:
    """Parameters and gradients are torch tensors (replicated on every rank) or DTensors (their placements say).

    Single device, DDP, FSDP2, HSDP and tensor parallelism through DTensor.
    """

    can_skip_step = True
    #: The whole model's parameter names, in order, where ranks hold different parameters (pipeline stages):
    #: per-module figures are laid out on them, the same on every rank. None: every rank's module has them all.
    #: Optional for other Sharding implementations (read with ``getattr``).
    model_parameter_names: tuple[str, ...] | None = None

    def replication_of(self, tensor: DTensor) -> int:
        """On how many ranks each local shard of ``tensor`` lives (its mesh spans the world: FSDP, HSDP)."""
        return dtensor_replication(tensor)

    def plain_replication(self) -> int:
        """On how many ranks a plain tensor lives: every rank (DDP, single device)."""
        return world_size()

    def gradient_pieces(self, params: Sequence[Tensor]) -> Iterator[Piece]:
        """See :class:`Sharding`. ``params`` is a list the caller keeps (walking the module each step costs more)."""
        copies = self.plain_replication()
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor):
                yield Piece(param, grad.to_local(), self.replication_of(grad))
            else:
                yield Piece(param, grad, copies)  # DDP and single device: every rank holds the whole gradient

    def parameter_pieces(self, params: Sequence[Tensor]) -> Iterator[Piece]:
        """See :class:`Sharding`."""
        copies = self.plain_replication()
        for param in params:
            if isinstance(param, DTensor):
                yield Piece(param, param.to_local(), self.replication_of(param))
            else:
                yield Piece(param, param.detach(), copies)

    def gradient_scale(self) -> float | None:
        """See :class:`Sharding`: torch's GradScaler unscales the gradients before the hooks see them."""
        return None

    def gradients_replicated(self, params: Sequence[Tensor]) -> bool:
        """See :class:`Sharding`: no parameter is a DTensor."""
        return not any(isinstance(p, DTensor) for p in params)

    def compared_buffers(self, module: nn.Module) -> list[Replica]:
        """The buffers every rank holding them keeps identical (:func:`synchronized_buffers`)."""
        return synchronized_buffers(module)

    def replicas(self, module: nn.Module, optimizers: Sequence[Any]) -> ReplicaSet:
        """See :class:`Sharding`. Plain tensors (DDP): parameters, optimizer state and buffers, on every rank.

        DTensors (FSDP, HSDP, tensor parallelism): each shard across the ranks that hold it (HSDP's replica
        groups, a tensor-parallel plan's replicated biases, a norm's FSDP shard on every tensor-parallel rank;
        none under full sharding), never one split's different pieces. Plain parameters beside them (those a
        tensor-parallel plan leaves out) are held whole on every rank: compared with their optimizer state.
        """
        buffers = self.compared_buffers(module)
        named = list(module.named_parameters())
        whole = [(name, param) for name, param in named if not isinstance(param, DTensor)]
        replicas = [Replica(name, param, 0) for name, param in whole] + _optimizer_state(whole, optimizers)
        if len(whole) == len(named):
            what = "parameters, optimizer state and buffers (every rank holds them whole)"
            return ReplicaSet(replicas + buffers, f"{what}: {len(replicas) + len(buffers)} tensors")
        shards = [
            Replica(name, param.to_local(), _shard_group(param))
            for name, param in named
            if isinstance(param, DTensor) and self.replication_of(param) > 1
        ]
        parts = [f"{len(shards)} parameter shards, each across its replicas"] if shards else []
        if replicas:
            parts.append(f"{len(replicas)} parameters and optimizer states held whole on every rank")
        if not parts:
            parts.append("no parameters (they are fully sharded: no rank holds another's copy)")
        what = "; ".join(parts)
        total = len(shards) + len(replicas) + len(buffers)
        return ReplicaSet(shards + replicas + buffers, f"{what}; and buffers: {total} tensors")


class SubMeshSharding(TensorSharding):
    """Tensor parallelism, alone or under FSDP: a DTensor on a sub-mesh is replicated across the others.

    A parameter left out of the tensor-parallel plan (a norm's weight) is sharded by FSDP over the data mesh
    only, and every tensor-parallel rank holds the same shard: ``world / mesh size`` copies of each piece
    beyond what its placements say. (A pipeline stage's sub-mesh is not: :class:`PipelineSharding` answers for it.)
    """

    def replication_of(self, tensor: DTensor) -> int:
        """See :meth:`TensorSharding.replication_of`, times the copies of its mesh across the world."""
        return dtensor_replication(tensor) * max(1, world_size() // tensor.device_mesh.size())


class PipelineSharding(TensorSharding):
    """Pipeline parallelism: each pipeline rank holds other parameters (its stages'), replicated over the data ranks.

    A plain parameter lives on the ``world / pipeline_parallel_size`` ranks that hold its stage; a DTensor (a
    stage sharded by FSDP over the data dimension, or split by a tensor-parallel plan) is held as its placements
    say within its stage, never across stages. No rank holds every gradient, so a global norm is always summed
    over the world.

    Args:
        pipeline_parallel_size: pipeline ranks.

    """

    def __init__(self, pipeline_parallel_size: int = 1) -> None:
        self.pipeline_parallel_size = pipeline_parallel_size
        self.model_parameter_names = None  # the whole model's, set when the strategy cuts it into stages
        self.stage_group: Any = None  # a stage's tensor-parallel ranks (x data under 3D): set at set-up
        #: Buffers each rank updates from its own batch (batch norm's running statistics), by whole-model name:
        #: the traced stages keep the buffers but not the norm modules that would tell them apart.
        self.local_statistics: frozenset[str] = frozenset()

    def plain_replication(self) -> int:
        """A plain tensor lives on the ranks of its stage: ``world / pipeline_parallel_size`` (data x tensor)."""
        return max(1, world_size() // self.pipeline_parallel_size)

    def replication_of(self, tensor: DTensor) -> int:
        """As its placements say, times the copies of its mesh among its stage's ranks (not across stages).

        Under pipeline x tensor parallelism a parameter left out of the plan, sharded by FSDP over the data
        ranks only, is held alike by every tensor-parallel rank of its stage.
        """
        ranks_of_stage = self.plain_replication()
        return dtensor_replication(tensor) * max(1, ranks_of_stage // tensor.device_mesh.size())

    def gradients_replicated(self, params: Sequence[Tensor]) -> bool:
        """See :class:`Sharding`: never across pipeline ranks (one of them alone is the whole model only at 1)."""
        return self.pipeline_parallel_size == 1 and super().gradients_replicated(params)

    def replicas(self, module: nn.Module, optimizers: Sequence[Any]) -> ReplicaSet:
        """See :class:`Sharding`: what the ranks of one stage share, compared among them (``stage_group``).

        Under pipeline x tensor parallelism a stage's tensor ranks hold copies of what the plan leaves whole or
        replicated (a norm, a row-wise layer's bias), as :meth:`TensorSharding.replicas` lists them, counted
        within the stage. Without tensor parallelism there is nothing to compare: a stage's data ranks hold
        FSDP's different shards.
        """
        if self.stage_group is None:
            return ReplicaSet([], "nothing (pipeline stages: each parameter is held once per pipeline)")
        within = super().replicas(module, optimizers)
        description = f"within each pipeline stage, among its ranks (stage 0: {within.description})"
        return ReplicaSet(within.replicas, description, self.stage_group)

    def compared_buffers(self, module: nn.Module) -> list[Replica]:
        """See :meth:`TensorSharding.compared_buffers`, without the ``local_statistics``."""
        return [buffer for buffer in super().compared_buffers(module) if buffer.name not in self.local_statistics]


def _shard_group(tensor: DTensor) -> int:
    """Which shard this rank holds: its coordinates on the mesh dimensions that shard ``tensor``, as one int."""
    coordinate: list[int] = list(tensor.device_mesh.get_coordinate() or [])
    group = 0
    for dim, placement in enumerate(tensor.placements):
        if not placement.is_replicate():
            group = group * tensor.device_mesh.size(dim) + coordinate[dim]
    return group


def _optimizer_state(named: Sequence[tuple[str, Tensor]], optimizers: Sequence[Any]) -> list[Replica]:
    """Every tensor of the optimizers' per-parameter state (Adam's moments...), named after its parameter."""
    replicas = []
    for optimizer in optimizers:
        state = getattr(optimizer, "state", {})
        for name, param in named:
            for key, value in sorted(state.get(param, {}).items()):
                if isinstance(value, Tensor) and value.numel() > 1:  # not a scalar step count
                    replicas.append(Replica(f"{name} ({key})", value, 0))
    return replicas
