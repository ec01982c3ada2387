"""ThroughputProgressBar: Lightning's progress bar with global samples/s (or tokens/s) and the run's ETA."""

from __future__ import annotations

import datetime
import math
import sys
import time
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

from lightning_mlopt._compat import defer_progress_bar_scalars
from lightning_mlopt.distributed.sharding import data_parallel_size


def count_items(batch: Any) -> tuple[int, str]:
    """How much data a batch holds: tokens for integer sequences (``[batch, time]``), else samples.

    Example::

        >>> count_items((torch.zeros(8, 128, dtype=torch.long), torch.zeros(8, 128, dtype=torch.long)))
        (1024, 'tokens')
        >>> count_items([torch.zeros(32, 3, 32, 32), torch.zeros(32)])
        (32, 'samples')
    """
    first = _first_tensor(batch)
    if first is None:
        return 1, "samples"
    if not first.is_floating_point() and not first.is_complex() and first.dim() >= 2:
        return first.numel(), "tokens"
    return (first.shape[0] if first.dim() else 1), "samples"


def count_samples(batch: Any) -> int:
    """How many samples a batch holds: the first tensor's leading dimension (1 when it has none).

    Example::

        >>> count_samples({"input_ids": torch.zeros(8, 128, dtype=torch.long)})
        8
    """
    first = _first_tensor(batch)
    return first.shape[0] if first is not None and first.dim() else 1


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


class ThroughputMeter:
    """Rate and time left over a sliding window of batches; intervals that include validation are dropped.

    Args:
        window: how many recent batches the rate is averaged over.

    Example::

        meter = ThroughputMeter(window=20)
        meter.batch_done(items=64, now=0.0); meter.batch_done(items=64, now=0.5)
        meter.rate()                         # 128.0 items per second
        meter.seconds_left(batches_left=10)  # 5.0

    """

    def __init__(self, window: int = 20) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._intervals: deque[tuple[float, int]] = deque(maxlen=window)  # (seconds, items) per batch
        self._last: float | None = None

    def batch_done(self, items: int, now: float | None = None) -> None:
        """Record that a batch of ``items`` finished at ``now`` (default: the monotonic clock)."""
        now = time.perf_counter() if now is None else now
        if self._last is not None:
            self._intervals.append((now - self._last, items))
        self._last = now

    def pause(self) -> None:
        """Forget the running interval (validation, a checkpoint load): the next batch starts a new one."""
        self._last = None

    def rate(self) -> float | None:
        """Items per second over the window, or None before two batches finished."""
        seconds = sum(interval for interval, _ in self._intervals)
        return sum(items for _, items in self._intervals) / seconds if seconds > 0 else None

    def seconds_left(self, batches_left: float) -> float | None:
        """Time for ``batches_left`` more batches at the window's pace, or None when unknown."""
        if not self._intervals or not math.isfinite(batches_left):
            return None
        per_batch = sum(interval for interval, _ in self._intervals) / len(self._intervals)
        return max(batches_left, 0) * per_batch


