"""Splitting an unmodified LightningModule into pipeline stages at named modules, and checking the split first.

The split is given as the modules where each stage after the first begins (``split_points``), e.g.
``["model.layers.2"]`` for two stages of the GPT demo. torch's tracer front end
(``torch.distributed.pipelining.pipeline``, through ``torch.export``) cuts the module's ``forward`` there, so
the model is not rewritten; each stage is a graph module whose parameters keep their names in the whole model
(``model.layers.2.attn.qkv.weight``), so checkpoints of a pipelined run name what a one-process run names.

What a model must satisfy, checked before launch (:func:`check_split`) and at set-up (:func:`trace_stages`):

- a ``forward`` that ``torch.export`` can trace with a fixed micro-batch shape (no data-dependent Python
  control flow), taking the batch's inputs;
- the split modules exist, are distinct, none inside another, and in the order the forward calls them;
- no parameter shared by modules of two stages (tied embeddings: each stage would train its own copy);
- one declared method, :class:`DeclaresPipelineLoss`'s ``pipeline_loss(output, target)``: the loss of one
  micro-batch from the last stage's output. ``training_step`` is not called under pipeline parallelism (no
  rank holds the whole model), so the loss cannot come from there.

Example::

    check_split(model, ["model.layers.2"], stages=2)
    pipe = trace_stages(model, inputs, ["model.layers.2"], training=True)
    install_stages(model, [pipe.get_stage_module(rank)])   # this rank's parameters only, same names
"""

from __future__ import annotations

import bisect
import difflib
import itertools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_mlopt.exceptions import BadInputError


