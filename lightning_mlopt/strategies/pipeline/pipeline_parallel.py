"""Pipeline parallelism (and FSDP over pipeline replicas) from YAML, for an unmodified LightningModule.

Lightning has no pipeline parallelism (Lightning-AI/pytorch-lightning#17180): its loop runs one forward and
one backward per batch, and a pipeline schedule runs the forwards and backwards of all micro-batches itself,
interleaved across ranks. :class:`PipelineParallelStrategy` hosts the schedule inside Lightning's automatic
optimisation, without changing the loop:

- ``training_step`` (the strategy's) zeroes the gradients at the start of an accumulation window, runs
  ``schedule.step`` (every micro-batch's forward and backward), and sets the gradients aside, so the loop's
  ``zero_grad`` that follows finds nothing to clear. It returns and logs the batch's loss (the last stage's).
- ``backward`` (the strategy's) puts the gradients back between the ``on_before_backward`` and
  ``on_after_backward`` hooks instead of running autograd; clipping, ``on_before_optimizer_step``, the
  optimizer and LR schedulers then run as always.

Example::

    strategy = PipelineParallelStrategy(split_points=["model.layers.2"], microbatches=4, schedule="1f1b")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mlopt.checkpoint.optimizer_keys import flattened_state
from lightning_mlopt.distributed.mesh_plan import Dimension, data_rank
from lightning_mlopt.distributed.sharding import PartialGradients, PipelineSharding
from lightning_mlopt.distributed.state import register_pipeline_stage
from lightning_mlopt.exceptions import BadInputError, said_by_rank_zero
from lightning_mlopt.hooks import RunsPipeline
from lightning_mlopt.strategies import fsdp
from lightning_mlopt.strategies.fsdp import FSDPStrategy
from lightning_mlopt.strategies.pipeline.pp_buffers import keep_out_of_checkpoints, non_persistent_buffers
from lightning_mlopt.strategies.pipeline.pp_runner import PipelineRunner, loop_name
from lightning_mlopt.strategies.pipeline.pp_schedule import (
    BubbleClock,
    ScheduleKind,
    bubble_advice,
    schedule_named,
)
from lightning_mlopt.strategies.pipeline.pp_split import (
    DeclaresPipelineLoss,
    check_split,
    depends_on_mode,
    example_loader,
    example_microbatch_inputs,
    install_stages,
    split_batch,
    stage_indices,
)
from lightning_mlopt.strategies.pipeline.pp_tensor import WholeStages, stage_split
from lightning_mlopt.strategies.spec import StrategySpec

PIPELINE: Final = "pipeline"  # the mesh dimension outermost of all (pipelines span nodes)


class PipelineParallelStrategy(FSDPStrategy, RunsPipeline):
    """Pipeline parallelism: consecutive stages of the model on consecutive ranks, micro-batches streamed through.

    The world is a mesh ``(pipeline, shard)``: ``pipeline_parallel_size`` ranks each hold one stage (or
    ``stages_per_rank`` for the interleaved schedules), and ``world / pipeline_parallel_size`` pipeline replicas
    each train on their own slice of the data, their stages sharded by FSDP over the data dimension when it is
    > 1. The model is cut at ``split_points`` by torch's tracer (``torch.export``), unmodified; it declares one
    method, ``pipeline_loss(output, target)``
    (:class:`~lightning_mlopt.strategies.pipeline.pp_split.DeclaresPipelineLoss`).
    With ``tensor_parallel_size`` > 1 the mesh is ``(pipeline, shard, tensor)`` (3D): torch.fx's tracer cuts the
    model instead, keeping its module calls, and each stage's planned layers are split over that many
    consecutive ranks (:mod:`~lightning_mlopt.strategies.pipeline.pp_tensor`).
    Batches are ``(inputs, target)`` pairs; every rank of a pipeline loads the same batch (the first stage uses
    the inputs, the last the target).

    Args:
        pipeline_parallel_size: pipeline ranks; must divide the world size.
        split_points: the modules where stages 2, 3, ... begin, in forward order, e.g. ``["model.layers.2"]``
            (``pipeline_parallel_size * stages_per_rank - 1`` names).
        microbatches: micro-batches per batch; must divide the batch size. At least 4 per pipeline rank keeps
            the bubble under 20% (a warning says so below that).
        schedule: ``gpipe``, ``1f1b`` (default: the least activation memory), ``interleaved_1f1b`` or
            ``looped_bfs`` (several stages per rank); see :mod:`lightning_mlopt.strategies.pipeline.pp_schedule`.
        stages_per_rank: stages each rank holds; None: the schedule's default (1, or 2 for the interleaved ones).
        loss_name: the name the training loss is logged under; ``train`` in it becomes ``val`` and ``test`` for
            the other loops (``loss`` becomes ``val/loss``). Each pipeline logs its own replica's loss.
        reshard_after_forward: FSDP over the data dimension; False (default here) keeps a stage's parameters
            gathered across its micro-batches instead of gathering them once per micro-batch.
        tensor_parallel_size: ranks that split each stage's planned layers (1: none); must divide the world
            with ``pipeline_parallel_size``. Data-parallel size: ``world / (pipeline x tensor)``.
        tp_plan: as for :class:`~lightning_mlopt.strategies.TensorParallelStrategy` (None: the model's own),
            without the ``loss_parallel`` styles (the last stage hands ``pipeline_loss`` whole logits).
        timeout_minutes, process_group_backend: as for :class:`~lightning_mlopt.strategies.FSDPStrategy`. The
            run is fp32 (``precision: 32-true``): the stages exchange activations in the traced dtype.

    Raises:
        ValueError: a size below 1, or an unknown schedule.

    Example::

        strategy = PipelineParallelStrategy(
            pipeline_parallel_size=2, split_points=["model.layers.2"], microbatches=8, schedule="1f1b"
        )
        trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy)  # 2 x 2: pipeline x data

    """

    sharding: PipelineSharding  # set per instance: it knows the pipeline's size

    def __init__(
        self,
        pipeline_parallel_size: int = 2,
        split_points: Sequence[str] = (),
        microbatches: int = 4,
        schedule: str = "1f1b",
        stages_per_rank: int | None = None,
        loss_name: str = "train/loss",
        reshard_after_forward: bool = False,
        tensor_parallel_size: int = 1,
        tp_plan: Mapping[str, str] | None = None,
        timeout_minutes: float = 30.0,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
    ) -> None:
        sizes = {"pipeline_parallel_size": pipeline_parallel_size, "microbatches": microbatches}
        for key, value in {**sizes, "tensor_parallel_size": tensor_parallel_size}.items():
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        kind = schedule_named(schedule)
        per_rank = kind.stages_per_rank if stages_per_rank is None else stages_per_rank
        if per_rank < 1 or (per_rank > 1 and not kind.multi_stage):
            raise ValueError(
                f"stages_per_rank={per_rank}: {kind.name} runs one stage per rank; "
                "interleaved_1f1b and looped_bfs run several"
            )
        super().__init__(
            reshard_after_forward=reshard_after_forward,
            timeout_minutes=timeout_minutes,
            process_group_backend=process_group_backend,
        )
        self.pipeline_parallel_size = pipeline_parallel_size
        self.sharding = PipelineSharding(pipeline_parallel_size)
        self.split_points = list(split_points)
        self.microbatches = microbatches
        self.schedule: ScheduleKind = kind
        self.stages_per_rank = per_rank
        self.loss_name = loss_name
        self.tensor_parallel_size = tensor_parallel_size
        self.tp_plan = dict(tp_plan) if tp_plan is not None else None
        self._runner: PipelineRunner | None = None  # this rank's stages and schedules, built at set-up
        self._stages: list[Any] = []
        self._set_aside: list[tuple[Tensor, Tensor | None]] | None = None  # gradients between step and backward
        self._batch_size: int | None = None  # the loader's, which every batch through the pipeline must have
        self._skipped_batch = False
        self._split_modules = 0  # this rank's modules the tensor-parallel plan split
        self._partial_gradients = PartialGradients()  # sequence-parallel norms' (PP x TP): see post_backward

    @property
    def stages(self) -> int:
        """Stages in all: ``pipeline_parallel_size * stages_per_rank``."""
        return self.pipeline_parallel_size * self.stages_per_rank

    @property
    def bubble_clock(self) -> BubbleClock | None:
        """The clock of this rank's stages (None before set-up): PerformanceMonitor takes its idle time."""
        return None if self._runner is None else self._runner.clock

    @property
    def theoretical_bubble(self) -> float:
        """The schedule's idle share of a step with equal stages and free communication."""
        return self.schedule.theoretical_bubble(self.pipeline_parallel_size, self.microbatches, self.stages_per_rank)

    def bubble_advice(self, measured: float, worst_rank: int) -> str:
        """One line for a bubble over 20% (PerformanceMonitor's warning)."""
        ranks, m = self.pipeline_parallel_size, self.microbatches
        return bubble_advice(measured, self.theoretical_bubble, worst_rank, self.schedule, ranks, m)

    mesh_dimensions_kept: tuple[Dimension, ...] = (PIPELINE, "shard")

    @override
    def plan_dimensions(self) -> dict[Dimension, tuple[int, str]]:
        """``pipeline x shard [x tensor]``: FSDP's, with the pipeline outermost and the tensor dimension innermost."""
        pipeline = (self.pipeline_parallel_size, "pipeline_parallel_size")
        return {
            **super().plan_dimensions(),
            "pipeline": pipeline,
            "tensor": (self.tensor_parallel_size, "tensor_parallel_size"),
        }

    @property
    def data_parallel_size(self) -> int:
        """Pipeline replicas: ``world / (pipeline_parallel_size x tensor_parallel_size)``."""
        return self.mesh_plan.data_parallel_size

    @property
    def pipeline_group(self) -> Any:
        """The process group of this rank's pipeline (its stages' sends and receives)."""
        return self.device_mesh[PIPELINE].get_group()

    @override
    def check_model(self, module: nn.Module) -> None:
        """The split against the model, the sizes against the world, the schedule's rules (before launch)."""
        self._stage_split_of(module)  # the sizes against the world first, then the tensor-parallel plan
        self.schedule.check_microbatches(self.microbatches, self.pipeline_parallel_size, self.stages)
        check_split(module, self.split_points, self.stages)

    def _stage_split_of(self, module: nn.Module) -> WholeStages:
        """What tensor parallelism does to the stages (nothing at size 1); the sizes and the plan checked."""
        return stage_split(module, self.tp_plan, self.mesh_plan.tensor)

    @override
    def check_batch_size(self, batch_size: int | None) -> None:
        """``microbatches`` must divide the batch size (checked again at set-up, from the loader itself)."""
        if batch_size is not None and batch_size % self.microbatches:
            raise BadInputError(
                f"microbatches={self.microbatches} must divide the batch size ({batch_size}); choose a divisor of it"
            )

    @override
    def setup(self, trainer: Trainer) -> None:
        if trainer.lightning_module.automatic_optimization is False:
            raise BadInputError(
                "pipeline parallelism runs each batch's forward and backward in its schedule: manual "
                "optimisation (automatic_optimization = False) cannot run under it"
            )
        if str(trainer.precision) not in ("32-true", "32"):
            # The stages' receive buffers take the traced activations' dtype (fp32): another dtype on the wire
            # would be read as the wrong number of bytes.
            raise BadInputError(
                f"trainer.precision={trainer.precision}: pipeline parallelism runs in fp32 (32-true) for now"
            )
        super().setup(trainer)
        rank_stages = ", ".join(str(stage.stage_index) for stage in self._stages)
        held = sum(p.numel() for p in self._trained_module.parameters())
        line = f"pipeline stage(s) {rank_stages} of {self.stages}: {held:,}"
        split = f", {self._split_modules} modules split {self.tensor_parallel_size} ways" if self._split_modules else ""
        if data_rank(self.device_mesh) == 0:  # one line per pipeline rank, the first replica's
            print(f"[rank {self.global_rank}] {line} parameters{split}")

    @override
    def _shard(self, module: nn.Module) -> None:
        """Trace and cut the model, keep this rank's stages, FSDP them over the data dimension, build the schedule."""
        self.check_model(module)
        split = self._stage_split_of(module)
        self.sharding.local_statistics |= split.local_statistics(module)  # ReplicaConsistencyCheck's, before the cut
        transient = non_persistent_buffers(module)  # the tracer loses the flag: put back after the cut
        trainer = self._trained_module.trainer
        with said_by_rank_zero(self.global_rank):
            loader = example_loader(trainer)
            if loader.batch_size is not None:
                self.check_batch_size(loader.batch_size)
            fitting = trainer.state.fn == TrainerFn.FITTING
            inputs = example_microbatch_inputs(loader, self.microbatches, self.data_parallel_size, fitting)
            self._batch_size = loader.batch_size
            pipe = split.trace(module, inputs, self.split_points, training=True)
            # Evaluation needs the model traced in eval mode (dropout off, running statistics): the same
            # parameter objects, other graphs. Under FSDP the stages' parameters become FSDP's own, which a
            # second set of stage modules cannot share; there evaluation runs the training graphs.
            mode_dependent = depends_on_mode(module, inputs)
            separate_eval = mode_dependent and self.data_parallel_size == 1
            eval_pipe = split.trace(module, inputs, self.split_points, training=False) if separate_eval else None
            if mode_dependent and not separate_eval and self.global_rank == 0:
                # Said here (stacklevel 1): one level up is FSDPStrategy.setup's call of _shard, not the pipeline.
                warnings.warn(
                    "pipeline x data parallel: validation and test run the model as traced for training (dropout "
                    "on, batch statistics): its output depends on the mode",
                    stacklevel=1,
                )
        pipeline_rank = self.device_mesh[PIPELINE].get_local_rank()
        indices = stage_indices(pipeline_rank, self.pipeline_parallel_size, self.stages_per_rank)
        group = self.pipeline_group
        # In place, on the module objects the stages (and eval stages) call.
        self._split_modules = split.split([pipe.get_stage_module(index) for index in indices], self.device_mesh)
        self._stages = [pipe.build_stage(index, self.root_device, group) for index in indices]
        if self.data_parallel_size > 1:
            for stage in self._stages:  # one FSDP unit per stage: the schedule reduces its gradients once a step
                fully_shard(stage.submod, **self._shard_options())
        self.sharding.model_parameter_names = tuple(name for name, _ in module.named_parameters())
        self.sharding.stage_group = split.stage_group(self.device_mesh, pipeline_rank)  # copies of a stage
        install_stages(module, [stage.submod for stage in self._stages])
        keep_out_of_checkpoints(module, transient)
        register_pipeline_stage(module, group)
        eval_stages = self._stages
        if eval_pipe is not None:
            eval_stages = [eval_pipe.build_stage(index, self.root_device, group) for index in indices]
        assert isinstance(module, DeclaresPipelineLoss)  # check_split said so
        peers = split.batch_peers(self.device_mesh)  # ranks that read one batch together, beyond the pipeline's
        loss_of, device = module.pipeline_loss, self.root_device
        self._runner = PipelineRunner(
            self.schedule, self.microbatches, self._stages, eval_stages, loss_of, group, device, peers
        )
        advice = self.schedule.few_microbatches(self.pipeline_parallel_size, self.microbatches, self.stages_per_rank)
        if advice is not None and self.global_rank == 0:
            warnings.warn(advice, stacklevel=1)  # here, not at FSDPStrategy.setup's call of _shard

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Run the schedule on the batch (forward and backward of every micro-batch); return its loss."""
        module = self._trained_module
        trainer = module.trainer
        accumulate = trainer.accumulate_grad_batches
        batch = args[0] if args else kwargs["batch"]
        # Lightning passes batch_idx only to a training_step that declares it: the loop's own count instead.
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        if batch_idx % accumulate == 0:  # the start of an accumulation window: the loop zeroes later, too late
            module.zero_grad(set_to_none=True)
        assert self._runner is not None
        with self.precision_plugin.train_step_context():  # gradients of the accumulation window's mean loss
            loss = self._runner.run(batch, train=True, loss_scale=1.0 / (self.microbatches * accumulate))
        params = [p for p in module.parameters() if p.grad is not None]
        self._set_aside = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None  # the loop's zero_grad comes next and would clear them
        module.log(self.loss_name, loss, prog_bar=True)
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Put back the gradients the schedule computed, between the backward hooks; no autograd here."""
        if self._set_aside is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        module = self._trained_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for param, grad in self._set_aside:
            param.grad = grad
        self._set_aside = None
        self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """FSDP's, then sequence-parallel norms' partial gradients made whole, as under tensor parallelism."""
        super().post_backward(closure_loss)
        self._partial_gradients.settle(self._trained_module)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The stages' optimizer state, flattened (one entry a parameter: the stages' merge in DCP)."""
        assert self.model is not None
        return flattened_state(self.model, getattr(optimizer, "optimizer", optimizer))  # a LightningOptimizer wraps it

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The part of a checkpoint (a DCP folder or one full file, by whole-model names) this rank's stages hold."""
        return self._load_here(Path(self.broadcast(checkpoint_path)), weights_only, part_of_model=True)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.val_step_context():
            return self._evaluate(args[0], loop_name(self.loss_name, "val"))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self.precision_plugin.test_step_context():
            return self._evaluate(args[0], loop_name(self.loss_name, "test"))

    def _evaluate(self, batch: Any, name: str) -> Tensor | None:
        """The batch's loss, logged (mean over the run's batches); a batch of another size is left out, once said.

        The stages' shapes are fixed at the first step, and every rank sees the same batch sizes: each skips alike.
        """
        size = len(split_batch(batch)[1])
        if size != self._batch_size:
            if not self._skipped_batch and self.global_rank == 0:
                warnings.warn(
                    f"pipeline: {name} leaves out batches of {size} samples, not {self._batch_size} (the pipeline's "
                    "shapes are fixed): give the loader drop_last=True or a size that divides the data",
                    stacklevel=1,  # here: one level up is validation_step, which says nothing more
                )
            self._skipped_batch = True
            return None
        assert self._runner is not None
        loss = self._runner.run(batch, train=False, loss_scale=1.0 / self.microbatches)
        self._trained_module.log(name, loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise BadInputError("predict under pipeline parallelism is not offered: predict with ddp or fsdp")


SPEC = StrategySpec(
    PipelineParallelStrategy,
    names={"pp": ({}, "pipeline parallel: stages cut at split_points, micro-batches through a schedule (1F1B)")},
    layout=fsdp.SPEC.layout,  # DCP folders with whole-model names, read and resharded like FSDP's
    overlays=("pp.yaml",),
)

__all__ = ["PipelineParallelStrategy"]
