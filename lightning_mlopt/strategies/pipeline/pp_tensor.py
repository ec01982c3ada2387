"""Tensor parallelism inside pipeline stages: pipeline x tensor, and with FSDP over the data dimension, 3D.

Each stage is split by the same plan :class:`~lightning_mlopt.strategies.TensorParallelStrategy` takes, over the
mesh's ``tensor`` dimension (consecutive ranks, the innermost, where the all-reduces are cheap). The stages are
cut by :func:`~lightning_mlopt.strategies.pipeline.pp_module_split.trace_module_stages`, so they call the model's own
modules under their whole-model names, and the plan's styles split those in place.

What tensor parallelism adds to a pipeline's set-up is one object, :func:`stage_split`'s: :class:`WholeStages`
(tensor size 1: nothing) or :class:`SplitStages`, so the strategy runs one path whatever the size.

Example::

    split = stage_split(model, {"model.layers.*.attn.qkv": "colwise", ...}, size=2)
    pipe = split.trace(model, inputs, ["model.layers.2"], training=True)
    split.split([pipe.get_stage_module(0)], device_mesh)  # the planned modules, split over mesh["tensor"]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from lightning_mlopt.distributed.sharding import synchronized_buffers
from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies.pipeline.pp_module_split import trace_module_stages
from lightning_mlopt.strategies.pipeline.pp_split import stage_group, trace_stages
from lightning_mlopt.strategies.tensor.tp_plan import STYLES, ResolvedPlan, plan_of


class WholeStages:
    """Stages held whole by each of their ranks (no tensor parallelism): the pipeline's set-up, unchanged."""

    size = 1

    def local_statistics(self, module: nn.Module) -> frozenset[str]:
        """Buffers each rank computes from its own inputs (left out of replica checks): none beyond FSDP's."""
        return frozenset()

    def trace(self, module: nn.Module, inputs: tuple[Any, ...], split_points: Sequence[str], training: bool) -> Any:
        """The model cut into stages by ``torch.export`` (:func:`~.pp_split.trace_stages`)."""
        return trace_stages(module, inputs, split_points, training=training)

    def split(self, stage_modules: Sequence[nn.Module], mesh: DeviceMesh) -> int:
        """Modules split over the tensor dimension: none."""
        return 0

    def stage_group(self, mesh: DeviceMesh, pipeline_rank: int) -> Any:
        """The group whose ranks hold copies of this rank's stages beyond FSDP's: none (None)."""
        return None

    def batch_peers(self, mesh: DeviceMesh) -> list[Any]:
        """Groups of ranks that must read the same batch as this one, beyond the pipeline's: none."""
        return []


class SplitStages(WholeStages):
    """Each stage's planned layers split over the mesh's ``tensor`` dimension (pipeline x tensor; 3D with FSDP)."""

    def __init__(self, plan: ResolvedPlan, size: int) -> None:
        self.plan = plan
        self.size = size

    def local_statistics(self, module: nn.Module) -> frozenset[str]:
        """Buffers the tensor ranks do not keep equal (told apart by module, before the cut)."""
        compared = {buffer.name for buffer in synchronized_buffers(module)}
        return frozenset(name for name, _ in module.named_buffers() if name not in compared)

    def trace(self, module: nn.Module, inputs: tuple[Any, ...], split_points: Sequence[str], training: bool) -> Any:
        """The model cut by torch.fx, keeping the plan's module calls (their hooks split the layers)."""
        trace = partial(trace_module_stages, kept_calls=self.plan.styles)
        return trace(module, inputs, split_points, training=training)

    def split(self, stage_modules: Sequence[nn.Module], mesh: DeviceMesh) -> int:
        """Split the stages' planned modules over ``mesh["tensor"]`` in place; how many were split."""
        return parallelize_stages(stage_modules, mesh["tensor"], self.plan)

    def stage_group(self, mesh: DeviceMesh, pipeline_rank: int) -> Any:
        """The ranks holding this rank's stages: its data x tensor ranks (ReplicaConsistencyCheck compares them)."""
        return stage_group(mesh, pipeline_rank)

    def batch_peers(self, mesh: DeviceMesh) -> list[Any]:
        """The tensor ranks: they compute one batch together."""
        return [mesh["tensor"].get_group()]


def stage_split(module: nn.Module, plan: Mapping[str, str] | None, size: int) -> WholeStages:
    """What tensor parallelism of ``size`` does to the pipeline's stages; the plan checked when ``size`` > 1.

    Raises:
        BadInputError: as :func:`stage_plan`.

    """
    return SplitStages(stage_plan(module, plan, size), size) if size > 1 else WholeStages()


def stage_plan(module: nn.Module, plan: Mapping[str, str] | None, size: int) -> ResolvedPlan:
    """The plan (or the model's own ``tp_plan``) resolved and checked for pipeline stages.

    Raises:
        BadInputError: no plan, a plan that does not fit (:func:`~lightning_mlopt.strategies.tensor.tp_plan.resolve`),
            or a style that leaves the logits split into the loss: the last stage hands ``pipeline_loss`` a
            plain tensor.

    """
    resolved = plan_of(module, plan, size)
    split = [name for name, style in resolved.styles.items() if STYLES[style].splits_logits]
    if split:
        style = resolved.styles[split[0]]
        whole = "colwise_replicated" + ("_from_sequence" if style.endswith("_from_sequence") else "")
        raise BadInputError(
            f"tp_plan: {split[0]} is {style}, whose split logits a pipeline's last stage cannot hand to "
            f"pipeline_loss; use {whole} for it under pipeline parallelism"
        )
    return resolved


def parallelize_stages(stage_modules: Sequence[nn.Module], mesh: DeviceMesh, plan: ResolvedPlan) -> int:
    """Split each stage's planned modules over ``mesh`` in place; return how many modules were split.

    A stage holds the planned modules of its own layers only: the plan is restricted to the names it has.
    """
    styles = plan.parallelize_plan()
    split = 0
    for stage in stage_modules:
        held = {name: style for name, style in styles.items() if _holds(stage, name)}
        if held:
            parallelize_module(stage, mesh, held)
            split += len(held)
    return split


def _holds(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True
