"""DDP on CPU (gloo) and GPU (NCCL) with every DistributedDataParallel knob reachable from YAML."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy as _LightningDDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_mlopt.checkpoint.layout import ONE_FILE, CheckpointLayout
from lightning_mlopt.distributed.sharding import TensorSharding
from lightning_mlopt.hooks import compile_model, convert_model
from lightning_mlopt.strategies.contract import DeclaresContract
from lightning_mlopt.strategies.spec import StrategySpec

CommHook = Literal["none", "fp16", "bf16", "powersgd"]


def bf16_compress_hook(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> Any:
    """All-reduce a gradient bucket in bfloat16 and write the mean back in the bucket's dtype.

    torch's own ``bf16_compress_hook`` is refused by DDP unless the backend is NCCL; this one is the same
    arithmetic for any backend, so a bf16-compressed run can be tried on CPU with gloo.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer = bucket.buffer()
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


class DDPStrategy(DeclaresContract, _LightningDDPStrategy):
    """Lightning's DDP with gradient-communication hooks that also work on CPU, and validated YAML knobs.

    Lightning registers communication hooks on CUDA only and skips them silently elsewhere; this strategy
    registers them on every device, so what a CPU run measures is what the GPU run will do.

    Args:
        comm_hook: gradient communication: ``none`` (fp32 all-reduce), ``fp16`` or ``bf16`` (compress to
            half precision, halving the bytes sent), ``powersgd`` (low-rank compression, Vogels et al. 2019).
        powersgd_rank: PowerSGD's matrix approximation rank (default 1); only with ``comm_hook: powersgd``.
        powersgd_start_iter: steps of plain all-reduce before PowerSGD starts (default 1000, at least 2);
            only with ``comm_hook: powersgd``.
        bucket_cap_mb: size of DDP's gradient buckets; larger buckets mean fewer, bigger all-reduces.
        gradient_as_bucket_view: let gradients alias the buckets, saving one gradient-sized copy.
        static_graph: the set of used parameters never changes between steps (enables more overlap).
        find_unused_parameters: search for parameters without gradients every step (costs a graph walk).
        timeout_minutes: process-group timeout; a collective that waits longer fails instead of hanging.
        process_group_backend: ``gloo`` or ``nccl``; None picks NCCL on CUDA, gloo on CPU.

    Raises:
        ValueError: a knob is out of range or given without the setting it belongs to.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(comm_hook="fp16"))

    """

    checkpoint_layout = ONE_FILE  # rank zero writes the whole state (see checkpoint/layout.py)
    sharding = TensorSharding()  # every rank holds the whole model and, after backward, the same gradients

    def __init__(
        self,
        comm_hook: CommHook = "none",
        powersgd_rank: int | None = None,
        powersgd_start_iter: int | None = None,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        timeout_minutes: float = 30.0,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
    ) -> None:
        state, hook = _comm_hook(comm_hook, powersgd_rank, powersgd_start_iter)
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        if timeout_minutes <= 0:
            raise ValueError(f"timeout_minutes must be > 0, got {timeout_minutes}")
        super().__init__(
            process_group_backend=process_group_backend,
            timeout=timedelta(minutes=timeout_minutes),
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
        self.comm_hook = comm_hook
        # Registered by us in configure_ddp, not handed to Lightning, which registers hooks on CUDA only.
        self._comm_state, self._comm_hook_fn = state, hook

    @staticmethod
    def consolidate_checkpoint(state: Path, trust_pickles: bool = False) -> dict[str, Any]:
        """A one-file checkpoint is already whole: loaded on CPU, under the pickle allowlist."""
        from lightning_mlopt.checkpoint.serialization import load_file

        return load_file(state, trust_pickles)

    @override
    def configure_ddp(self) -> None:
        assert self.lightning_module is not None
        # Float8Training's layers, then CompileModel's regions: before DDP wraps the model (torchtitan's order).
        convert_model(self.lightning_module.trainer, self.lightning_module)
        compile_model(self.lightning_module.trainer, self.lightning_module)
        super().configure_ddp()
        if self._comm_hook_fn is None:
            return
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(state=self._comm_state, hook=self._comm_hook_fn)
        if isinstance(self._comm_state, powerSGD_hook.PowerSGDState):
            self._say_when_powersgd_starts(self._comm_state)

    def _say_when_powersgd_starts(self, state: powerSGD_hook.PowerSGDState) -> None:
        """PowerSGD all-reduces uncompressed for its first iterations: say from when, and if never in this run."""
        start = state.start_powerSGD_iter
        rank_zero_info(
            f"PowerSGD (rank {state.matrix_approximation_rank}) compresses gradients from iteration {start} "
            "(powersgd_start_iter; one iteration per synchronised backward); until then they are all-reduced in full."
        )
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        max_steps = trainer.max_steps if trainer is not None else -1
        if 0 < max_steps < start:
            rank_zero_warn(
                f"PowerSGD never compresses in this run: it stops at max_steps={max_steps}, before iteration {start}. "
                "Lower powersgd_start_iter (e.g. 10% of the run) to see its effect."
            )


def _comm_hook(name: CommHook, powersgd_rank: int | None, powersgd_start_iter: int | None) -> tuple[object | None, Any]:
    """Return DDP's (hook state, hook) for a hook name, checking the PowerSGD knobs belong to it."""
    if name != "powersgd":
        if powersgd_rank is not None or powersgd_start_iter is not None:
            raise ValueError(
                f"powersgd_rank and powersgd_start_iter only apply with comm_hook: powersgd (got {name!r})"
            )
        hooks = {"none": None, "fp16": default_hooks.fp16_compress_hook, "bf16": bf16_compress_hook}
        if name not in hooks:
            raise ValueError(f"comm_hook must be one of none, fp16, bf16, powersgd; got {name!r}")
        return None, hooks[name]
    rank = 1 if powersgd_rank is None else powersgd_rank
    start_iter = 1000 if powersgd_start_iter is None else powersgd_start_iter
    if rank < 1:
        raise ValueError(f"powersgd_rank must be >= 1, got {rank}")
    # PowerSGD's error feedback needs at least one plain all-reduce first (torch rejects start_iter <= 1).
    if start_iter < 2:
        raise ValueError(f"powersgd_start_iter must be >= 2, got {start_iter}")
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter
    )
    return state, powerSGD_hook.powerSGD_hook


SPEC = StrategySpec(
    DDPStrategy,
    names={
        "ddp": ({}, "DDP, CPU (gloo) or GPU (NCCL)"),
        "ddp_fp16": ({"comm_hook": "fp16"}, "DDP with fp16 gradient compression"),
        "ddp_bf16": ({"comm_hook": "bf16"}, "DDP with bf16 gradient compression"),
        "ddp_powersgd": ({"comm_hook": "powersgd"}, "DDP with PowerSGD gradient compression"),
    },
    layout=CheckpointLayout(ONE_FILE, DDPStrategy.consolidate_checkpoint, recognise=Path.is_file),
    overlays=("ddp.yaml",),
)
