"""Faults delivered as the world delivers them: callbacks a test adds by class path, and kills from outside.

Example::

    run_cli(fit_args("--trainer.callbacks+=tests.support.faults.SegfaultAtStep",
                     "--trainer.callbacks.step=2", devices=1), cwd=tmp_path)
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from typing_extensions import override


class SegfaultAtStep(pl.Callback):
    """Crashes this process with a real SIGSEGV (a read of address 0) at the end of optimizer step ``step``:
    what a faulty native extension does."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_step == self.step:
            read_address_zero()


def read_address_zero() -> None:
    """Dereference a null pointer, as a native bug does (named so the crash report's frames can be checked)."""
    ctypes.string_at(0)


class RaiseOnRank(pl.Callback):
    """Raises ``RuntimeError`` on rank ``rank`` at the end of optimizer step ``step`` (a bug one rank hits)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


class HangOnRank(pl.Callback):
    """Rank ``rank`` sleeps ``seconds`` at the end of optimizer step ``step``: its peers wait for it in the next
    step's collective (a rank stuck outside a collective, the others inside one)."""

    def __init__(self, rank: int, step: int, seconds: float = 600.0) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[override]
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            import time

            open(f"hanging-rank{self.rank}", "w").close()  # in the working directory: the test waits for it
            time.sleep(self.seconds)


def kill_job_when(
    args: list[str], cwd: Path, ready: Callable[[], bool], waiting_for: str, preloaded: bool = False
) -> None:
    """Start ``python -m lightning_mlopt ARGS`` as a job of its own; SIGKILL every process of it (ranks, workers)
    once ``ready()`` holds. ``preloaded``: its ranks forked from the preloaded server (``tests/conftest.py``).

    A job that ends before that fails the test, naming ``waiting_for``; after 240 s it is killed all the same.
    """
    from tests.conftest import start_cli

    process = start_cli(args, cwd, preloaded=preloaded, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not ready() and time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"the job ended (status {process.returncode}) before {waiting_for}")
            time.sleep(0.02)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


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


class DeepSpeedFp16OnCpu(pl.Callback):
    """Lets DeepSpeed build an fp16 engine on this CPU, which it refuses ("Type fp16 is not supported on your
    device") where oneDNN has no fp16 kernels; torch runs fp16 on the CPU anyway, slowly. Before the strategy's
    setup builds the engine (callbacks' ``setup`` comes first). For tests of what fp16 changes, not of speed."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from deepspeed.accelerator import get_accelerator

        get_accelerator().is_fp16_supported = lambda: True  # type: ignore[method-assign]
