"""Callbacks that record what a launched run did into files a test reads: steps, losses, metrics, collectives.

They live at module level so that every rank (a fresh process) can build them from a class path.

Example::

    run_cli(fit_args("--trainer.callbacks+=tests.support.recorders.RecordTraining",
                     f"--trainer.callbacks.out_dir={out}", devices=2), cwd=tmp_path)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override


class RecordTraining(pl.Callback):
    """Writes ``rank<N>.json`` into ``out_dir`` at the end of fit: losses, a parameter digest, the comm hook.

    Args:
        out_dir: folder for the per-rank files (the test's tmp_path).
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.losses: list[float] = []
        self.batches: list[list[int]] = []  # a fingerprint of each batch: which data each step saw

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        self.losses.append(float(outputs["loss"]))
        self.batches.append([int(t.long().sum()) for t in batch] if isinstance(batch, (list, tuple)) else [])

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wrapped = trainer.strategy.model
        hook = None
        if isinstance(wrapped, DistributedDataParallel):
            hook = wrapped._get_ddp_logging_data().get("comm_hook")
        # Whole parameters (collective for DTensors: every rank is here): tensor parallelism mixes DTensors and
        # plain tensors, which one cat cannot take.
        whole = [p.full_tensor() if isinstance(p, DTensor) else p for p in pl_module.parameters()]
        params = torch.cat([p.detach().float().flatten() for p in whole])
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "pid": os.getpid(),
            "strategy": type(trainer.strategy).__name__,
            "comm_hook": hook,
            "losses": self.losses,
            "batches": self.batches,
            "param_sum": float(params.double().sum()),
            "param_abs_sum": float(params.double().abs().sum()),
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def read_records(out_dir: Path) -> list[dict]:
    """The per-rank records a run wrote, ordered by rank."""
    return [json.loads(path.read_text()) for path in sorted(out_dir.glob("rank*.json"))]


class RecordEverything(RecordTraining):
    """RecordTraining plus what the strategy tests compare: full parameters and per-rank state bytes.

    Writes ``params.pt`` (rank 0, the unsharded parameters after fit) and adds ``state_bytes`` (measured
    after the first optimizer step), ``activation_bytes`` (the bytes the first step's forward saved for
    backward, counted as the planner counts them: each tensor once, a DTensor by its local piece) and the
    rank's CPU thread count to each rank's record.
    """

    def __init__(self, out_dir: str) -> None:
        super().__init__(out_dir)
        self.state_bytes: dict[str, int] = {}
        self.bytes_before_step: dict[str, int] = {}
        self.saved: dict[int, int] = {}
        self._kept: list[torch.Tensor] = []  # alive until counted: no later tensor may reuse an id
        self._saving: Any = None

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_step == 0 and self._saving is None and not self.saved:

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                self.saved[id(tensor)] = local.numel() * local.element_size()
                self._kept.append(tensor)
                return tensor

            self._saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
            self._saving.__enter__()

    @override
    def on_before_backward(self, trainer, pl_module, loss) -> None:  # type: ignore[override]
        if self._saving is not None:  # the forward is over: what backward will read is saved
            self._saving.__exit__(None, None, None)
            self._saving, self._kept = None, []

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == 1 and not self.state_bytes:
            from dataclasses import asdict

            from lightning_mlopt.distributed import local_state_bytes

            self.state_bytes = asdict(local_state_bytes(pl_module, trainer.optimizers[0]))

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step == 0 and not self.bytes_before_step:
            from dataclasses import asdict

            from lightning_mlopt.distributed import local_state_bytes

            # Gradients are measured here, before the first step: optimizers free or reuse them in the step.
            self.bytes_before_step = asdict(local_state_bytes(pl_module, trainer.optimizers[0]))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_mlopt.distributed import full_parameters

        params = full_parameters(pl_module)  # collective: every rank calls it
        if trainer.global_rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.save({"step": trainer.global_step, "params": params}, self.out_dir / "start_params.pt")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_mlopt.distributed import full_parameters

        params = full_parameters(pl_module)  # collective: every rank calls it
        super().on_train_end(trainer, pl_module)
        path = self.out_dir / f"rank{trainer.global_rank}.json"
        record = json.loads(path.read_text())
        record["state_bytes"] = self.state_bytes
        record["bytes_before_step"] = self.bytes_before_step
        record["activation_bytes"] = sum(self.saved.values())
        record["num_params"] = sum(p.numel() for p in params.values())
        record["num_threads"] = torch.get_num_threads()
        path.write_text(json.dumps(record))
        if trainer.global_rank == 0:
            torch.save(params, self.out_dir / "params.pt")


class RecordMonitor(pl.Callback):
    """Writes each step's GradNormMonitor metrics and one step's batch of each rank into ``out_dir``.

    Args:
        out_dir: folder for ``monitor-rank<R>.json`` and ``batch-rank<R>.pt``.
        reference_step: the optimizer step whose micro-batch is saved (1: the first).
        save_params: rank zero also writes the full parameters before and after that step
            (``params-before-step-<N>.pt``, ``params-after-step-<N>.pt``; a collective: every rank gathers).
    """

    def __init__(self, out_dir: str, reference_step: int = 1, save_params: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.reference_step = reference_step
        self.save_params = save_params
        self.metrics: list[dict[str, float]] = []

    def _save_params(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        from lightning_mlopt.distributed import full_parameters

        params = full_parameters(pl_module)  # collective: every rank calls it
        if trainer.global_rank == 0:
            torch.save(params, self.out_dir / f"params-{when}-step-{self.reference_step}.pt")

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_step == self.reference_step - 1:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.save([t.cpu() for t in batch], self.out_dir / f"batch-rank{trainer.global_rank}.pt")
            if self.save_params:
                self._save_params(trainer, pl_module, "before")

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        from lightning_mlopt.callbacks import GradNormMonitor

        (monitor,) = [cb for cb in trainer.callbacks if isinstance(cb, GradNormMonitor)]
        self.metrics.append(dict(monitor.last_metrics))
        from lightning_mlopt.distributed.step_exchange import step_exchange

        record = {
            "metrics": self.metrics,
            "state": monitor.state_dict(),
            "batches": trainer.fit_loop.epoch_loop.batch_progress.total.completed + 1,
            "exchanges": step_exchange(trainer).collectives,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"monitor-rank{trainer.global_rank}.json").write_text(json.dumps(record))
        if self.save_params and trainer.global_step == self.reference_step:
            self._save_params(trainer, pl_module, "after")


class RecordHyperparameters(pl.Callback):
    """Writes ``hparams-rank<R>.json`` (the model's hyperparameters as this rank sees them) into the run dir."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        folder = Path(trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        hparams = {key: value for key, value in pl_module.hparams.items() if isinstance(value, (int, float, str))}
        (folder / f"hparams-rank{trainer.global_rank}.json").write_text(json.dumps(hparams))


class CountCollectives(pl.Callback):
    """Writes ``collectives-rank<N>.json``: each training batch's collectives by issuer, for batches in a range.

    A batch runs from its ``on_train_batch_start`` to the next one's (its end hooks and the next batch's
    start-of-batch work included), so every per-batch cost is counted once per batch.

    Args:
        out_dir: folder for the per-rank files.
        first_step: the first batch recorded (by ``trainer.global_step`` at its start).
        last_step: the batch after the last one recorded.
    """

    def __init__(self, out_dir: str, first_step: int, last_step: int) -> None:
        self.out_dir = Path(out_dir)
        self.first_step, self.last_step = first_step, last_step
        self.batches: list[dict[str, Any]] = []
        self._counting: tuple[int, Any] | None = None

    def _stop(self) -> None:
        if self._counting is not None:
            step, counter = self._counting
            self._counting = None
            counter.__exit__(None, None, None)
            self.batches.append(
                {
                    "step": step,
                    "by_issuer": counter.by_issuer(),
                    "sites": {issuer: counter.by_site(issuer) for issuer in counter.by_issuer()},
                }
            )

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[override]
        from lightning_mlopt.diagnosis.collectives import CollectiveCounter

        self._stop()
        if self.first_step <= trainer.global_step < self.last_step:
            self._counting = (trainer.global_step, CollectiveCounter().__enter__())

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"log_every_n_steps": trainer.log_every_n_steps, "batches": self.batches}
        (self.out_dir / f"collectives-rank{trainer.global_rank}.json").write_text(json.dumps(record))


class NoHostSyncBetween(pl.Callback):
    """Runs batches ``first_step`` to ``last_step - 1`` under ``torch.cuda.set_sync_debug_mode("error")``.

    From the first one's start to the start of the batch after the last (every hook between them included),
    any operation that makes the host wait for the GPU raises there, naming itself. Choose steps off logging
    steps (their metrics are read on the host by design).
    """

    def __init__(self, first_step: int, last_step: int) -> None:
        self.first_step, self.last_step = first_step, last_step

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[override]
        inside = self.first_step <= trainer.global_step < self.last_step
        torch.cuda.set_sync_debug_mode("error" if inside else "default")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.set_sync_debug_mode("default")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Off before Lightning's teardown moves state to the CPU (a sync by design): the error stays the first one.
        torch.cuda.set_sync_debug_mode("default")


class LogLaunch(pl.Callback):
    """Logs ``launch`` (the environment's ``TEST_LAUNCH``) with every training step's metrics.

    A test that kills and relaunches a run reads it back from a tracker: each step's value names the launch
    whose computation of that step the tracker kept.
    """

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        pl_module.log("launch", float(os.environ.get("TEST_LAUNCH", "0")), on_step=True, on_epoch=False)


class RecordDeepSpeedNorms(pl.Callback):
    """Writes, per step, DeepSpeed's own gradient norm and loss scale beside GradNormMonitor's figures.

    ``deepspeed-rank<R>.json``: a list of ``{"step", "engine_norm", "loss_scale", "skipped", "monitor",
    "scaler_skipped_steps"}``, where ``engine_norm`` is the engine's ``get_global_grad_norm()`` (unscaled, computed
    in its step; inf on a step that overflowed), ``skipped`` the engine's count of skipped steps so far, and
    ``monitor`` and ``scaler_skipped_steps`` GradNormMonitor's ``last_metrics`` and count after the same step.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.rows: list[dict[str, Any]] = []

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        from lightning_mlopt.callbacks import GradNormMonitor

        engine = trainer.strategy.model
        (monitor,) = [cb for cb in trainer.callbacks if isinstance(cb, GradNormMonitor)]
        norm = engine.get_global_grad_norm()
        self.rows.append(
            {
                "step": trainer.global_step,
                "engine_norm": None if norm is None else float(norm),
                "loss_scale": float(engine.optimizer.loss_scale),
                "skipped": int(engine.skipped_steps),
                "monitor": dict(monitor.last_metrics),
                "scaler_skipped_steps": monitor.scaler_skipped_steps,
            }
        )
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"deepspeed-rank{trainer.global_rank}.json").write_text(json.dumps(self.rows))
