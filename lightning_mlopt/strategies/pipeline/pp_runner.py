"""One pipeline rank's stages and their schedules: a batch in, the batch's loss out, the same on every stage.

:class:`PipelineRunner` is what :class:`~lightning_mlopt.strategies.PipelineParallelStrategy` calls from
Lightning's hooks: ``run(batch, train=True)`` runs every micro-batch's forward and backward through the training
schedule (timed by the bubble clock), ``train=False`` the forward only, through the stages traced in eval mode
where the model has them. The loss comes from the last stage and is shared over the pipeline in one all-reduce.

Example::

    runner = PipelineRunner(SCHEDULES["1f1b"], 8, stages, stages, model.pipeline_loss, group, device)
    loss = runner.run(batch, train=True, loss_scale=1 / 8)   # gradients of the batch's mean loss accumulated
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.strategies.pipeline.pp_schedule import BubbleClock, ScheduleKind
from lightning_mlopt.strategies.pipeline.pp_split import split_batch


class PipelineRunner:
    """The stages of one pipeline rank under a schedule, for training and for evaluation.

    Args:
        kind: the schedule.
        microbatches: micro-batches per batch.
        stages: this rank's stages (``PipelineStage``) for training.
        eval_stages: the same stages traced in eval mode, or ``stages`` when the model does not depend on it.
        loss_of: one micro-batch's mean loss from the last stage's output and the target (``pipeline_loss``).
        group: the pipeline's process group.
        device: where the loss lives.
        peer_groups: more groups whose ranks must load this rank's batch (a stage's tensor-parallel ranks).

    """

    def __init__(
        self,
        kind: ScheduleKind,
        microbatches: int,
        stages: Sequence[Any],
        eval_stages: Sequence[Any],
        loss_of: Callable[[Tensor, Tensor], Tensor],
        group: Any,
        device: torch.device,
        peer_groups: Sequence[Any] = (),
    ) -> None:
        self.microbatches = microbatches
        self.group = group
        self._same_batch_groups = [group, *peer_groups]
        self.device = device
        self.clock = BubbleClock(stages)
        self.first = any(stage.is_first for stage in stages)
        self.last = any(stage.is_last for stage in stages)
        self._loss_scale = 1.0
        self._checked_batches = False

        def loss(output: Tensor, target: Tensor) -> Tensor:
            return loss_of(output, target) * self._loss_scale

        def schedule(of: Sequence[Any]) -> Any:
            return kind.schedule_class()(
                list(of) if kind.multi_stage else of[0],
                microbatches,
                loss_fn=loss,
                scale_grads=False,  # the loss is scaled instead: torch's would divide gradients accumulated before
            )

        self._train = schedule(stages)
        self._eval = self._train if eval_stages is stages else schedule(eval_stages)

    def run(self, batch: Any, train: bool, loss_scale: float) -> Tensor:
        """One batch through the pipeline; its mean loss, the same on every rank of the pipeline.

        ``loss_scale`` multiplies each micro-batch's loss before its backward (``1 / (m * accumulate)`` for the
        window's mean); the returned loss is the batch's mean, unscaled.
        """
        inputs, target = split_batch(batch)
        if not self._checked_batches:
            self._checked_batches = True
            check_same_batch((*inputs, target), self._same_batch_groups)
        self._loss_scale = loss_scale
        losses: list[Tensor] = []
        step = self._train.step if train else self._eval.eval
        with self.clock.step() if train else nullcontext():  # the bubble of training steps only
            step(
                *(inputs if self.first else ()),
                target=target if self.last else None,
                losses=losses if self.last else None,
                return_outputs=False,  # the last stage would keep and concatenate every micro-batch's output
            )
        if self.last:
            loss = torch.stack([loss.detach().float() for loss in losses]).sum()
        else:
            loss = torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.group)  # the last stage's value, given to every stage
        return loss / loss_scale / self.microbatches


def check_same_batch(tensors: Sequence[Any], groups: Sequence[Any]) -> None:
    """Every rank of ``groups`` loaded the same batch (the first stage's inputs, the last's target), or refuse.

    A dataset seeded by rank (workers seeded with the global rank), or sharded by ``dist.get_rank()``, would give
    the stages different samples: the loss would pair one sample's inputs with another's target, and a stage's
    tensor ranks would compute on different inputs. Each tensor's fingerprint (its sum, and its sum weighted by
    position, which a reordering changes) is reduced over each group in turn, so the ranks of several groups
    (pipeline, then tensor) all compare; then the verdict over the world, so that every rank raises alike and
    no other replica is left waiting in a collective.

    Raises:
        BadInputError: the ranks loaded different batches; what causes it.

    """
    values = []
    for tensor in tensors:
        if isinstance(tensor, Tensor):
            flat = tensor.detach().double().flatten()
            position = torch.arange(1, flat.numel() + 1, dtype=flat.dtype, device=flat.device)
            values += [flat.sum(), (flat * position).sum()]
    fingerprint = torch.stack(values)
    spread = torch.cat([fingerprint, -fingerprint])  # one MAX gives the largest and the smallest
    for group in groups:
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=group)
    count = len(values)
    differs = ~torch.isclose(spread[:count], -spread[count:], rtol=1e-12, atol=0.0)
    verdict = differs.any().to(torch.int32).reshape(1)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)  # every replica learns it
    if verdict.item():
        raise BadInputError(
            "the ranks of a pipeline (or of a stage's tensor-parallel group) loaded different batches: each must "
            "load the same one (a dataset that shuffles or augments by rank, or shards by torch.distributed's "
            "rank, cannot feed a pipeline)"
        )


def loop_name(loss_name: str, loop: str) -> str:
    """``train/loss`` -> ``val/loss``; a name without ``train`` gets the loop's prefix (``loss`` -> ``val/loss``).

    Example::

        >>> loop_name("train/loss", "test"), loop_name("loss", "val")
        ('test/loss', 'val/loss')
    """
    return loss_name.replace("train", loop, 1) if "train" in loss_name else f"{loop}/{loss_name}"
