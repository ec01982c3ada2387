"""FSDP2 (``fully_shard``) applied to an unmodified LightningModule, on CPU (gloo) as on GPU (NCCL)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mlopt._compat import (
    declare_configure_model,
    flattened_mesh,
    set_device_mesh,
    set_num_threads_for_processes,
    setup_distributed,
)
from lightning_mlopt.checkpoint.layout import DCP_META_NAME, DCP_SHARDS, ONE_FILE, CheckpointLayout, PendingWrite
from lightning_mlopt.checkpoint.serialization import dcp_stager, save_file
from lightning_mlopt.distributed.grad_norm import clip_grad_norm_
from lightning_mlopt.distributed.mesh_plan import Dimension, MeshPlan, data_mesh, data_rank
from lightning_mlopt.distributed.sharding import Sharding, TensorSharding
from lightning_mlopt.exceptions import BadInputError, said_by_rank_zero
from lightning_mlopt.hooks import compile_model, convert_model
from lightning_mlopt.strategies.checkpoint_group import CheckpointGroupMixin
from lightning_mlopt.strategies.context.context_steps import CONTEXT, ContextParallelSteps, refuse_with_context
from lightning_mlopt.strategies.contract import DeclaresContract
from lightning_mlopt.strategies.dcp_write import OwnShards
from lightning_mlopt.strategies.fsdp_options import DType, FSDPOptions, renamed_replicate_size
from lightning_mlopt.strategies.fsdp_units import (
    is_sharded,
    root_units,
)
from lightning_mlopt.strategies.full_checkpoint import consolidate_dcp, load_dcp_folder, load_full_file, saved_flattened
from lightning_mlopt.strategies.spec import StrategySpec


class FSDPStrategy(CheckpointGroupMixin, DeclaresContract, ContextParallelSteps, ModelParallelStrategy):
    """Fully sharded data parallel (FSDP2) for any LightningModule, configured from YAML.

    Lightning's FSDP strategies refuse to run off CUDA, and its FSDP2 path asks the model to call
    ``fully_shard`` itself in ``configure_model``. This strategy applies the wrapping to an unmodified
    module and runs the same code on CPU with gloo, so a sharded configuration can be debugged on a laptop
    or in CI before it spends GPU hours. Checkpoints are torch.distributed.checkpoint folders, which load at
    another world size.

    Wrapping: each module whose class is in ``wrap_classes`` becomes an FSDP unit (its parameters are
    gathered just before its forward and freed after); with ``min_params_to_wrap``, any module holding at
    least that many not-yet-wrapped parameters does too. Every direct child of the LightningModule is then
    sharded as a root unit, so no parameter stays replicated.

    Args:
        wrap_classes: import paths of module classes to shard as units, e.g.
            ``["lightning_mlopt.demos.gpt.TransformerBlock"]``.
        min_params_to_wrap: also shard any module with at least this many unwrapped parameters.
        reshard_after_forward: free gathered parameters after forward (full shard, least memory); False
            keeps them until backward (the shard-grad-op behaviour: less communication, more memory).
        replicate_size: hybrid sharding (HSDP): the number of model replicas; parameters are sharded within
            groups of ``world_size / replicate_size`` ranks (typically one node, where the all-gathers are
            cheap) and replicated across them (one all-reduce of the gradient shards). ``"nodes"``: one replica
            per node. None: shard across all ranks (``configs/strategies/hsdp.yaml``).
        activation_checkpointing: import paths of module classes whose activations are recomputed in
            backward instead of stored.
        param_dtype: dtype of gathered parameters for compute (mixed precision); None keeps fp32.
        reduce_dtype: dtype of the gradient reduce-scatter; None uses ``param_dtype``.
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.
        save_distributed_checkpoint: save one shard per rank (DCP folder); False gathers a single file.
        timeout_minutes: process-group timeout.
        process_group_backend: ``gloo`` or ``nccl``; None picks NCCL on CUDA, gloo on CPU.
        replicate_group_size: the earlier name of ``replicate_size``, still read, with a warning.
        context_parallel_size: context parallelism (all-to-all): each sequence split over this many ranks, its
            attention over the whole sequence (``configs/strategies/cp.yaml``); FSDP shards over them too.
        position_key: where a batch holds its positions under context parallelism: a dict key, or a tuple index
            (the GPT demo's ``(tokens, targets, positions)``: 2).

    Raises:
        ValueError: a knob is out of range, or a wrap class is not in the model (the message lists the
            model's module classes).

    Example::

        strategy = FSDPStrategy(wrap_classes=["lightning_mlopt.demos.gpt.TransformerBlock"])
        trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy)

    """

    checkpoint_layout = DCP_SHARDS  # a torch.distributed.checkpoint folder (its spec at the bottom)
    background_saves = True
    collectives_at_step_start = True  # each unit's parameters are all-gathered as the forward reaches it
    sharding = TensorSharding()  # parameters and gradients are DTensors whose placements say who holds what
    # DCP's async checkpointer: "thread" (chosen: see benchmarks/results/checkpoint_sharded_*) or "process".
    async_checkpointer: Literal["thread", "process"] = "thread"

    def __init__(
        self,
        wrap_classes: Sequence[str] = (),
        min_params_to_wrap: int | None = None,
        reshard_after_forward: bool = True,
        replicate_size: int | Literal["nodes"] | None = None,
        activation_checkpointing: Sequence[str] = (),
        param_dtype: DType | None = None,
        reduce_dtype: DType | None = None,
        cpu_offload: bool = False,
        save_distributed_checkpoint: bool = True,
        timeout_minutes: float = 30.0,
        process_group_backend: Literal["gloo", "nccl"] | None = None,
        replicate_group_size: int | None = None,
        context_parallel_size: int = 1,
        position_key: int | str = "position_ids",
    ) -> None:
        replicate_size = renamed_replicate_size(replicate_size, replicate_group_size)
        if replicate_size is not None and replicate_size != "nodes" and replicate_size < 1:
            raise ValueError(f"replicate_size must be >= 1 or 'nodes', got {replicate_size}")
        if context_parallel_size < 1:
            raise ValueError(f"context_parallel_size must be >= 1, got {context_parallel_size}")
        if timeout_minutes <= 0:
            raise ValueError(f"timeout_minutes must be > 0, got {timeout_minutes}")
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timedelta(minutes=timeout_minutes),
        )
        self.fsdp_options = FSDPOptions.from_keys(
            wrap_classes=wrap_classes,
            min_params_to_wrap=min_params_to_wrap,
            reshard_after_forward=reshard_after_forward,
            activation_checkpointing=activation_checkpointing,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            cpu_offload=cpu_offload,
        )
        self.replicate_size = replicate_size
        self.context_parallel_size = context_parallel_size
        self.position_key = position_key
        self._fsdp_mesh: DeviceMesh | None = None  # the shard mesh, context folded in (built once)
        self._stager: Any = None  # DCP's staging of async saves, kept for the run (see dcp_stager)

    def save_checkpoint_async(self, checkpoint: dict[str, Any], filepath: str | Path) -> PendingWrite:
        """Save ``checkpoint`` as a DCP folder in the background; the future ends when this rank's shards are written.

        Collective. What blocks: staging every shard into CPU memory (pinned on CUDA) and rank zero writing
        the small ``meta.pt``. DCP's thread then writes the shards (fsynced) and coordinates the ranks over
        :attr:`checkpoint_process_group`, never over training's communicator. The layout is the one
        ``save_checkpoint`` writes, so either loads the other's.

        Example::

            pending = strategy.save_checkpoint_async(dump_checkpoint(trainer), path)
            ...  # training goes on
            pending.result()  # raises if any rank's write failed
        """
        from torch.distributed.checkpoint import async_save

        path = Path(filepath)
        path.mkdir(parents=True, exist_ok=True)
        converted = {"state_dict": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        written = {DCP_META_NAME: save_file(checkpoint, path / DCP_META_NAME)} if self.global_rank == 0 else {}
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self._stager is None:  # one for the run: the staged copy is reused from save to save
            self._stager = dcp_stager(on_gpu=self.root_device.type == "cuda")
        stager = self._stager
        dcp_write = async_save(
            converted,
            checkpoint_id=path,
            process_group=self.checkpoint_process_group,
            async_checkpointer_type=AsyncCheckpointerType(self.async_checkpointer),
            **({} if stager is None else {"async_stager": stager}),
        )
        return OwnShards(dcp_write, path, self.global_rank, written)

    @override
    def teardown(self) -> None:
        if self._stager is not None:
            self._stager.close()  # unpins and frees the staged copies
            self._stager = None
        super().teardown()

    # The mesh dimensions this strategy's code indexes, kept in its mesh even at size 1.
    mesh_dimensions_kept: tuple[Dimension, ...] = ("shard",)

    @property
    def mesh_plan(self) -> MeshPlan:
        """The job's ranks as :meth:`plan_dimensions` sizes them (``replicate x shard`` here), checked.

        Raises:
            BadInputError: the sizes' product does not divide the world size (the message names their keys).

        """
        dimensions = self.plan_dimensions()
        sizes = {name: size for name, (size, _) in dimensions.items()}
        return MeshPlan.fill(self.world_size, **sizes, keys={name: key for name, (_, key) in dimensions.items()})

    def plan_dimensions(self) -> dict[Dimension, tuple[int, str]]:
        """The dimensions this strategy sizes (the shard dimension takes the rest): each one's size and YAML key.

        A strategy that adds a dimension extends this (``{**super().plan_dimensions(), "tensor": ...}``).
        """
        replicate = self.num_nodes if self.replicate_size == "nodes" else self.replicate_size or 1
        return {
            "replicate": (replicate, "replicate_size"),
            "context": (self.context_parallel_size, "context_parallel_size"),
        }

    @property
    def _trained_module(self) -> LightningModule:
        """The LightningModule (Lightning's ``lightning_module``, which is None only before the model is connected)."""
        assert self.lightning_module is not None, "no LightningModule yet: the strategy is not set up"
        return self.lightning_module

    @property
    def shard_mesh(self) -> DeviceMesh:
        """Where parameters are sharded: ``(shard,)``, HSDP's ``(replicate, shard)``, shard x context as one dimension.

        Context ranks share a batch, not the model: FSDP shards over them too and averages their gradients; HSDP
        replicates across ``(replicate, shard_context)``.
        """
        mesh, names = self.device_mesh, self.device_mesh.mesh_dim_names or ()
        if CONTEXT not in names:
            return data_mesh(mesh)
        if self._fsdp_mesh is None:
            flat = flattened_mesh(mesh, ("shard", CONTEXT), "shard_context")
            self._fsdp_mesh = mesh["replicate", "shard_context"] if "replicate" in names else flat
        return self._fsdp_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # One slice of the data per data-parallel rank; the ranks of one replica's other dimensions (its tensor
        # and pipeline ranks) compute it together and read the same batches.
        plan = self.mesh_plan
        if plan.data_parallel_size == self.world_size:  # FSDP and HSDP: every rank reads batches of its own
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        return {"num_replicas": plan.data_parallel_size, "rank": data_rank(self.device_mesh)}

    @override
    def setup_environment(self) -> None:
        # Lightning's ModelParallelStrategy gives a rank started for it (rank 1 under its launcher) no launcher to
        # set its thread count: rank 1 ran torch's default, oversubscribing the cores (most of a 1.37x gap to a
        # hand-written loop on 2 CPUs, issue 27). DDP and DeepSpeed always have a launcher; here every rank sets it.
        set_num_threads_for_processes(self.num_processes)
        # Skip ModelParallelStrategy's 2-D (data, tensor) mesh: ours is the mesh plan's (see _build_mesh).
        super(ModelParallelStrategy, self).setup_environment()
        setup_distributed(self)
        assert self.lightning_module is not None
        set_device_mesh(self, self._build_mesh())

    def _build_mesh(self) -> DeviceMesh:
        return self.mesh_plan.build(self.root_device.type, keep=self.mesh_dimensions_kept)

    @override
    def setup(self, trainer: Trainer) -> None:
        """Shard an unmodified LightningModule, then Lightning's own set-up (extended, not copied).

        Lightning's ModelParallelStrategy requires the module to shard itself in ``configure_model``; ours
        shards it here first (a module that does shard itself, Lightning's FSDP2 recipe, is left as it is),
        and tells Lightning's check so.
        """
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)  # the device first (sharding places shards on it); idempotent
        if not is_sharded(self.model):
            self._shard(self.model)
        with declare_configure_model(self.lightning_module):
            super().setup(trainer)
        plan = self.mesh_plan
        if plan.replicate > 1 and self.global_rank == 0:
            shards = plan.shard * plan.context  # FSDP shards over both
            print(f"hybrid sharding (HSDP): {plan.replicate} replicas x {shards} shards ({plan.describe()})")

    def _shard(self, module: nn.Module) -> None:
        """Float8, activation checkpointing and compile, then ``fully_shard`` to units, then to the root children."""
        self.check_model(module)
        self._prepare_model(module)
        options = self._shard_options()
        wrapped = self.fsdp_options.units(module)
        # Post-order, so inner units are sharded before the modules that contain them.
        for sub in reversed(list(module.modules())):
            if sub in wrapped and sub is not module:
                fully_shard(sub, **options)
        own = [name for name, _ in module.named_parameters(recurse=False)]
        if own:
            raise ValueError(
                f"FSDPStrategy shards the LightningModule's child modules; parameters held by the LightningModule "
                f"itself ({', '.join(own)}) would not be synchronised. Move them into a submodule."
            )
        # A root child's own parameters (embeddings, final norm, head) form its unit; units sharded above
        # inside it are left to themselves. A container (nanoGPT's `self.layers = nn.ModuleList(...)`) has no
        # forward for FSDP to hook: its members are the units.
        for unit in root_units(module):
            if not isinstance(unit, FSDPModule) and any(True for _ in unit.parameters()):
                fully_shard(unit, **options)
        replicated = [name for name, p in module.named_parameters() if not isinstance(p, DTensor)]
        if replicated:  # would train without gradient synchronisation: refuse rather than diverge silently
            raise RuntimeError(f"FSDPStrategy left parameters unsharded: {', '.join(replicated[:10])}")

    def _prepare_model(self, module: nn.Module) -> None:
        """Before sharding, in torchtitan's order: float8 (``float8:``), activation checkpointing, ``compile:``."""
        assert self.lightning_module is not None
        convert_model(self.lightning_module.trainer, module)
        self.fsdp_options.recompute_activations(module)
        compile_model(self.lightning_module.trainer, module)

    def _shard_options(self) -> dict[str, Any]:
        return self.fsdp_options.fully_shard_kwargs(self.shard_mesh, self.root_device.type)

    def check_model(self, module: nn.Module) -> None:
        """Raise BadInputError for sizes the world refuses, or for a wrap or checkpointing class the model lacks.

        The mesh plan's sizes against the world size; ``wrap_classes`` and ``activation_checkpointing`` against
        the model's module classes.

        The CLI calls it before anything is written; setup calls it again for models built in ``configure_model``.
        """
        plan = self.mesh_plan  # the sizes against the world: BadInputError before anything starts
        self.fsdp_options.check(module)
        if plan.context > 1:
            refuse_with_context(plan, self.fsdp_options, module)

    def check_sequence_length(self, length: int | None) -> None:
        """BadInputError where ``context_parallel_size`` does not divide the data's sequence length (before launch)."""
        if length is not None and length % self.context_parallel_size:
            raise BadInputError(
                f"context_parallel_size={self.context_parallel_size} must divide the sequence length "
                f"(data block_size {length}); choose a divisor of it"
            )

    @staticmethod
    def consolidate_checkpoint(state: Path, trust_pickles: bool = False) -> dict[str, Any]:
        """A DCP folder as one full Lightning dict on CPU: weights and optimizer state gathered, the rest beside."""
        return consolidate_dcp(state, trust_pickles)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A DCP folder through Lightning, else here: a full file sharded, a pipeline stage's part, flattened states."""
        path = Path(self.broadcast(checkpoint_path))
        # Lightning's reader wants the whole model as DTensors and nested optimizer states (not PP's flattened).
        if not path.is_file() and not saved_flattened(path):
            return super().load_checkpoint(path, weights_only)
        return self._load_here(path, weights_only, part_of_model=False)

    def _load_here(self, path: Path, weights_only: bool | None, part_of_model: bool) -> dict[str, Any]:
        """``path`` (a DCP folder or one file) read by our readers; ``part_of_model``: the model holds some modules."""
        assert self.model is not None and self.lightning_module is not None
        with said_by_rank_zero(self.global_rank):
            strict, trust = self.lightning_module.strict_loading, weights_only is False
            if not path.is_file():
                return load_dcp_folder(self.model, self.optimizers, path, strict, trust)
            return load_full_file(self.model, self.optimizers, path, strict, trust, stage_only=part_of_model)

    @override
    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        # Lightning clips with torch.nn.utils.clip_grad_norm_, which fails on a mix of sharded and plain
        # gradients and has no notion of HSDP's replicate dimension; ours reduces each sharded mesh dimension.
        clip = partial(_clip_grad_by_norm, sharding=self.sharding)  # TP's sharding counts sub-mesh copies
        self.precision_plugin.clip_grad_by_norm = clip  # type: ignore[method-assign]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not self.fsdp_options.cpu_offload:  # offloaded shards stay on the CPU by design
            self.model.to(self.root_device)


def _clip_grad_by_norm(optimizer: Optimizer, clip_val: int | float, sharding: Sharding) -> None:
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    clip_grad_norm_(parameters, float(clip_val), sharding)


__all__ = ["FSDPStrategy"]


SPEC = StrategySpec(
    FSDPStrategy,
    names={
        "fsdp": ({}, "FSDP2 full shard; every direct child of the LightningModule is a unit"),
        "hsdp": ({"replicate_size": "nodes"}, "hybrid sharding: FSDP2 within each node, replicated across nodes"),
    },
    layout=CheckpointLayout(
        DCP_SHARDS,
        FSDPStrategy.consolidate_checkpoint,
        recognise=lambda state: state.is_dir() and any(state.glob("*.distcp")),
        resumes_from=(ONE_FILE,),  # DCP reads a full state dict and shards it
        written_by=("FSDPStrategy", "ModelParallelStrategy"),
    ),
    overlays=("fsdp.yaml", "hsdp.yaml", "cp.yaml"),
)
