"""The mesh plan: sizes from a world, one message for sizes a world refuses, the one mesh every strategy builds.

Meshes are built in this process on torch's ``fake`` process group (collectives return at once), at any world
size and as any rank; the strategies' own multi-process tests train on the meshes for real.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_mlopt.distributed.mesh_plan import MeshPlan, data_mesh, data_rank
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies import FSDPStrategy, PipelineParallelStrategy, TensorParallelStrategy


@contextmanager
def fake_world(size: int, rank: int) -> Iterator[None]:
    dist.init_process_group("fake", rank=rank, world_size=size, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_shard_dimension_takes_what_the_others_leave():
    plan = MeshPlan.fill(16, pipeline=2, replicate=2, tensor=2)
    assert plan == MeshPlan(pipeline=2, replicate=2, shard=2, tensor=2)
    assert plan.world_size == 16 and plan.data_parallel_size == 4
    assert MeshPlan.fill(8).data_parallel_size == 8 and MeshPlan.fill(1) == MeshPlan()
    assert plan.describe() == "pipeline 2 x replicate 2 x shard 2 x tensor 2" and MeshPlan().describe() == "one rank"


def test_sizes_a_world_refuses_are_named_by_their_yaml_keys_in_one_message():
    with pytest.raises(BadInputError) as one:
        MeshPlan.fill(6, tensor=4, keys={"tensor": "tensor_parallel_size"})
    assert str(one.value) == (
        "tensor_parallel_size=4 must divide the world size (6 = devices x nodes); choose a divisor of 6"
    )
    keys = {"pipeline": "pipeline_parallel_size", "tensor": "tensor_parallel_size"}
    with pytest.raises(BadInputError) as two:
        MeshPlan.fill(6, pipeline=2, tensor=2, keys=keys)
    assert str(two.value) == (
        "pipeline_parallel_size=2 x tensor_parallel_size=2 must divide the world size (6 = devices x nodes); "
        "choose sizes whose product divides it"
    )
    with pytest.raises(ValueError, match="tensor must be an int >= 1, got 0"):
        MeshPlan(tensor=0)


def test_a_mesh_has_the_dimensions_over_one_and_those_its_strategy_indexes_outermost_first():
    plan = MeshPlan.fill(4, pipeline=2)
    assert plan.shape() == {"pipeline": 2, "shard": 2}
    assert MeshPlan.fill(2, tensor=2).shape(keep=("shard", "tensor")) == {"shard": 1, "tensor": 2}
    with fake_world(8, rank=5):
        mesh = MeshPlan.fill(8, pipeline=2, tensor=2).build("cpu", keep=("shard",))
        assert mesh.mesh_dim_names == ("pipeline", "shard", "tensor")
        assert mesh.mesh.tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]  # tensor ranks consecutive
        assert data_mesh(mesh).mesh_dim_names == ("shard",) and data_rank(mesh) == 0  # rank 5: pipeline 1, shard 0


def test_hsdp_reads_batches_by_replica_then_shard_and_shards_over_both():
    with fake_world(8, rank=5):  # replicate 2 x shard 2 x tensor 2: rank 5 is replica 1, shard 0
        mesh = MeshPlan.fill(8, replicate=2, tensor=2).build("cpu", keep=("shard",))
        assert data_mesh(mesh).mesh_dim_names == ("replicate", "shard")
        assert data_rank(mesh) == 2
    with fake_world(4, rank=3):
        mesh = MeshPlan(tensor=4).build("cpu", keep=("tensor",))
        with pytest.raises(ValueError, match="no data-parallel dimension"):
            data_mesh(mesh)


def _on_ranks(strategy, ranks: int):  # type: ignore[no-untyped-def]
    """The strategy as the launcher configures it for a world of ``ranks`` (before any process group)."""
    environment = LightningEnvironment()
    environment.set_world_size(ranks)
    strategy.cluster_environment = environment
    return strategy


def test_each_strategy_declares_its_plan_and_refuses_a_world_before_launch():
    assert _on_ranks(FSDPStrategy(), 4).mesh_plan == MeshPlan(shard=4)
    assert _on_ranks(FSDPStrategy(replicate_size=2), 4).mesh_plan == MeshPlan(replicate=2, shard=2)
    per_node = _on_ranks(FSDPStrategy(replicate_size="nodes"), 8)  # `hsdp`: one replica per node
    per_node.num_nodes = 2
    assert per_node.mesh_plan == MeshPlan(replicate=2, shard=4)
    assert _on_ranks(TensorParallelStrategy(tensor_parallel_size=2), 4).mesh_plan == MeshPlan(shard=2, tensor=2)
    pp = _on_ranks(PipelineParallelStrategy(pipeline_parallel_size=2, tensor_parallel_size=2), 8)
    assert pp.mesh_plan == MeshPlan(pipeline=2, shard=2, tensor=2) and pp.data_parallel_size == 2
    with pytest.raises(BadInputError, match=r"^replicate_size=3 must divide the world size \(4 = devices"):
        _ = _on_ranks(FSDPStrategy(replicate_size=3), 4).mesh_plan
