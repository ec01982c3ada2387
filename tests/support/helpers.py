"""Classes the 2-process tests name by class_path: they run inside the launched workers and write files.

They live at module level in an importable module so that every rank (a fresh process) can build them.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_mlopt.demos import TokenDataModule


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


class Pace(pl.Callback):
    """Slows each step and marks progress on disk, so a test can signal or kill a run mid-training.

    Args:
        out_dir: where ``step-<N>.rank<R>`` marker files go (each holds the process id that wrote it).
        seconds_per_step: sleep after every training step.
    """

    def __init__(self, out_dir: str, seconds_per_step: float = 0.0) -> None:
        self.out_dir = Path(out_dir)
        self.seconds_per_step = seconds_per_step

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"step-{trainer.global_step}.rank{trainer.global_rank}").write_text(str(os.getpid()))
        if self.seconds_per_step:
            import time

            time.sleep(self.seconds_per_step)


class RecordMonitor(pl.Callback):
    """Writes each step's GradNormMonitor metrics and the first batch of each rank into ``out_dir``.

    Args:
        out_dir: folder for ``monitor-rank<R>.json`` and ``batch-rank<R>.pt``.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.metrics: list[dict[str, float]] = []

    @override
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_step == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.save([t.cpu() for t in batch], self.out_dir / f"batch-rank{trainer.global_rank}.pt")

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
        (self.out_dir / f"monitor-rank{trainer.global_rank}.json").write_text(json.dumps(record))


class InjectNonFinite(pl.Callback):
    """Multiplies one module's output by NaN (or a factor) on chosen ranks at one step.

    Args:
        module: the module's name in the LightningModule, e.g. ``model.layers.1.mlp.0``.
        step: the optimizer step (global_step) whose forward is poisoned.
        ranks: ranks that inject; None: all.
        factor: what the output is multiplied by (NaN by default; a large number makes a spike).
    """

    def __init__(self, module: str, step: int, ranks: list[int] | None = None, factor: float = float("nan")) -> None:
        self.module, self.step, self.ranks, self.factor = module, step, ranks, factor

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        target = dict(pl_module.named_modules())[self.module]

        def poison(module, inputs, output):  # type: ignore[no-untyped-def]
            if trainer.global_step == self.step and (self.ranks is None or trainer.global_rank in self.ranks):
                return output * self.factor
            return output

        # prepend: the poison acts as part of the module's own forward, before any observer sees the output
        target.register_forward_hook(poison, prepend=True)


class SleepyGPT(pl.LightningModule):
    """The GPT demo, except that one rank naps inside ``training_step`` at one step (a hang to detect).

    Args:
        sleep_rank: the rank that naps.
        sleep_step: the global step at which it naps.
        sleep_seconds: how long.
        only_first_attempt: nap only when torchrun's TORCHELASTIC_RESTART_COUNT is 0 (a hang that a
            restart cures).
    """

    def __init__(
        self, sleep_rank: int = 1, sleep_step: int = 3, sleep_seconds: float = 300.0, only_first_attempt: bool = False
    ) -> None:
        super().__init__()
        from lightning_mlopt.demos import GPTLanguageModel

        self.inner = GPTLanguageModel()
        self.sleep_rank, self.sleep_step, self.sleep_seconds = sleep_rank, sleep_step, sleep_seconds
        self.only_first_attempt = only_first_attempt

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        here_and_now = self.global_rank == self.sleep_rank and self.global_step == self.sleep_step
        if here_and_now and (first_attempt or not self.only_first_attempt):
            nap_inside_training_step(self.sleep_seconds)
        return self.inner._loss(batch)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def nap_inside_training_step(seconds: float) -> None:
    """The function a hang dump must name."""
    import time

    time.sleep(seconds)


class FakeVersionOnRank(pl.Callback):
    """Makes one rank report a different value for one fingerprint key (a version skew to detect).

    Put it before NCCLHealthCheck in the callbacks list.
    """

    def __init__(self, rank: int = 1, key: str = "torch", value: str = "2.0.0") -> None:
        self.rank, self.key, self.value = rank, key, value

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.global_rank != self.rank:
            return
        from lightning_mlopt.callbacks import nccl_health_check

        real = nccl_health_check.collect_fingerprint
        nccl_health_check.collect_fingerprint = lambda: {**real(), self.key: self.value}  # type: ignore[assignment]


class SlowRank(pl.Callback):
    """Slows one rank's forward pass by a fixed time per step (a straggler to detect)."""

    def __init__(self, rank: int = 1, seconds: float = 0.2) -> None:
        self.rank, self.seconds = rank, seconds

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank != self.rank:
            return
        import time

        pl_module.register_forward_hook(lambda *args: time.sleep(self.seconds))


