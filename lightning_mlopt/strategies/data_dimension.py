"""The data-parallel dimension of a multi-dimensional mesh: where FSDP shards and what each rank's sampler reads.

Tensor parallelism (``(data, tensor)``) and pipeline parallelism (``(pipeline, data)``) both lay their ranks out
on a mesh with a ``data`` dimension: the ranks along the other dimension compute one model replica together, so
they read the same batches and FSDP shards only across the replicas.

Example::

    class TensorParallelStrategy(OverDataDimension, FSDPStrategy): ...
"""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh

DATA = "data"  # the mesh dimension of the model replicas


class OverDataDimension:
    """FSDP's mesh and the sampler's replicas taken from ``device_mesh["data"]``; put before FSDPStrategy."""

    device_mesh: DeviceMesh

    @property
    def shard_mesh(self) -> DeviceMesh:
        """FSDP shards over the data-parallel dimension only."""
        return self.device_mesh[DATA]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One slice of the data per replica: the ranks that compute one replica together read the same batches."""
        data = self.device_mesh[DATA]
        return {"num_replicas": data.size(), "rank": data.get_local_rank()}
