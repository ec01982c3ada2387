"""Tensor parallelism (and FSDP x TP) from a YAML plan, applied to an unmodified LightningModule."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final, Protocol, runtime_checkable

from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mlopt.distributed.mesh_plan import Dimension
from lightning_mlopt.distributed.sharding import PartialGradients, SubMeshSharding
from lightning_mlopt.strategies import fsdp
from lightning_mlopt.strategies.fsdp import FSDPStrategy
from lightning_mlopt.strategies.spec import StrategySpec
from lightning_mlopt.strategies.tensor.tp_loss import split_logits_loss
from lightning_mlopt.strategies.tensor.tp_plan import ResolvedPlan, plan_of

TENSOR: Final = "tensor"  # the mesh's dimensions: (shard, tensor), data-parallel outermost


@runtime_checkable
class DeclaresTPPlan(Protocol):
    """A LightningModule that ships its own tensor-parallel plan (used when the strategy is given none).

    Example::

        class MyModel(LightningModule):
            tp_plan = {"net.*.fc1": "colwise", "net.*.fc2": "rowwise"}
    """

    tp_plan: Mapping[str, str]


class TensorParallelStrategy(FSDPStrategy):
    """Tensor parallelism from a plan in YAML, with FSDP over the data-parallel dimension (2D) when it is > 1.

    The world is a 2-D mesh ``(shard, tensor)`` (one :class:`~lightning_mlopt.distributed.mesh_plan.MeshPlan`):
    ``tensor_parallel_size`` consecutive ranks (one node's GPUs, where the all-reduces are cheap) split each
    planned layer Megatron-style (column-wise, then row-wise, one all-reduce per pair), and
    ``world / tensor_parallel_size`` data-parallel groups each get their own slice of the data, their parameters
    sharded by FSDP with the FSDP keys below (``wrap_classes``, ``reshard_after_forward``, mixed precision,
    activation checkpointing). The user's module is not changed; the plan names its modules (see
    :mod:`lightning_mlopt.strategies.tensor.tp_plan` for the styles) and is checked before any process group starts.
    Checkpoints are DCP folders, like FSDP's, and load at another layout.

    A model is tensor-parallel-correct when it works from the width it is given: heads counted from the local
    projection's width (``view(batch, time, -1, head_dim)``, never a fixed head count), and a fused projection
    laid out so that a column split keeps whole heads.

    Args:
        tensor_parallel_size: ranks that split each planned layer; must divide the world size. None: each
            node's devices (then the data-parallel dimension is the node count).
        tp_plan: module-name glob -> style, e.g. ``{"model.layers.*.mlp.0": "colwise"}``. None: the model's own
            ``tp_plan`` attribute (:class:`DeclaresTPPlan`).
        **fsdp_options: every key of :class:`~lightning_mlopt.strategies.FSDPStrategy`, whole (the FSDP ones
            act when the data-parallel dimension is > 1; activation checkpointing always). ``replicate_size``
            makes it HSDP x TP: ``replicate x shard x tensor``.

    Raises:
        ValueError: ``tensor_parallel_size`` < 1.

    Example::

        strategy = TensorParallelStrategy(
            tensor_parallel_size=2,
            tp_plan={"model.layers.*.attn.qkv": "colwise", "model.layers.*.attn.proj": "rowwise"},
        )
        trainer = Trainer(accelerator="cpu", devices=4, strategy=strategy)  # 2 x 2: FSDP x TP

    """

    sharding = SubMeshSharding()  # a parameter left out of the plan is held by every tensor-parallel rank

    def __init__(
        self, tensor_parallel_size: int | None = None, tp_plan: Mapping[str, str] | None = None, **fsdp_options: Any
    ) -> None:
        if tensor_parallel_size is not None and tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        super().__init__(**fsdp_options)
        self._requested_tensor_parallel_size = tensor_parallel_size
        self._partial_gradients = PartialGradients()  # see post_backward
        self._splits_logits = False  # the plan leaves the logits split into the loss (set when sharding)
        self._in_loss_context = False
        self.tp_plan = dict(tp_plan) if tp_plan is not None else None

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks that split each planned layer (each node's devices unless set)."""
        return self._requested_tensor_parallel_size or self.num_processes

    mesh_dimensions_kept: tuple[Dimension, ...] = ("shard", TENSOR)

    @override
    def plan_dimensions(self) -> dict[Dimension, tuple[int, str]]:
        """``[replicate x] shard x tensor``: FSDP's (HSDP's) data dimensions, each layer split over the innermost."""
        return {**super().plan_dimensions(), TENSOR: (self.tensor_parallel_size, "tensor_parallel_size")}

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel groups: ``world / tensor_parallel_size``."""
        return self.mesh_plan.data_parallel_size

    def plan_for(self, module: nn.Module) -> ResolvedPlan:
        """The plan resolved against ``module`` and checked (the CLI calls it through ``check_model``).

        Raises:
            BadInputError: no plan, a world size the tensor-parallel size does not divide, or a plan that does
                not fit the model (see :func:`~lightning_mlopt.strategies.tensor.tp_plan.resolve`).

        """
        return plan_of(module, self.tp_plan, self.mesh_plan.tensor)  # the sizes checked first

    @override
    def check_model(self, module: nn.Module) -> None:
        """FSDP's check of the class names, then the plan's (globs, styles, dimensions, consumers)."""
        super().check_model(module)
        self.plan_for(module)

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """FSDP's, then the gradients backward left as partial sums (sequence parallelism's norms) made whole."""
        super().post_backward(closure_loss)
        self._partial_gradients.settle(self._trained_module)

    @contextmanager
    def _loss_context(self) -> Iterator[None]:
        """The ``loss_parallel`` context of torch where the plan leaves the logits split into the loss, else nothing.

        Entered once: ``manual_backward`` calls ``backward`` inside ``training_step``, and torch's context
        cannot nest (its exit removes the handlers the outer one would remove again).
        """
        if not self._splits_logits or self._in_loss_context:
            yield
            return
        self._in_loss_context = True
        try:
            with split_logits_loss():
                yield
        finally:
            self._in_loss_context = False

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._loss_context():
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        with self._loss_context():  # the backward of a loss on split logits needs torch's context too
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._loss_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        with self._loss_context():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        # A prediction made from split logits (e.g. their argmax) comes out split: hand it over whole.
        return apply_to_collection(super().predict_step(*args, **kwargs), DTensor, DTensor.full_tensor)

    @override
    def _shard(self, module: nn.Module) -> None:
        """Split the planned layers over the tensor dimension, then FSDP over the data dimension (if > 1).

        A module that parallelized itself in ``configure_model`` (Lightning's recipe) is left as it is.
        """
        if any(isinstance(param, DTensor) for param in module.parameters()):
            declared = self.tp_plan if self.tp_plan is not None else getattr(module, "tp_plan", None)
            self._splits_logits = declared is not None and self.plan_for(module).splits_logits
            return
        plan = self.plan_for(module)
        parallelize_module(module, self.device_mesh[TENSOR], plan.parallelize_plan())
        self._splits_logits = plan.splits_logits
        if self.data_parallel_size > 1:
            super()._shard(module)  # activation checkpointing and compile, then fully_shard on the data mesh
        else:
            self._prepare_model(module)


SPEC = StrategySpec(
    TensorParallelStrategy,
    names={
        "tp": ({}, "tensor parallel over each node's devices, FSDP across nodes; plan from YAML or the model"),
        "fsdp_tp": ({"tensor_parallel_size": 2}, "2-way tensor parallel, FSDP over the rest (2D)"),
    },
    layout=fsdp.SPEC.layout,  # DCP folders, read and resharded like FSDP's
    overlays=("tp.yaml", "fsdp_tp.yaml", "tp_hf.yaml", "tp_sp.yaml"),
)

__all__ = ["DeclaresTPPlan", "TensorParallelStrategy"]