class LateToSetup(pl.Callback):
    """One rank arrives late to setup (put it before NCCLHealthCheck)."""

    def __init__(self, rank: int = 1, seconds: float = 10.0) -> None:
        self.rank, self.seconds = rank, seconds

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.global_rank == self.rank:
            import time

            time.sleep(self.seconds)


class RecordHyperparameters(pl.Callback):
    """Writes ``hparams-rank<R>.json`` (the model's hyperparameters as this rank sees them) into the run dir."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        folder = Path(trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        hparams = {key: value for key, value in pl_module.hparams.items() if isinstance(value, (int, float, str))}
        (folder / f"hparams-rank{trainer.global_rank}.json").write_text(json.dumps(hparams))


class ThirdPartyLM(pl.LightningModule):
    """A language model as a user brings one, written the way Hugging Face's GPT-2 and Lightning's own examples
    are, not like our demos: hyperparameters saved with ``save_hyperparameters()``, its own dataloaders (no
    datamodule), ``nn.TransformerEncoder`` with a causal mask, metrics named ``train_loss``/``val_loss``.

    Args:
        vocab_size, n_positions, n_embd, n_layer, n_head, dropout: the model's size.
        batch_size: per process.
        num_sequences: synthetic sequences (a seeded Markov chain of tokens) in the training set.
        lr: AdamW's learning rate.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        n_positions: int = 32,
        n_embd: int = 32,
        n_layer: int = 2,
        n_head: int = 2,
        dropout: float = 0.1,
        batch_size: int = 8,
        num_sequences: int = 256,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = torch.nn.Embedding(vocab_size, n_embd)
        self.wpe = torch.nn.Embedding(n_positions, n_embd)
        layer = torch.nn.TransformerEncoderLayer(n_embd, n_head, 4 * n_embd, dropout, batch_first=True)
        self.h = torch.nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.lm_head = torch.nn.Linear(n_embd, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1], device=input_ids.device)
        hidden = self.h(self.wte(input_ids) + self.wpe(positions), mask=mask, is_causal=True)
        return self.lm_head(hidden)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def _tokens(self, count: int, seed: int) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(seed)
        steps = torch.randint(1, 4, (count, self.hparams.n_positions), generator=generator)
        data = steps.cumsum(dim=1) % self.hparams.vocab_size  # learnable: each token follows from the last
        return torch.utils.data.DataLoader(data, batch_size=self.hparams.batch_size, shuffle=seed == 0)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._tokens(self.hparams.num_sequences, seed=0)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._tokens(64, seed=1)

    def test_dataloader(self) -> torch.utils.data.DataLoader:
        return self._tokens(64, seed=2)

    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        return self._tokens(16, seed=3)


