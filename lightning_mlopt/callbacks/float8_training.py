"""Float8Training: torchao's float8 linears from YAML, first of the strategy's steps, emulated without hardware.

float8 matmuls are the next speed lever after torch.compile on H100/H200 (torchao: 1.34-1.43x with rowwise scaling
on H200; torchtitan +28% on top of compile). torchao swaps each chosen ``nn.Linear`` for a ``Float8Linear`` that
keeps the same parameters (the same names and fp32 master weights: a checkpoint loads into a run without float8)
and casts its inputs, weights and gradients to float8 around each matmul. Our strategies call this callback first of
their steps (torchtitan's order: float8, tensor parallelism, activation checkpointing, compile, FSDP).

Which linears: every ``nn.Linear`` whose input and output sizes are multiples of 16 (float8 matmuls need it), but
the output head (the last linear, when it projects onto the vocabulary: its logits set the loss's precision) and
the names ``skip`` matches. On a CPU, or a GPU without float8 matmuls (before compute capability 8.9), torchao
emulates them in higher precision: the numerics of float8, not its speed, so a float8 configuration can be checked
on a laptop.
One line at start-up says what was converted, what was kept and whether it is emulated.

Example::

    trainer = Trainer(strategy=FSDPStrategy(...), callbacks=[Float8Training(recipe="rowwise")])

    # YAML: add configs/features/float8.yaml to a DDP or FSDP overlay (needs the float8 extra: torchao)
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_mlopt.exceptions import BadInputError
from lightning_mlopt.hooks import ConvertsModel, RunsPipeline

Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
_MULTIPLE = 16  # float8 matmuls need both sizes of a weight divisible by 16


class Float8Training(ConvertsModel, pl.Callback):
    """Train the model's linear layers in float8 (torchao), configured from YAML.

    Args:
        enabled: convert; False leaves the model as it is (the CLI's default: ``configs/features/float8.yaml``
            turns it on).
        recipe: torchao's scaling: ``tensorwise`` (one scale per tensor; the fastest), ``rowwise`` (one per row:
            more accurate), ``rowwise_with_gw_hp`` (rowwise, the weight gradient in high precision).
        skip: glob patterns of linear layer names to keep in high precision (``model.layers.0.*``), beside the
            output head and the layers whose sizes are not multiples of 16, which are always kept.
        fsdp_float8_all_gather: under FSDP, all-gather the weights in float8 (half the bytes of bf16); tensorwise
            only.
        emulate: emulate float8 matmuls in higher precision; None: on a CPU, or a GPU without float8 matmuls.

    Raises:
        ValueError: an unknown recipe, or ``fsdp_float8_all_gather`` with a rowwise recipe.
        BadInputError (at set-up): torchao missing, or a strategy it cannot run under (pipeline or tensor
            parallelism, DeepSpeed).

    Example::

        trainer = Trainer(callbacks=[Float8Training(recipe="tensorwise", fsdp_float8_all_gather=True)])

    """

    def __init__(
        self,
        enabled: bool = True,
        recipe: Recipe = "tensorwise",
        skip: Sequence[str] = (),
        fsdp_float8_all_gather: bool = False,
        emulate: bool | None = None,
    ) -> None:
        if recipe not in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
            raise ValueError(f"recipe must be tensorwise, rowwise or rowwise_with_gw_hp, got {recipe!r}")
        if fsdp_float8_all_gather and recipe != "tensorwise":
            raise ValueError(f"fsdp_float8_all_gather needs the tensorwise recipe, not {recipe!r} (torchao's)")
        self.enabled = enabled
        self.recipe = recipe
        self.skip = list(skip)
        self.fsdp_float8_all_gather = fsdp_float8_all_gather
        self.emulate = emulate
        self.converted: list[str] = []  # the layers' names, once converted
        self.kept: dict[str, str] = {}  # name -> why it stayed in high precision

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.converted, self.kept = [], {}  # once per fit
        if not self.enabled:
            return
        strategy = trainer.strategy
        refused = None
        if isinstance(strategy, RunsPipeline):
            refused = "pipeline parallelism"
        elif isinstance(strategy, DeepSpeedStrategy):
            refused = "DeepSpeed"
        elif getattr(getattr(strategy, "mesh_plan", None), "tensor", 1) > 1:
            refused = "tensor parallelism"
        if refused:
            raise BadInputError(
                f"float8: not under {refused} yet (DDP, FSDP, HSDP and one device are supported); remove "
                "configs/features/float8.yaml (float8.enabled: false) or choose another strategy"
            )
        try:
            _import_torchao_quietly()
        except ImportError:
            raise BadInputError(
                "float8: needs torchao: pip install 'lightning_mlopt[float8]' (or float8.enabled: false)"
            ) from None

    @override
    def convert_model(self, trainer: pl.Trainer, module: Any) -> None:
        """Swap the chosen linears of ``module`` for torchao's float8 linears (once; before any parallelism)."""
        if not self.enabled or self.converted:
            return
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        chosen, self.kept = self.choose(module)
        emulate = self.emulate if self.emulate is not None else not _has_float8_matmuls(trainer.strategy.root_device)
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(self.recipe),
            emulate=emulate,
            enable_fsdp_float8_all_gather=self.fsdp_float8_all_gather,
        )
        convert_to_float8_training(module, config=config, module_filter_fn=lambda _, name: name in chosen)
        self.converted = sorted(chosen)
        rank_zero_info(self.describe(emulate))

    def choose(self, module: nn.Module) -> tuple[set[str], dict[str, str]]:
        """The names of the linears to convert, and of those kept in high precision with the reason."""
        linears = [(name, sub) for name, sub in module.named_modules() if isinstance(sub, nn.Linear)]
        # The output head: the last linear, when it projects onto the vocabulary (the largest embedding's size).
        vocabulary = max((sub.num_embeddings for sub in module.modules() if isinstance(sub, nn.Embedding)), default=0)
        head = linears[-1][0] if linears and linears[-1][1].out_features == vocabulary else None
        chosen: set[str] = set()
        kept: dict[str, str] = {}
        for name, sub in linears:
            if name == head:
                kept[name] = "the output head"
            elif sub.in_features % _MULTIPLE or sub.out_features % _MULTIPLE:
                kept[name] = f"{sub.in_features}x{sub.out_features}: not multiples of {_MULTIPLE}"
            elif any(fnmatch.fnmatchcase(name, pattern) for pattern in self.skip):
                kept[name] = "float8.skip"
            else:
                chosen.add(name)
        if not chosen:
            raise BadInputError(
                f"float8: no linear layer to convert (kept: {', '.join(f'{n} ({why})' for n, why in kept.items())}"
                " or none in the model); remove configs/features/float8.yaml or float8.skip patterns"
            )
        return chosen, kept

    def describe(self, emulated: bool) -> str:
        """The start-up line: what was converted, how, what was kept and why.

        Example::

            float8 (tensorwise, emulated: no float8 matmuls on this device): 16 linear layers (model.layers.0.attn.qkv,
            ...); kept in high precision: model.lm_head (the output head)
        """
        how = f"{self.recipe}{', float8 all-gather' if self.fsdp_float8_all_gather else ''}"
        how += ", emulated: no float8 matmuls on this device" if emulated else ""
        kept = "; ".join(f"{name} ({why})" for name, why in self.kept.items())
        return f"float8 ({how}): {len(self.converted)} linear layer(s) ({self.converted[0]}, ...)" + (
            f"; kept in high precision: {kept}" if kept else ""
        )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.enabled and not self.converted:  # a strategy without the step (one device, Lightning's own)
            self.convert_model(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.converted and self.fsdp_float8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            # One all-reduce of every weight's scale after the update, not one per weight in the next forward.
            precompute_float8_dynamic_scale_for_fsdp(pl_module)


def _import_torchao_quietly() -> None:
    """Import torchao without its import-time lines: the kernels it lacks for this device and a torch deprecation.

    On a CPU, torchao 0.18 says it failed to load each CUDA kernel library, and registers an enum the way torch
    2.13 deprecates; neither concerns float8 training, and both would print in every rank's start-up.
    """
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _has_float8_matmuls(device: torch.device) -> bool:
    """Whether ``device`` multiplies float8 natively (CUDA compute capability 8.9: Ada, Hopper and newer)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


__all__ = ["Float8Training"]
