"""Pipeline stages that keep the model's module calls (torch.fx), for pipeline x tensor parallelism.

The default split (:func:`~lightning_mlopt.strategies.pipeline.pp_split.trace_stages`, through ``torch.export``) inlines
every module call into aten operations on fixed shapes. Tensor parallelism needs the opposite: torch's styles
act through hooks on the model's ``nn.Linear`` and ``nn.Embedding`` modules, and the ``view`` after a split
projection must read the local width at run time. torch.fx's symbolic tracer keeps torch.nn's modules as calls
(leaf modules) and shapes as run-time values, so a stage cut here is a ``GraphModule`` that calls the model's
own module objects, under their whole-model names; ``parallelize_module`` then splits them in place.

What crosses from one stage to the next is what the later stages use of the earlier ones' values (a value used
two stages later passes through the stage between); each must be a tensor, checked on the example micro-batch.

Example::

    stages = trace_module_stages(model, inputs, ["model.layers.2"], training=True)
    stage = stages.build_stage(rank, torch.device("cpu"), group)   # a PipelineStage calling model's own Linears
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies.pipeline.pp_split import refuse_shared_parameters, trial_forwards


class ModuleStages:
    """The stages of a model cut by :func:`trace_module_stages`: what a ``Pipe`` offers, for these graphs.

    Args:
        stage_modules: one ``GraphModule`` a stage, in pipeline order.

    """

    def __init__(self, stage_modules: Sequence[fx.GraphModule]) -> None:
        self._modules = list(stage_modules)

    @property
    def num_stages(self) -> int:
        """Stages in all."""
        return len(self._modules)

    def get_stage_module(self, index: int) -> fx.GraphModule:
        """Stage ``index``'s module: it holds the model's own modules and parameters, under their whole-model names."""
        return self._modules[index]

    def build_stage(self, index: int, device: torch.device, group: Any) -> Any:
        """Stage ``index`` as torch's ``PipelineStage`` (shapes inferred at its first step)."""
        from torch.distributed.pipelining import PipelineStage

        return PipelineStage(self._modules[index], index, self.num_stages, device, group=group)


class _CallsKept(fx.Tracer):
    """torch.fx's tracer, keeping the named modules as calls too (a plan's hooks act on the module's call)."""

    def __init__(self, kept: Collection[str]) -> None:
        super().__init__()
        self._kept = frozenset(kept)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self._kept or super().is_leaf_module(m, module_qualified_name)


def trace_module_stages(
    module: nn.Module,
    inputs: tuple[Any, ...],
    split_points: Sequence[str],
    training: bool,
    kept_calls: Collection[str] = (),
) -> ModuleStages:
    """``module``'s forward traced by torch.fx (torch.nn modules kept as calls) and cut where ``split_points`` begin.

    ``training``: the mode the forward is traced in (a Python branch on ``self.training`` is fixed by it; a
    ``nn.Dropout`` module keeps following the mode). ``inputs``: one micro-batch, to check what crosses stages.
    ``kept_calls``: more modules kept as calls, by whole-model name: the plan's (a subclass of ``nn.Linear``, a
    block whose input is gathered), whose hooks would otherwise never run.

    Raises:
        BadInputError: the forward cannot be traced symbolically (torch's first line), a split module the forward
            never calls or calls after a later stage's, a value crossing stages that is not a tensor, or a
            parameter two stages use.

    """
    was_training = module.training
    module.train(training)
    try:
        graph = _CallsKept(kept_calls).trace(module)
    except Exception as error:  # torch.fx's many error types: the reason is what the user needs
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise BadInputError(
            "pipeline x tensor parallelism traces the forward with torch.fx (module calls kept for the plan's "
            f"hooks), which failed: {reason}; keep Python branches off tensor values"
        ) from None
    finally:
        module.train(was_training)
    nodes = list(graph.nodes)
    stage_of = _stage_of_each_node(nodes, list(split_points))
    stage_count = len(split_points) + 1
    crossing = _crossing_values(nodes, stage_of, stage_count)
    stages = [_stage_module(module, nodes, stage_of, crossing, index, stage_count) for index in range(stage_count)]
    _check_crossings(stages, inputs, list(split_points), module)
    module_stages = ModuleStages(stages)
    refuse_shared_parameters(module_stages)
    return module_stages


