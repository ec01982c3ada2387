"""Tensor parallelism inside pipeline stages: pipeline x tensor, and with FSDP over the data dimension, 3D.

Each stage is split by the same plan :class:`~lightning_mlopt.strategies.TensorParallelStrategy` takes, over the
mesh's ``tensor`` dimension (consecutive ranks, the innermost, where the all-reduces are cheap). The stages are
cut by :func:`~lightning_mlopt.strategies.pp_module_split.trace_module_stages`, so they call the model's own
modules under their whole-model names, and the plan's styles split those in place.

Example::

    plan = stage_plan(model, {"model.layers.*.attn.qkv": "colwise", ...}, size=2)
    parallelize_stages([stage_module], device_mesh["tensor"], plan)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies.tp_plan import STYLES, ResolvedPlan, plan_of


def stage_plan(module: nn.Module, plan: Mapping[str, str] | None, size: int) -> ResolvedPlan:
    """The plan (or the model's own ``tp_plan``) resolved and checked for pipeline stages.

    Raises:
        BadInputError: no plan, a plan that does not fit (:func:`~lightning_mlopt.strategies.tp_plan.resolve`),
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
