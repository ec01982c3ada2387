"""ReplicaConsistencyCheck: proof that every data-parallel replica holds the same model, bit for bit."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_mlopt.diagnosis import inject
from lightning_mlopt.diagnosis.bit_hash import bit_hashes
from lightning_mlopt.diagnosis.replicas import describe, disagreements
from lightning_mlopt.exceptions import ReplicaMismatchError
from lightning_mlopt.hooks import SaveVetter, checkpoint_events
from lightning_mlopt.strategies.contract import contract_of


class ReplicaConsistencyCheck(Callback, SaveVetter):
    """Checks that data-parallel replicas are bit-identical, every N steps and before every checkpoint.

    Silent data corruption (a bad memory cell, a flaky link, a bug that lets one replica drift) rarely shows as a
    NaN; it shows as replicas that no longer agree. Each rank fingerprints, on its device and bit-exactly
    (``diagnosis/bit_hash.py``), every tensor its strategy says replicas share (``Sharding.replicas``: under DDP the
    parameters, optimizer state and buffers; under ZeRO-1/2 the parameters and buffers; under HSDP each shard across
    its replica groups; under tensor parallelism what the plan leaves whole or replicated, never a split's pieces;
    under full-shard FSDP and ZeRO-3 the buffers only, which the start-up line says; under pipeline x tensor
    parallelism the same within each stage, among its ranks), and one all-gather of two int64 per tensor compares
    them (per stage under pipelines, whose verdicts then reach every rank). A mismatch names the step, the tensors
    and the ranks that differ (the minority, or with two replicas both) and the newest checkpoint saved before the
    last clean check; ``on_mismatch: stop`` ends every rank together (the same verdict everywhere) without saving
    the diverged state, ``warn`` goes on. The check also runs right before every FaultTolerantCheckpoint save (its
    ``before_checkpoint`` hook) and at the end of training. For tests and set-up checks, ``LIGHTNING_MLOPT_INJECT``
    flips a bit on purpose (``diagnosis/inject.py``).

    Args:
        every_n_steps: check after every N optimizer steps (and before every save, and at the end of training).
        on_mismatch: ``stop`` (raise ReplicaMismatchError on every rank) or ``warn``.

    Example::

        trainer = Trainer(callbacks=[ReplicaConsistencyCheck(every_n_steps=100)])

    """

    def __init__(self, every_n_steps: int = 100, on_mismatch: Literal["warn", "stop"] = "stop") -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if on_mismatch not in ("warn", "stop"):
            raise ValueError(f"on_mismatch must be 'warn' or 'stop', got {on_mismatch!r}")
        self.every_n_steps = every_n_steps
        self.on_mismatch = on_mismatch
        self.checks = 0
        self.last_clean_step: int | None = None
        self.mismatches: list[str] = []
        self._last_checked = -1
        self._injections: list[inject.Injection] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._injections = inject.from_environment("bitflip")
            for injection in self._injections:
                inject.find_parameter(pl_module, injection.param)  # a name that matches nothing fails now

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        replica_set = contract_of(trainer.strategy).sharding.replicas(pl_module, trainer.optimizers)
        rank_zero_info(
            f"ReplicaConsistencyCheck: every {self.every_n_steps} steps, {trainer.world_size} ranks compare "
            f"{replica_set.description}"
        )

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        for injection in self._injections:
            if injection.due(trainer.global_rank, step):
                inject.flip_bit(inject.find_parameter(pl_module, injection.param)[1], injection.bit)
        if step % self.every_n_steps == 0 and step != self._last_checked:
            self.check(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._last_checked:
            self.check(trainer, pl_module)

    def before_checkpoint(self, trainer: pl.Trainer) -> None:
        """FaultTolerantCheckpoint is about to save, on every rank: check this step first (once)."""
        if trainer.global_step != self._last_checked:
            self.check(trainer, trainer.lightning_module)

    def check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Compare this step's replicas now (every rank must call it at the same step)."""
        step = self._last_checked = trainer.global_step
        if trainer.world_size < 2:
            return
        replica_set = contract_of(trainer.strategy).sharding.replicas(pl_module, trainer.optimizers)
        replicas, process_group = replica_set.replicas, replica_set.process_group
        members = (
            list(range(trainer.world_size)) if process_group is None else dist.get_process_group_ranks(process_group)
        )
        device = trainer.strategy.root_device
        groups = torch.tensor([replica.group for replica in replicas], dtype=torch.int64, device=device)
        local = torch.cat([groups, bit_hashes([replica.tensor for replica in replicas], device)])
        gathered = torch.empty(len(members) * local.numel(), dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(gathered, local, group=process_group)
        rows = gathered.view(len(members), -1).tolist()  # the one host read
        self.checks += 1
        found = [
            item._replace(ranks=[members[i] for i in item.ranks], replicas=[members[i] for i in item.replicas])
            for item in disagreements([replica.name for replica in replicas], rows)
        ]
        if process_group is not None:  # compared within groups (pipeline stages): every rank takes every verdict
            everyone: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(everyone, found)
            by_tensor = {(item.name, tuple(item.replicas)): item for items in everyone for item in items}
            found = list(by_tensor.values())  # each group's members found the same: once each
        if not found:
            self.last_clean_step = step
            return
        message = f"{describe(found, step)}. {self._last_good_checkpoint(trainer)}"
        self.mismatches.append(message)
        if self.on_mismatch == "stop":
            raise ReplicaMismatchError(message)
        rank_zero_warn(f"ReplicaConsistencyCheck: {message}")

    def _last_good_checkpoint(self, trainer: pl.Trainer) -> str:
        """The newest checkpoint saved at or before the last clean check, from the run's checkpoint store."""
        if self.last_clean_step is None:
            return "No check had passed yet."
        clean = f"The last clean check was at step {self.last_clean_step}"
        store = checkpoint_events(trainer).store
        if store is None:
            return f"{clean}."
        before = [(step, path) for step, path in store.committed() if step <= self.last_clean_step]
        if before:
            return f"{clean}; the newest checkpoint saved before it: {max(before)[1]}"
        return f"{clean}; no checkpoint was saved before it."