def _stage_of_each_node(nodes: Sequence[fx.Node], split_points: list[str]) -> dict[fx.Node, int]:
    """Each node's stage: the last split point whose module has been entered by then (0 before the first)."""
    stage_of: dict[fx.Node, int] = {}
    current = 0
    for node in nodes:
        if node.op not in ("placeholder", "output"):
            paths = [path.partition("@")[0] for path in node.meta.get("nn_module_stack", {})]
            if node.op == "call_module":
                paths.append(str(node.target))
            implied = max(
                (
                    index + 1
                    for index, point in enumerate(split_points)
                    for path in paths
                    if path == point or path.startswith(point + ".")
                ),
                default=None,
            )
            if implied is not None:
                if implied < current:
                    raise BadInputError(
                        f"split_points: the forward calls {split_points[implied - 1]!r} after "
                        f"{split_points[current - 1]!r}; list them in the order the forward calls them"
                    )
                current = implied
        stage_of[node] = current if node.op != "output" else len(split_points)
    if current != len(split_points):
        missing = split_points[current]  # the first one the forward did not reach
        raise BadInputError(f"split_points: the forward never calls {missing!r}: each split module must be called")
    return stage_of


def _crossing_values(nodes: Sequence[fx.Node], stage_of: dict[fx.Node, int], stages: int) -> list[list[fx.Node]]:
    """``crossing[k]``: the values stage ``k`` receives (made before it, used by it or a later stage), in order."""
    last_use = {node: max((stage_of[user] for user in node.users), default=stage_of[node]) for node in nodes}
    return [
        [node for node in nodes if stage_of[node] < index <= last_use[node] and node.op != "output"]
        for index in range(stages)
    ]


def _stage_module(
    root: nn.Module,
    nodes: Sequence[fx.Node],
    stage_of: dict[fx.Node, int],
    crossing: list[list[fx.Node]],
    index: int,
    stages: int,
) -> fx.GraphModule:
    """Stage ``index``'s graph: its received values in, its nodes, the next stage's received values out."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for value in crossing[index]:
        env[value] = graph.placeholder(value.name)
    for node in nodes:
        if stage_of[node] != index:
            continue
        if node.op == "output":
            graph.output(fx.map_arg(node.args[0], env.__getitem__))
        elif node.op != "placeholder" or index == 0:
            env[node] = graph.node_copy(node, env.__getitem__)
    if index < stages - 1:
        sent = [env[value] for value in crossing[index + 1]]
        graph.output(sent[0] if len(sent) == 1 else tuple(sent))
    # GraphModule copies what the graph calls and reads from root by path: the same module objects, same names.
    return fx.GraphModule(root, graph, class_name=f"Stage{index}")


def _check_crossings(
    stages: Sequence[fx.GraphModule], inputs: tuple[Any, ...], split_points: list[str], module: nn.Module
) -> None:
    """Run the stages in turn on one micro-batch (a trial, leaving no trace): every value sent is a tensor."""
    values: Any = inputs
    with trial_forwards(module):
        for stage, point in zip(stages[:-1], split_points, strict=True):
            values = stage(*values)
            values = values if isinstance(values, tuple) else (values,)
            odd = [type(value).__name__ for value in values if not isinstance(value, Tensor)]
            if odd:
                raise BadInputError(
                    f"split_points: at {point!r} the stages would pass a {odd[0]} (only tensors travel between "
                    f"stages); compute it after the split in {type(module).__name__}.forward, or split elsewhere"
                )
