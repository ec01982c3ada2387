"""DeepSpeed ZeRO 1/2/3 with CPU offload, by preset name plus native keys, on CPU (gloo) as on GPU (NCCL)."""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Mapping
from concurrent.futures import Future
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mlopt._compat import (
    deepspeed_initialize_on_rank,
    deepspeed_micro_batch_size,
    deepspeed_without_shm_op,
    init_deepspeed_distributed,
    restore_zero_state,
    zero3_step_starts_at_the_outermost_forward,
)
from lightning_mlopt.checkpoint.layout import ONE_FILE, ZERO_PARTITIONS, CheckpointLayout
from lightning_mlopt.checkpoint.manifest import FileEntry
from lightning_mlopt.strategies.checkpoint_group import CheckpointGroupMixin
from lightning_mlopt.strategies.contract import DeclaresContract
from lightning_mlopt.strategies.deepspeed.build_locks import clear_stale_build_locks
from lightning_mlopt.strategies.deepspeed.deepspeed_startup import name_deepspeed_accelerator, uses_shm_op
from lightning_mlopt.strategies.deepspeed.zero_sharding import ZeroSharding
from lightning_mlopt.strategies.spec import StrategySpec

Preset = Literal["zero1", "zero2", "zero3", "zero3_offload"]

# The presets are plain DeepSpeed config blocks; `config:` in YAML is merged over them key by key.
PRESETS: dict[str, dict[str, Any]] = {
    "zero1": {"zero_optimization": {"stage": 1}},
    "zero2": {"zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True}},
    "zero3": {"zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}},
    "zero3_offload": {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "cpu"},
        },
    },
}
# Optimizers from `configure_optimizers` (AdamW, SGD, ...) are what users have; DeepSpeed calls them
# "untested" under ZeRO and, with offload, would insist on its own compiled CPU Adam.
_COMMON = {"zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}


def merge_config(base: Mapping[str, Any], override_with: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge two DeepSpeed config blocks: nested mappings merge, other values replace.

    Example::

        >>> merge_config({"zero_optimization": {"stage": 2}}, {"zero_optimization": {"overlap_comm": False}})
        {'zero_optimization': {'stage': 2, 'overlap_comm': False}}
    """
    merged = copy.deepcopy(dict(base))
    for key, value in override_with.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge_config(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


class DeepSpeedStrategy(CheckpointGroupMixin, DeclaresContract, _LightningDeepSpeedStrategy):
    """DeepSpeed ZeRO by preset name, with native DeepSpeed keys merged over it, on CPU as on GPU.

    On CPU it selects DeepSpeed's CPU accelerator and gloo itself (Lightning refuses DeepSpeed off CUDA).
    The optimizer and LR scheduler from ``configure_optimizers`` are used unless the block names an
    ``optimizer``.

    **Trainer settings win.** Precision, gradient clipping, gradient accumulation and the micro-batch size
    come from the Trainer (``precision``, ``gradient_clip_val``, ``accumulate_grad_batches``) and the
    DataLoader's batch size. A different value for the same thing in ``config`` is replaced, with a
    warning naming both values, and the settings in force are logged at start, so the two never diverge
    silently.

    Args:
        preset: ``zero1`` (optimizer state sharded), ``zero2`` (+ gradients), ``zero3`` (+ parameters),
            ``zero3_offload`` (ZeRO-3 with parameters and optimizer state in CPU memory).
        config: native DeepSpeed keys merged over the preset, e.g.
            ``{"zero_optimization": {"reduce_bucket_size": 5e7}}``.
        offload_optimizer: put optimizer state (and the step) in CPU memory; None keeps the preset's choice.
        offload_parameters: put parameters in CPU memory (ZeRO-3 only); None keeps the preset's choice.
        timeout_minutes: process-group timeout.
        process_group_backend: ``gloo`` or ``nccl``; None picks NCCL on CUDA, gloo on CPU.

    Raises:
        ValueError: parameter offload without ZeRO-3, or a bad value.

    Example::

        strategy = DeepSpeedStrategy(preset="zero2", config={"zero_optimization": {"overlap_comm": False}})
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)

    """

    checkpoint_layout = ZERO_PARTITIONS  # DeepSpeed's checkpoint folder (its spec at the bottom)
    background_saves = True

    @property
    def collectives_at_step_start(self) -> bool:  # type: ignore[override]
        """ZeRO-3 gathers parameters as the forward reaches them; ZeRO-1/2 reduce late in backward."""
        return bool((self.config or {}).get("zero_optimization", {}).get("stage") == 3)

    @property
    def sharding(self) -> ZeroSharding:
        """What each rank holds: ZeRO partitions (see strategies/deepspeed/zero_sharding.py)."""
        return ZeroSharding(self)

    def __init__(
        self,
        preset: Preset = "zero2",
        config: dict[str, Any] | None = None,
        offload_optimizer: bool | None = None,
        offload_parameters: bool | None = None,
        timeout_minutes: float = 30.0,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
    ) -> None:
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {preset!r}")
        if timeout_minutes <= 0:
            raise ValueError(f"timeout_minutes must be > 0, got {timeout_minutes}")
        block = merge_config(merge_config(_COMMON, PRESETS[preset]), config or {})
        zero = block.setdefault("zero_optimization", {})
        if offload_optimizer is not None:
            _set_offload(zero, "offload_optimizer", offload_optimizer)
        if offload_parameters is not None:
            _set_offload(zero, "offload_param", offload_parameters)
        if "offload_param" in zero and zero.get("stage") != 3:
            raise ValueError(f"parameter offload needs ZeRO stage 3 (the config has stage {zero.get('stage')})")
        name_deepspeed_accelerator()  # Lightning's constructor imports deepspeed, which picks its accelerator then
        super().__init__(
            config=block,
            process_group_backend=process_group_backend,
            timeout=timedelta(minutes=timeout_minutes),
        )
        self.preset = preset

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in force (0 when the block turns ZeRO off)."""
        assert isinstance(self.config, dict)
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    @override
    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            # DeepSpeed picks its accelerator once, at the first `get_accelerator()`; on a machine without
            # CUDA it must be the CPU one. A user's explicit DS_ACCELERATOR is respected.
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # Lightning's DeepSpeedStrategy.setup_environment refuses anything but CUDA: skip to its parent.
        super(_LightningDeepSpeedStrategy, self).setup_environment()

    @override
    def setup_distributed(self) -> None:
        # DeepSpeed builds its communication op before the rendezvous; a build lock left by a killed
        # process would make it wait forever (see build_locks).
        _clear_stale_build_locks()
        if isinstance(self.accelerator, CPUAccelerator):
            # Lightning validates CUDA device indices here; CPU devices have none.
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            # DeepSpeed's CPU backend would compile (once per machine) and load an op that ZeRO never calls.
            with nullcontext() if uses_shm_op(self.config or {}) else deepspeed_without_shm_op():
                init_deepspeed_distributed(self)
            return
        super().setup_distributed()

    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: Optimizer | None, lr_scheduler: Any = None
    ) -> tuple[Any, Optimizer]:
        import deepspeed

        _clear_stale_build_locks()  # the optimizer's ops (cpu_adam for offload) build here
        # On CPU `root_device.index` is None, which DeepSpeed reads as "no device": pass the local rank.
        index = self.root_device.index if self.root_device.index is not None else self.local_rank
        parameters = [p for p in model.parameters() if p.requires_grad]
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=index),
            config=self.config,
            model=model,
            model_parameters=parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        zero3_step_starts_at_the_outermost_forward(engine)  # ZeRO-3: self(x) in training_step keeps the trace
        return engine, ds_optimizer

    def loads_own_checkpoint(self, state: Path, saved_world_size: int) -> bool:
        """Whether DeepSpeed loads this ZeRO checkpoint as it is (same world size and stage family); else converted."""
        from lightning_mlopt.strategies.deepspeed.zero_checkpoint import loads_as_it_is_under_zero

        return loads_as_it_is_under_zero(state, saved_world_size, self.world_size, self.zero_stage)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """DeepSpeed's save, with every file fsynced before this returns (the commit that follows relies on it)."""
        self._save_through_background_engine(checkpoint, filepath, storage_options).result()

    def save_checkpoint_async(self, checkpoint: dict[str, Any], filepath: str | Path) -> Future[dict[str, FileEntry]]:
        """Save as ``save_checkpoint`` does, but write the files in the background; the future ends when written.

        Collective. DeepSpeed's own save runs (its barriers on the main thread), with an engine that keeps
        each file's CPU copy instead of writing it (see ``background_checkpoint_engine``); the files are then
        written, checksummed and fsynced on a thread. The layout is DeepSpeed's, so either loads the other's.
        """
        return self._save_through_background_engine(checkpoint, filepath)

    def _save_through_background_engine(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> Future[dict[str, FileEntry]]:
        from lightning_mlopt.strategies.deepspeed.background_checkpoint_engine import BackgroundCheckpointEngine

        background = BackgroundCheckpointEngine()
        original, self.deepspeed_engine.checkpoint_engine = self.deepspeed_engine.checkpoint_engine, background
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        finally:
            self.deepspeed_engine.checkpoint_engine = original
        return background.write_in_background(Path(self.broadcast(filepath)))

    @staticmethod
    def consolidate_checkpoint(state: Path, trust_pickles: bool = False) -> dict[str, Any]:
        """A ZeRO checkpoint folder as one full Lightning dict on CPU: weights and optimizer state gathered in fp32.

        Its pickles must have passed the allowlist (``check_trusted``) first: DeepSpeed's files hold its own types.
        """
        from lightning_mlopt.strategies.deepspeed.zero_checkpoint import read_zero_checkpoint

        name_deepspeed_accelerator()  # unpickling DeepSpeed's files imports it
        return read_zero_checkpoint(state)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if Path(self.broadcast(str(checkpoint_path))).is_file():  # one file (DDP's, a conversion's): any world size
            from lightning_mlopt.strategies.deepspeed.zero_checkpoint import load_full_file

            return load_full_file(self, Path(checkpoint_path), trust_pickles=weights_only is False)
        if self._evaluating() and self.zero_stage_3 and Path(checkpoint_path).is_dir():
            # DeepSpeed cannot load a ZeRO-3 checkpoint into the engine validate/test/predict build (it calls
            # the optimizer's _restore_from_bit16_weights, which that engine's ZeRO-3 offload object lacks).
            # Gather the partitions into one full state dict, as `checkpoint consolidate` does, and load that.
            from lightning_mlopt.checkpoint.trust import check_trusted

            self._load_full_weights_once = True
            check_trusted(Path(checkpoint_path), trust_pickles=False)
            return self.consolidate_checkpoint(Path(checkpoint_path))
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if getattr(self, "_load_full_weights_once", False):
            self._load_full_weights_once = False
            self.model_to_device()
            restore_zero_state(self, checkpoint, strict=strict)  # gathers each ZeRO-3 partition, loads, re-shards
            return
        super().load_model_state_dict(checkpoint, strict=strict)

    def _evaluating(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.fn != TrainerFn.FITTING

    @override
    def _initialize_deepspeed_inference(self, model: nn.Module) -> None:
        if self.root_device.index is not None:
            super()._initialize_deepspeed_inference(model)
        else:
            # On CPU Lightning passes device_rank=None, which DeepSpeed cannot compare: give it the local rank.
            with deepspeed_initialize_on_rank(self.local_rank):
                super()._initialize_deepspeed_inference(model)
        zero3_step_starts_at_the_outermost_forward(self.deepspeed_engine)  # validate/test/predict: the same

    @override
    def _format_config(self) -> None:
        self._apply_trainer_settings()
        super()._format_config()
        assert isinstance(self.config, dict)
        zero = self.config.get("zero_optimization", {})
        rank_zero_info(
            "DeepSpeed settings in force: "
            f"stage={zero.get('stage', 0)}, "
            f"offload_optimizer={zero.get('offload_optimizer', {}).get('device', 'none')}, "
            f"offload_param={zero.get('offload_param', {}).get('device', 'none')}, "
            f"micro_batch={self.config.get('train_micro_batch_size_per_gpu')}, "
            f"accumulation={self.config.get('gradient_accumulation_steps')}, "
            f"gradient_clipping={self.config.get('gradient_clipping')}, "
            f"fp16={self.config.get('fp16', {}).get('enabled', False)}, "
            f"bf16={self.config.get('bf16', {}).get('enabled', False)}"
        )

    def _apply_trainer_settings(self) -> None:
        """Make the Trainer's settings win over the config block, warning where they disagreed."""
        assert isinstance(self.config, dict)
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        precision = str(self.precision_plugin.precision)
        wanted = {
            "gradient_accumulation_steps": trainer.accumulate_grad_batches,
            "gradient_clipping": float(trainer.gradient_clip_val or 0.0),
            "train_micro_batch_size_per_gpu": deepspeed_micro_batch_size(self),
        }
        sources = {
            "gradient_accumulation_steps": "trainer.accumulate_grad_batches",
            "gradient_clipping": "trainer.gradient_clip_val",
            "train_micro_batch_size_per_gpu": "the train DataLoader's batch_size",
        }
        for key, value in wanted.items():
            given = self.config.get(key)
            if given is not None and given != value:
                rank_zero_warn(
                    f"DeepSpeed config {key}={given} replaced by {value} from {sources[key]} "
                    "(rule: Trainer settings win over the DeepSpeed block)"
                )
            self.config[key] = value
        # Lightning raises on a preset accumulation key and fills it in itself from the Trainer.
        del self.config["gradient_accumulation_steps"]
        for name, enabled in (("fp16", precision.startswith("16")), ("bf16", precision.startswith("bf16"))):
            block = self.config.get(name)
            if isinstance(block, dict) and "enabled" in block and bool(block["enabled"]) != enabled:
                rank_zero_warn(
                    f"DeepSpeed config {name}.enabled={block['enabled']} replaced by {enabled} from "
                    f"trainer.precision={precision!r} (rule: Trainer settings win over the DeepSpeed block)"
                )
                block["enabled"] = enabled
            elif isinstance(block, dict) and not enabled:
                block["enabled"] = False


def zero_stage_of(preset: str, config: Mapping[str, Any] | None = None) -> int:
    """The ZeRO stage a preset with ``config`` merged over it runs (what the CLI knows before building anything)."""
    block = merge_config(PRESETS.get(preset, PRESETS["zero2"]), config or {})
    return int(block.get("zero_optimization", {}).get("stage", 0))


def _clear_stale_build_locks() -> None:
    for path in clear_stale_build_locks():  # any rank may find one: each says so
        print(f"Removed a stale build lock left by a killed process (no process held it): {path}", file=sys.stderr)


def _set_offload(zero: dict[str, Any], key: str, enabled: bool) -> None:
    if enabled:
        zero[key] = merge_config({"device": "cpu"}, zero.get(key, {}))
    else:
        zero.pop(key, None)


def _is_deepspeed_folder(state: Path) -> bool:
    return (state / "checkpoint").is_dir() or (state / "latest").is_file()  # DeepSpeed's tag folder


SPEC = StrategySpec(
    DeepSpeedStrategy,
    names={
        "zero1": ({"preset": "zero1"}, "DeepSpeed ZeRO-1: optimizer state sharded"),
        "zero2": ({"preset": "zero2"}, "DeepSpeed ZeRO-2: optimizer state and gradients sharded"),
        "zero2_offload": (
            {"preset": "zero2", "offload_optimizer": True},
            "DeepSpeed ZeRO-2 with optimizer state offloaded to CPU memory",
        ),
        "zero3": ({"preset": "zero3"}, "DeepSpeed ZeRO-3: parameters sharded too"),
        "zero3_offload": (
            {"preset": "zero3_offload"},
            "DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to CPU memory",
        ),
    },
    layout=CheckpointLayout(
        ZERO_PARTITIONS,
        DeepSpeedStrategy.consolidate_checkpoint,
        recognise=_is_deepspeed_folder,
        resumes_from=(ONE_FILE,),  # loaded into the partitions at any world size (zero_checkpoint.py)
        written_by=("DeepSpeedStrategy",),
    ),
    overlays=("zero1.yaml", "zero2.yaml", "zero3.yaml", "zero3_offload.yaml"),
    family="deepspeed",
)
