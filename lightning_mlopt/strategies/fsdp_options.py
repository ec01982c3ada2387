"""FSDP's knobs in one object: which modules are units, mixed precision, offload, resharding, recomputation.

FSDPStrategy reads them from YAML's flat keys and keeps them here; every strategy that shards with FSDP (HSDP,
FSDP x TP) takes the same keys whole (``**fsdp_options``), so a knob added here reaches all of them at once.

Example::

    options = FSDPOptions.from_keys(wrap_classes=["lightning_mlopt.demos.gpt.TransformerBlock"], param_dtype="bfloat16")
    options.check(model)                          # BadInputError: a class the model does not have
    options.recompute_activations(model)          # activation checkpointing, names unchanged
    for unit in options.units(model):
        fully_shard(unit, **options.fully_shard_kwargs(mesh, "cuda"))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from lightning_mlopt._compat import composable_checkpoint
from lightning_mlopt.strategies.fsdp_units import import_module_class, require_classes, select_by_size

DType = Literal["float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class FSDPOptions:
    """How FSDP shards a model: the YAML keys of :class:`~lightning_mlopt.strategies.FSDPStrategy`, checked.

    Attributes:
        wrap_classes: module classes that become FSDP units (parameters gathered just before their forward).
        min_params_to_wrap: also any module holding at least this many not-yet-wrapped parameters.
        reshard_after_forward: free gathered parameters after forward (False: keep them until backward).
        activation_checkpointing: module classes whose activations are recomputed in backward.
        param_dtype: dtype of gathered parameters for compute; None keeps fp32.
        reduce_dtype: dtype of the gradient reduce-scatter; None uses ``param_dtype``.
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.

    """

    wrap_classes: tuple[type[nn.Module], ...] = ()
    min_params_to_wrap: int | None = None
    reshard_after_forward: bool = True
    activation_checkpointing: tuple[type[nn.Module], ...] = ()
    param_dtype: DType | None = None
    reduce_dtype: DType | None = None
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if self.min_params_to_wrap is not None and self.min_params_to_wrap < 1:
            raise ValueError(f"min_params_to_wrap must be >= 1, got {self.min_params_to_wrap}")

    @classmethod
    def from_keys(
        cls,
        wrap_classes: Sequence[str] = (),
        min_params_to_wrap: int | None = None,
        reshard_after_forward: bool = True,
        activation_checkpointing: Sequence[str] = (),
        param_dtype: DType | None = None,
        reduce_dtype: DType | None = None,
        cpu_offload: bool = False,
    ) -> FSDPOptions:
        """The options from YAML's values: classes given by import path (a ValueError names one that fails)."""
        return cls(
            wrap_classes=tuple(import_module_class(path, "wrap_classes") for path in wrap_classes),
            min_params_to_wrap=min_params_to_wrap,
            reshard_after_forward=reshard_after_forward,
            activation_checkpointing=tuple(
                import_module_class(path, "activation_checkpointing") for path in activation_checkpointing
            ),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            cpu_offload=cpu_offload,
        )

    def check(self, module: nn.Module) -> None:
        """BadInputError for a class in ``wrap_classes`` or ``activation_checkpointing`` that ``module`` lacks."""
        require_classes(module, self.wrap_classes, "wrap_classes")
        require_classes(module, self.activation_checkpointing, "activation_checkpointing")

    def recompute_activations(self, module: nn.Module) -> None:
        """Activation checkpointing on each module of an ``activation_checkpointing`` class, in place.

        The composable form keeps parameter names unchanged (a wrapper would add a prefix that breaks checkpoints
        saved without it).
        """
        if not self.activation_checkpointing:
            return
        checkpoint = composable_checkpoint()
        for sub in module.modules():
            if isinstance(sub, self.activation_checkpointing):
                checkpoint(sub)  # recomputed in backward instead of stored

    def units(self, module: nn.Module) -> set[nn.Module]:
        """The modules of ``module`` that become units of their own: by class, then by size."""
        wrapped = (
            {sub for sub in module.modules() if isinstance(sub, self.wrap_classes)} if self.wrap_classes else set()
        )
        if self.min_params_to_wrap is not None:
            select_by_size(module, self.min_params_to_wrap, wrapped, is_root=True)
        return wrapped

    def fully_shard_kwargs(self, mesh: DeviceMesh, device_type: str) -> dict[str, Any]:
        """``fully_shard``'s keyword arguments over ``mesh`` (offloaded memory pinned on CUDA)."""
        param_dtype = _dtype(self.param_dtype)
        precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=_dtype(self.reduce_dtype) or param_dtype)
        offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if self.cpu_offload else OffloadPolicy()
        return {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": precision,
            "offload_policy": offload,
        }


def renamed_replicate_size(
    replicate_size: int | Literal["nodes"] | None, replicate_group_size: int | None
) -> int | Literal["nodes"] | None:
    """``replicate_size``, or the value given under its earlier name (with a warning saying the new one)."""
    if replicate_group_size is None:
        return replicate_size
    if replicate_size is not None and replicate_size != replicate_group_size:
        raise ValueError(
            f"replicate_group_size ({replicate_group_size}) is the earlier name of replicate_size ({replicate_size}): "
            "give only replicate_size"
        )
    rank_zero_warn("FSDPStrategy: replicate_group_size is now replicate_size (same meaning); rename the key")
    return replicate_group_size


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


__all__ = ["DType", "FSDPOptions", "renamed_replicate_size"]