def format_rate(rate: float) -> str:
    """``1234.5`` -> ``'1.23k'``; ``2.5e6`` -> ``'2.50M'``."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if rate >= limit:
            return f"{rate / limit:.2f}{suffix}"
    return f"{rate:.1f}"


class ThroughputProgressBar(TQDMProgressBar):
    """The TQDM progress bar plus the job's throughput and the time left in the whole run.

    Shows ``samples/s`` (or ``tokens/s`` for integer ``[batch, time]`` inputs) summed over the data-parallel
    ranks (tensor-parallel ranks share a batch and count once), assuming
    every rank sees batches of the same size (true with the DistributedSampler), and ``eta``: time until
    ``max_steps``/``max_epochs`` at the recent pace, validation excluded. The CLI uses it by default;
    ``trainer.enable_progress_bar: false`` turns it off.

    Costs no collective, and no host sync on a step it does not draw: the metrics on the bar (``train/loss``
    logged with ``prog_bar=True``) are tensors on the device, and reading them waits for the GPU, so it reads
    them only when it draws: at most every ``min_interval_s`` seconds in a terminal (Lightning's bar reads them
    after every batch, and so does its logger connector, which this bar defers to the draws: see
    ``_compat.defer_progress_bar_scalars``). When stdout is not a terminal (a SLURM log, a pipe, a file), a
    redrawn bar fills the log with carriage returns; it prints one plain line every ``log_every_n_steps``
    optimizer steps instead (rank zero), and reads the metrics then.

    Args:
        refresh_rate: update the bar at most every N batches.
        window: batches the throughput is averaged over.
        leave: keep each epoch's bar on screen.
        log_every_n_steps: with stdout not a terminal, one line every N optimizer steps; 0: draw the bar anyway.
        min_interval_s: in a terminal, draw at most this often (seconds; the last batch of an epoch always);
            each draw is one device synchronisation, so 0.5 s costs a 60 ms step one wait in eight.

    Example::

        trainer = Trainer(callbacks=[ThroughputProgressBar(refresh_rate=10)])

    """

    def __init__(
        self,
        refresh_rate: int = 1,
        window: int = 20,
        leave: bool = False,
        log_every_n_steps: int = 50,
        min_interval_s: float = 0.5,
    ) -> None:
        if log_every_n_steps < 0:
            raise ValueError(f"log_every_n_steps must be >= 0, got {log_every_n_steps}")
        if not min_interval_s >= 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self.window = window
        self.log_every_n_steps = log_every_n_steps
        self.min_interval_s = min_interval_s
        self._meter = ThroughputMeter(window)
        self._unit = "samples"
        self._lines = False
        self._last_line_step = -1
        self._drawn_at = -math.inf
        self._data_parallel = 1  # ranks reading different batches (tensor-parallel ranks share one)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        defer_progress_bar_scalars()
        self._lines = self.log_every_n_steps > 0 and not sys.stdout.isatty()
        if self._lines:
            self.disable()  # no bars at all; on_train_batch_end prints the lines

    @override
    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._data_parallel = data_parallel_size(trainer.strategy, trainer.world_size)  # once: not per batch
        self._meter.pause()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._drawn_at = -math.inf  # the epoch's first batch draws its bar

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        items, self._unit = count_items(batch)
        # Tensor-parallel ranks share their batch: the job's data is this rank's times the data-parallel ranks.
        self._meter.batch_done(items * self._data_parallel)
        if self._lines:
            self._print_line_if_due(trainer, pl_module)
        else:
            self._draw_if_due(trainer, pl_module, batches_done=batch_idx + 1)

    def _draw_if_due(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batches_done: int) -> None:
        """Redraw the bar, metrics included, if ``min_interval_s`` has passed (Lightning's would every batch)."""
        bar = self.train_progress_bar
        if not self.is_enabled or bar.disable:
            return
        last = batches_done == bar.total
        if batches_done % self.refresh_rate != 0 and not last:
            return
        now = time.monotonic()
        if now - self._drawn_at < self.min_interval_s and not last:
            return
        self._drawn_at = now
        bar.n = batches_done
        bar.set_postfix(self.get_metrics(trainer, pl_module))  # draws: the one read of the metrics

    def _print_line_if_due(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        due = step % self.log_every_n_steps == 0 or step == trainer.max_steps
        if due and trainer.is_global_zero and step != self._last_line_step:
            self._last_line_step = step
            print(self._line(trainer, pl_module), flush=True)

    def _line(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        """``step 50/1000 (epoch 0): loss=2.31 samples/s=1.23k eta=0:12:00``."""
        total = trainer.estimated_stepping_batches
        of = f"/{int(total)}" if math.isfinite(total) else ""
        metrics = self.get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        shown = " ".join(
            f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}" for key, value in metrics.items()
        )
        return f"step {trainer.global_step}{of} (epoch {trainer.current_epoch}): {shown}"

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._meter.pause()
        super().on_validation_end(trainer, pl_module)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        rate = self._meter.rate()
        if rate is not None:
            metrics[f"{self._unit}/s"] = format_rate(rate)
        steps_left = trainer.estimated_stepping_batches - trainer.global_step
        seconds = self._meter.seconds_left(steps_left * trainer.accumulate_grad_batches)
        if seconds is not None:
            metrics["eta"] = str(datetime.timedelta(seconds=round(seconds)))
        return metrics