@runtime_checkable
class DeclaresPipelineLoss(Protocol):
    """A LightningModule that can train under pipeline parallelism: it says how a micro-batch's loss is computed.

    Example::

        class MyModel(LightningModule):
            def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
                return F.cross_entropy(output.flatten(0, 1), target.flatten())

            def training_step(self, batch, batch_idx):      # the same loss, one process
                inputs, target = batch
                return self.pipeline_loss(self(inputs), target)
    """

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The mean loss of one micro-batch, from the model's output and the batch's target."""
        ...


def check_split(module: nn.Module, split_points: Sequence[str], stages: int) -> list[int]:
    """Check ``split_points`` against the model; return each stage's parameter count.

    Raises:
        BadInputError: a wrong count, an unknown, repeated, nested or out-of-order name, a parameter shared
            across stages, or no ``pipeline_loss``; the message names it and the fix.

    """
    if not isinstance(module, DeclaresPipelineLoss):
        raise BadInputError(
            f"{type(module).__name__} has no pipeline_loss(output, target): under pipeline parallelism the loss of "
            "each micro-batch is computed from the last stage's output; add that one method (docs/pipeline_parallel.md)"
        )
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise BadInputError(
            f"{type(module).__name__} holds parameters itself ({', '.join(own[:3])}): under pipeline parallelism "
            "each belongs to a stage's module; move them into a submodule"
        )
    if len(split_points) != stages - 1:
        raise BadInputError(
            f"split_points: {stages} stages need {stages - 1} split point(s) (where stages 2.. begin), "
            f"got {len(split_points)}: {list(split_points)}"
        )
    order = [name for name, _ in module.named_modules() if name]
    position = {name: index for index, name in enumerate(order)}
    for name in split_points:
        if name not in position:
            close = difflib.get_close_matches(name, order, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise BadInputError(f"split_points: {name!r} is not a module of {type(module).__name__}{hint}")
    for name in split_points:
        if isinstance(module.get_submodule(name), (nn.ModuleList, nn.ModuleDict)):
            raise BadInputError(
                f"split_points: {name!r} holds no module of its own: name a module the forward calls (e.g. {name}.0)"
            )
    if len(set(split_points)) != len(split_points):
        raise BadInputError(f"split_points: a module is named twice: {list(split_points)}")
    for earlier, later in itertools.pairwise(split_points):
        if later.startswith(earlier + ".") or earlier.startswith(later + "."):
            raise BadInputError(f"split_points: {later!r} and {earlier!r} are nested; name sibling modules")
        if position[later] < position[earlier]:
            raise BadInputError(
                f"split_points: {later!r} comes before {earlier!r} in the model; list them in forward order"
            )
    stage_of = stage_of_modules(module, split_points)
    counts = [0] * stages
    owner_stage: dict[int, tuple[int, str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner = name.rpartition(".")[0]
        stage = stage_of.get(owner, 0)  # the LightningModule itself ("") is refused above
        seen = owner_stage.setdefault(id(param), (stage, name))
        if seen[0] != stage:
            raise BadInputError(
                f"split_points: {seen[1]} and {name} are one parameter (tied) in stages {seen[0]}, {stage}; "
                "untie it or put both modules in one stage"
            )
        if seen[1] == name:
            counts[stage] += param.numel()
    return counts


def stage_of_modules(module: nn.Module, split_points: Sequence[str]) -> dict[str, int]:
    """Each submodule's stage by name: the number of split points at or before it in the model's module order.

    Example::

        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> stage_of_modules(net, ["2"])
        {'0': 0, '1': 0, '2': 1}
    """
    order = [name for name, _ in module.named_modules() if name]
    starts = [order.index(name) for name in split_points]
    return {name: bisect.bisect_right(starts, index) for index, name in enumerate(order)}


def trace_stages(module: nn.Module, inputs: tuple[Any, ...], split_points: Sequence[str], training: bool) -> Any:
    """The ``Pipe`` of ``module`` traced on one micro-batch's ``inputs`` and cut at ``split_points``.

    ``training``: the mode the graph is traced in (``torch.export`` bakes it in: dropout on or off, batch or running
    statistics). The module is left as it was: torch's tracer patches the split modules' ``forward``, undone here,
    so it can be traced again (the other mode). Each stage module holds the module's own parameter objects.

    Raises:
        BadInputError: the forward cannot be traced (the first line of torch's reason), or the cut gives
            another number of stages (a split module the forward does not call, or calls twice).

    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    was_training = module.training
    patched = [module.get_submodule(name) for name in split_points]
    saved = [{key: sub.__dict__[key] for key in _PATCHED if key in sub.__dict__} for sub in patched]
    module.train(training)
    try:
        pipe = pipeline(module, mb_args=inputs, split_spec={name: SplitPoint.BEGINNING for name in split_points})
    except Exception as error:  # torch.export's many error types: the reason is what the user needs
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        raise BadInputError(
            f"pipeline parallelism traces {type(module).__name__}.forward with torch.export, which failed: {reason}"
        ) from None
    finally:
        module.train(was_training)
        for sub, before in zip(patched, saved, strict=True):
            for key in _PATCHED:
                sub.__dict__.pop(key, None)
            sub.__dict__.update(before)
    if pipe.num_stages != len(split_points) + 1:
        raise BadInputError(
            f"split_points: cutting at {list(split_points)} gave {pipe.num_stages} stages, not "
            f"{len(split_points) + 1}: each split module must be called once by the forward"
        )
    refuse_shared_parameters(pipe)
    return pipe


def refuse_shared_parameters(stages: Any) -> None:
    """Refuse a parameter two stages use: each would train its own copy of it, and the copies drift apart.

    ``check_split`` refuses a parameter two stages' modules hold; this catches the one a later stage reads
    directly, e.g. an LM head written ``F.linear(x, self.embedding.weight)``. A frozen one may be shared.
    ``stages``: a ``Pipe`` or :class:`~lightning_mlopt.strategies.pipeline.pp_module_split.ModuleStages` (stage modules
    keep whole-model names).

    Raises:
        BadInputError: the parameter, its two stages and the fix.

    """
    first_stage: dict[str, int] = {}
    for index in range(stages.num_stages):
        for name, param in stages.get_stage_module(index).named_parameters():
            if not param.requires_grad:  # frozen: the copies never change, so nothing drifts
                continue
            earlier = first_stage.setdefault(name, index)
            if earlier != index:
                raise BadInputError(
                    f"split_points: {name} is used by stages {earlier} and {index} (a weight read twice, e.g. "
                    "tied through F.linear), and each would train its own copy; untie it or use it in one stage"
                )


_PATCHED = ("forward", "_orig_forward")  # what torch's annotate_split_points sets on each split module


@contextmanager
def trial_forwards(module: nn.Module) -> Iterator[None]:
    """Forwards of ``module`` that leave no trace: no gradients, the random state and the buffers restored.

    A trial forward in training mode would otherwise move batch norm's running statistics (and count a batch)
    before the first step, and the run would no longer match one process's.

    Example::

        with trial_forwards(model):
            model(*inputs)   # model.state_dict() is as before
    """
    saved = [
        (owner, name, buffer, buffer.clone())
        for owner in module.modules()
        for name, buffer in owner.named_buffers(recurse=False)
    ]
    try:
        with torch.random.fork_rng(), torch.no_grad():
            yield
    finally:
        with torch.no_grad():
            for owner, name, buffer, value in saved:
                setattr(owner, name, buffer)  # the object itself, should the forward have replaced it (a cache)
                buffer.copy_(value)


def depends_on_mode(module: nn.Module, inputs: tuple[Any, ...]) -> bool:
    """Whether ``module``'s output on ``inputs`` differs between training and evaluation (dropout, batch norm).

    Two trial forwards of one micro-batch (:func:`trial_forwards`), each from the same random seed.
    """
    was_training = module.training
    outputs = []
    try:
        for training in (True, False):
            module.train(training)
            with trial_forwards(module):
                torch.manual_seed(0)
                outputs.append(module(*inputs))
    finally:
        module.train(was_training)
    first, second = outputs
    if isinstance(first, Tensor) and isinstance(second, Tensor):
        return not torch.equal(first, second)
    return True  # not a tensor: assume it does


def install_stages(module: nn.Module, stage_modules: Sequence[nn.Module]) -> None:
    """Make ``module`` hold exactly this rank's stages' submodules, under the names they have in the whole model.

    Each stage module's top-level children (``model`` for the GPT demo) are merged (a rank with two stages holds
    ``model.layers.0`` of one and ``model.layers.2`` of the other under one ``model``) and put in place of the
    module's own; children no stage of this rank uses become None. The optimizer, checkpoints and callbacks
    then see this rank's parameters only, with their whole-model names.

    Raises:
        ValueError: two stages hold parameters directly in the same module (cannot be merged).

    """
    merged = _merge([dict(stage.named_children()) for stage in stage_modules])
    for name in list(dict(module.named_children())):
        if name not in merged:
            setattr(module, name, None)
    for name, child in merged.items():
        setattr(module, name, child)


def _merge(children: list[dict[str, nn.Module]]) -> dict[str, nn.Module]:
    names: dict[str, list[nn.Module]] = {}
    for level in children:
        for name, child in level.items():
            names.setdefault(name, []).append(child)
    merged: dict[str, nn.Module] = {}
    for name, parts in names.items():
        if len(parts) == 1:
            merged[name] = parts[0]
            continue
        if any(True for part in parts for _ in part.named_parameters(recurse=False)):
            raise ValueError(f"{name} holds parameters of two stages directly: split at modules inside it")
        holder = nn.Module()
        for child_name, child in _merge([dict(part.named_children()) for part in parts]).items():
            holder.add_module(child_name, child)
        merged[name] = holder
    return merged


def stage_indices(pipeline_rank: int, ranks: int, stages_per_rank: int) -> list[int]:
    """The stages a pipeline rank holds: ``rank, rank + p, rank + 2p...`` (torch's loop placement).

    Example::

        >>> stage_indices(1, ranks=2, stages_per_rank=2)
        [1, 3]
    """
    return [pipeline_rank + ranks * turn for turn in range(stages_per_rank)]


def stage_group(mesh: Any, pipeline_rank: int) -> Any:
    """The process group of the ranks that hold ``pipeline_rank``'s stages: its data x tensor ranks.

    ``mesh``: the strategy's ``(pipeline, shard, tensor)`` device mesh. With one data rank a stage's ranks are its
    tensor ranks, whose group the mesh has already. Otherwise every rank creates every stage's group, in one order
    (torch's rule for ``new_group``), and keeps its own.
    """
    import torch.distributed as dist

    if mesh.size(1) == 1:
        return mesh[mesh.mesh_dim_names[2]].get_group()
    ranks_of_stages = mesh.mesh.reshape(mesh.size(0), -1).tolist()
    return [dist.new_group(ranks) for ranks in ranks_of_stages][pipeline_rank]


def split_batch(batch: Any) -> tuple[tuple[Any, ...], Any]:
    """``(inputs, target)`` of a batch: the first stage's positional inputs, and the loss's target.

    Raises:
        BadInputError: the batch is not a pair.

    """
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise BadInputError(
            f"pipeline parallelism takes batches as (inputs, target) pairs; got {type(batch).__name__}"
            + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        )
    inputs, target = batch
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), target


