"""One plan for every strategy's ranks: ``pipeline x replicate x shard x context x tensor``, outermost first.

Each multi-dimensional strategy (FSDP and HSDP, FSDP x TP, PP, PP x FSDP x TP) used to size, check and build its
own ``DeviceMesh``. Here one frozen plan does it for all of them, in torchtitan's order (``ParallelDims``): the
pipeline spans nodes, the tensor dimension is innermost (consecutive ranks: one node's devices, where its
all-reduces are cheap), and the data-parallel dimensions (``replicate`` x ``shard``) sit between. The shard
dimension takes what the others leave of the world; a world they do not divide is refused in one message that
names every YAML key involved, before any process group starts.

This module is the only place in the package that builds a device mesh.

Example::

    plan = MeshPlan.fill(4, pipeline=2, keys={"pipeline": "pipeline_parallel_size"})
    plan.shape()                 # {"pipeline": 2, "shard": 2}
    plan.data_parallel_size      # 2: each pipeline replica reads its own batches
    mesh = plan.build("cpu")     # a DeviceMesh with dimensions ("pipeline", "shard")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

from lightning_mlopt.exceptions import BadInputError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Dimension = Literal["pipeline", "replicate", "shard", "context", "tensor"]
DIMENSIONS: tuple[Dimension, ...] = ("pipeline", "replicate", "shard", "context", "tensor")  # outermost first
DATA_DIMENSIONS: tuple[Dimension, ...] = ("replicate", "shard")  # each coordinate reads batches of its own


@dataclass(frozen=True)
class MeshPlan:
    """How many ranks each parallel dimension spans; their product is the world size.

    Attributes:
        pipeline: pipeline stages' ranks (each holds part of the model's layers).
        replicate: model replicas that hold whole copies of their shards (HSDP's outer dimension).
        shard: ranks that FSDP shards parameters, gradients and optimizer state over.
        context: ranks that split each sequence (context parallelism).
        tensor: ranks that split each planned layer (tensor parallelism).

    """

    pipeline: int = 1
    replicate: int = 1
    shard: int = 1
    context: int = 1
    tensor: int = 1

    def __post_init__(self) -> None:
        for dimension in fields(self):
            size = getattr(self, dimension.name)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh plan: {dimension.name} must be an int >= 1, got {size!r}")

    @classmethod
    def fill(
        cls,
        world_size: int,
        pipeline: int = 1,
        replicate: int = 1,
        context: int = 1,
        tensor: int = 1,
        keys: Mapping[str, str] | None = None,
    ) -> MeshPlan:
        """The plan whose shard dimension takes the ranks the other dimensions leave of ``world_size``.

        Args:
            world_size: processes in the job (devices x nodes).
            pipeline: pipeline ranks.
            replicate: HSDP replicas.
            context: context-parallel ranks.
            tensor: tensor-parallel ranks.
            keys: the YAML key of each dimension given, for the message (e.g. ``{"tensor":
                "tensor_parallel_size"}``); a dimension without one is named as itself.

        Raises:
            BadInputError: the sizes' product does not divide the world size; the message names each key and
                its value.

        Example::

            MeshPlan.fill(8, tensor=2)           # MeshPlan(shard=4, tensor=2)
            MeshPlan.fill(6, pipeline=4)         # BadInputError: pipeline=4 must divide the world size (6 ...

        """
        given = {"pipeline": pipeline, "replicate": replicate, "context": context, "tensor": tensor}
        product = pipeline * replicate * context * tensor
        if world_size % product:
            named = [f"{(keys or {}).get(name, name)}={size}" for name, size in given.items() if size > 1]
            fix = f"choose a divisor of {world_size}" if len(named) == 1 else "choose sizes whose product divides it"
            raise BadInputError(
                f"{' x '.join(named)} must divide the world size ({world_size} = devices x nodes); {fix}"
            )
        return cls(pipeline=pipeline, replicate=replicate, shard=world_size // product, context=context, tensor=tensor)

    @property
    def world_size(self) -> int:
        """Ranks in all: the product of every dimension."""
        return self.pipeline * self.replicate * self.shard * self.context * self.tensor

    @property
    def data_parallel_size(self) -> int:
        """Different batches a step trains on: ``replicate x shard`` (the other dimensions share one batch)."""
        return self.replicate * self.shard

    def shape(self, keep: Sequence[Dimension] = ()) -> dict[Dimension, int]:
        """The mesh's dimensions and sizes, outermost first: those over 1, and those in ``keep`` whatever their size.

        A strategy keeps the dimensions its code indexes (``mesh["shard"]``) even at size 1.
        """
        return {name: getattr(self, name) for name in DIMENSIONS if getattr(self, name) > 1 or name in keep}

    def build(self, device_type: str, keep: Sequence[Dimension] = ()) -> DeviceMesh:
        """The job's one ``DeviceMesh`` (collective: every rank calls it); see :meth:`shape` for its dimensions."""
        from torch.distributed.device_mesh import init_device_mesh  # here: the plan's arithmetic needs no torch

        shape = self.shape(keep) or {"shard": 1}
        return init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))

    def describe(self) -> str:
        """``pipeline 2 x shard 2``: the dimensions over 1, for start-up lines and messages."""
        return " x ".join(f"{name} {size}" for name, size in self.shape().items()) or "one rank"


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh of ``mesh``'s data-parallel dimensions (``replicate``, ``shard``): where FSDP shards.

    Raises:
        ValueError: ``mesh`` has no data-parallel dimension (it was not built with ``keep=("shard",)``).

    """
    names = [name for name in DATA_DIMENSIONS if name in (mesh.mesh_dim_names or ())]
    if not names:
        raise ValueError(f"the mesh {mesh.mesh_dim_names} has no data-parallel dimension: build it keeping 'shard'")
    return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


def data_rank(mesh: DeviceMesh) -> int:
    """The calling rank's coordinate along the data-parallel dimensions, flattened replica-major: its sampler's rank."""
    data = data_mesh(mesh)
    rank = 0
    for dim in range(data.ndim):
        rank = rank * data.size(dim) + data.get_local_rank(dim)
    return rank


__all__ = ["DATA_DIMENSIONS", "DIMENSIONS", "Dimension", "MeshPlan", "data_mesh", "data_rank"]
