"""A profiler window over the same training steps of any loop: where a step's time goes, op by op.

    window = TraceWindow(start=20, stop=30, out=Path("/tmp/hand.json"))   # a hand-written loop
    for step, batch in enumerate(batches):
        window.at_step(step)
        train(batch)
    window.close()

    --trainer.callbacks+=trace_window.TraceSteps --trainer.callbacks.start=20 ...   # a Lightning run

Rank zero writes ``out``: the window's wall seconds, its step count, and for every op and profiler region
(``aten::*``, ``c10d::*``, ``Optimizer.step#*``, ...) its calls and self CPU time. ``trace_compare.py`` lays two
of them side by side. One thread records (torch.profiler, CPU activities, no stacks): cheap enough that the
window's wall time stays comparable between two loops profiled the same way.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


class TraceWindow:
    """torch.profiler from the start of step ``start`` to the start of step ``stop`` (rank zero only).

    Args:
        start: first profiled step (0-based).
        stop: first step after the window.
        out: the JSON file rank zero writes.
    """

    def __init__(self, start: int, stop: int, out: Path) -> None:
        if not 0 <= start < stop:
            raise ValueError(f"need 0 <= start < stop, got {start}, {stop}")
        self.start, self.stop, self.out = start, stop, Path(out)
        self._profile: Any = None
        self._started = 0.0

    def at_step(self, step: int) -> None:
        """Call at the start of every step, with its index."""
        rank_zero = not dist.is_initialized() or dist.get_rank() == 0
        if step == self.start and rank_zero:
            self._profile = profile(activities=[ProfilerActivity.CPU])
            self._profile.__enter__()
            self._started = time.perf_counter()
        elif step == self.stop:
            self.close()

    def close(self) -> None:
        """End the window (if open) and write the file."""
        if self._profile is None:
            return
        wall = time.perf_counter() - self._started
        self._profile.__exit__(None, None, None)
        ops = [
            {"name": event.key, "calls": event.count, "self_cpu_us": event.self_cpu_time_total}
            for event in self._profile.key_averages()
        ]
        self._profile = None
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps({"steps": self.stop - self.start, "wall_s": wall, "ops": ops}))


class TraceSteps(pl.Callback):
    """:class:`TraceWindow` in a Lightning run: the window opens and closes at training batch starts."""

    def __init__(self, start: int, stop: int, out: str) -> None:
        self.window = TraceWindow(start, stop, Path(out))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.window.at_step(trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.window.close()