def example_microbatch_inputs(
    loader: DataLoader, microbatches: int, replicas: int, training: bool = True
) -> tuple[Any, ...]:
    """One micro-batch's inputs, built from the loader's first samples (the tracer needs their shapes).

    ``training``: the loader is the training one, whose every batch must have the full size (an evaluation
    loop leaves a smaller last batch out instead).

    Raises:
        BadInputError: no fixed batch size, or an epoch that would end on a smaller batch (a pipeline's shapes
            are fixed at its first step).

    """
    batch_size = loader.batch_size
    if batch_size is None:
        raise BadInputError("pipeline parallelism needs a training DataLoader with a batch_size (a fixed one)")
    dataset = loader.dataset
    if training and hasattr(dataset, "__len__") and not loader.drop_last:
        per_replica = math.ceil(len(dataset) / replicas)
        if per_replica % batch_size:
            raise BadInputError(
                f"the data ends each epoch on a batch of {per_replica % batch_size}, not {batch_size}: a pipeline's "
                "shapes are fixed at its first step; set drop_last=True in the training DataLoader"
            )
    size = batch_size // microbatches
    # As DataLoader's own fetchers build a batch: a batched read where the dataset offers one, else item by item.
    if isinstance(dataset, IterableDataset):
        samples: Any = list(itertools.islice(iter(dataset), size))
    elif hasattr(dataset, "__getitems__"):
        samples = dataset.__getitems__(list(range(size)))
    else:
        samples = [dataset[index] for index in range(size)]
    return split_batch(loader.collate_fn(samples))[0]


def example_loader(trainer: Any) -> DataLoader:
    """The loader whose first samples give the example micro-batch: the one of the loop about to run.

    Raises:
        BadInputError: neither the datamodule nor the model gives that loader.

    """
    stage = {"validate": "val", "test": "test"}.get(str(getattr(trainer.state.fn, "value", trainer.state.fn)), "train")
    for source in (trainer.datamodule, trainer.lightning_module):
        if source is None:
            continue
        try:
            loader = getattr(source, f"{stage}_dataloader")()
        except Exception:  # Lightning's default hook raises: not defined there
            continue
        if isinstance(loader, DataLoader):
            return loader
    raise BadInputError(
        f"pipeline parallelism builds its stages from the {stage} data's first batch: give a datamodule or a "
        f"LightningModule with {stage}_dataloader() returning a DataLoader (loaders passed to fit() are not read)"
    )