class InterfereWithBackgroundWrite(pl.Callback):
    """At the save of ``step``, on a strategy that writes sharded checkpoints in the background:

    - ``hold_s``: once this rank's files are written, mark ``<out_dir>/in-flight-rank<R>`` and hold the
      write open (uncommitted) for that long, so a test can SIGKILL the job during it;
    - ``block_rank``: on that rank only, put a folder where its DCP shard file goes, so the operating system
      refuses the write (EISDIR) in the background thread.
    """

    def __init__(self, out_dir: str, step: int, hold_s: float = 0.0, block_rank: int | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.step = step
        self.hold_s = hold_s
        self.block_rank = block_rank

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import threading
        from concurrent.futures import Future

        strategy = trainer.strategy
        original = strategy.save_checkpoint_async  # type: ignore[attr-defined]
        rank = trainer.global_rank

        def interfering(checkpoint: dict, filepath: Any) -> Future:
            if trainer.global_step != self.step:
                return original(checkpoint, filepath)
            if rank == self.block_rank:
                (Path(filepath) / f"__{rank}_0.distcp").mkdir(parents=True)
            written = original(checkpoint, filepath)
            held: Future = Future()

            def hold() -> None:
                try:
                    written.result()
                except BaseException as error:
                    held.set_exception(error)
                    return
                self.out_dir.mkdir(parents=True, exist_ok=True)
                (self.out_dir / f"in-flight-rank{rank}").touch()
                time.sleep(self.hold_s)
                held.set_result(None)

            threading.Thread(target=hold, daemon=True).start()
            return held

        strategy.save_checkpoint_async = interfering  # type: ignore[attr-defined]


class _SleepingCollate:
    """The default collate, sleeping first on the chosen ranks (picklable, for DataLoader workers)."""

    def __init__(self, seconds: float, ranks: list[int] | None) -> None:
        self.seconds, self.ranks = seconds, ranks

    def __call__(self, samples):  # type: ignore[no-untyped-def]
        import torch.distributed as dist
        from torch.utils.data import default_collate

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if self.ranks is None or rank in self.ranks:
            time.sleep(self.seconds)
        return default_collate(samples)


class SlowCollateTokens(TokenDataModule):
    """The GPT demo's token data with a collate that sleeps ``collate_sleep_s`` on ``slow_ranks`` (None: all)."""

    def __init__(self, collate_sleep_s: float = 0.05, slow_ranks: list[int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.collate = _SleepingCollate(collate_sleep_s, slow_ranks)

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True, collate_fn=self.collate
        )


class NaNSampleRegression(pl.LightningModule):
    """A linear regression whose training data holds one sample with a NaN feature (a bad sample in the data)."""

    def __init__(self, bad_index: int = 5, samples: int = 64) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        generator = torch.Generator().manual_seed(0)
        features = torch.randn(samples, 8, generator=generator)
        features[bad_index, 3] = float("nan")
        self.data = torch.utils.data.TensorDataset(features, torch.randn(samples, 1, generator=generator))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        features, targets = batch
        return torch.nn.functional.mse_loss(self.layer(features), targets)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4, shuffle=True)


class SlowSaves(pl.Callback):
    """Every checkpoint takes at least ``seconds`` longer to save (a slow disk, a large model)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # type: ignore[override]
        time.sleep(self.seconds)


class SignalAtStep(pl.Callback):
    """Sends ``signal_name`` to this process at the end of optimizer step ``step`` (a scheduler's preemption)."""

    def __init__(self, step: int, signal_name: str = "SIGTERM") -> None:
        self.step = step
        self.signal_name = signal_name

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        import signal

        if trainer.global_step == self.step:
            os.kill(os.getpid(), getattr(signal, self.signal_name))


class SlowWrite(pl.Callback):
    """The checkpoint write of ``step`` takes ``seconds`` longer (a slow disk), in the background writer too."""

    def __init__(self, step: int, seconds: float) -> None:
        self.step = step
        self.seconds = seconds

    @override
    def setup(self, trainer, pl_module, stage) -> None:  # type: ignore[override]
        from lightning_mlopt.checkpoint import saver

        original, name = saver.save_file, f"step-{self.step:09d}"

        def slow(state: Any, path: Any) -> Any:
            if name in str(path):
                time.sleep(self.seconds)
            return original(state, path)

        saver.save_file = slow


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


class StrayCollectiveGPT(pl.LightningModule):
    """The GPT demo, except that one rank issues a collective the others do not, at one step.

    Args:
        kind: ``sync_dist`` (``self.log(..., sync_dist=True)`` inside a rank's branch: a barrier and an
            all-reduce), ``all_gather`` (``self.all_gather`` of a metric on one rank), or ``shape`` (every rank
            all-reduces a metric, but ``stray_rank``'s has another shape: the collectives pair up and the step
            ends, wrong).
        stray_rank: the rank that issues it.
        stray_step: the global step at which it does.
    """

    def __init__(self, kind: str = "sync_dist", stray_rank: int = 0, stray_step: int = 2) -> None:
        super().__init__()
        from lightning_mlopt.demos import GPTLanguageModel

        self.inner = GPTLanguageModel()
        self.kind, self.stray_rank, self.stray_step = kind, stray_rank, stray_step

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self.inner._loss(batch)
        if self.global_rank == self.stray_rank and self.global_step == self.stray_step:
            if self.kind == "sync_dist":
                self.log("train/stray_loss", loss, sync_dist=True)  # the stray collective: rank-0-only sync
            elif self.kind == "all_gather":
                self.all_gather(torch.ones(4))  # the stray collective: a metric gathered on one rank
        if self.kind == "shape" and self.global_step == self.stray_step:
            shape = (2, 2) if self.global_rank == self.stray_rank else (4,)
            torch.distributed.all_reduce(torch.ones(shape))  # the same bytes on every rank: they pair up
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


class HoldAtStep(pl.Callback):
    """Holds every rank at the end of optimizer step ``step`` until the file ``release`` exists: a live job that a
    test keeps alive while it launches another into the same run directory.

    Each rank writes ``<release>.rank<R>`` (its process id) when it starts holding.
    """

    def __init__(self, release: str, step: int = 1, timeout_s: float = 300.0) -> None:
        self.release, self.step, self.timeout_s = Path(release), step, timeout_s

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_step != self.step:
            return
        Path(f"{self.release}.rank{trainer.global_rank}").write_text(str(os.getpid()))
        deadline = time.monotonic() + self.timeout_s
        while not self.release.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
