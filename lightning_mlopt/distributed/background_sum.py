"""BackgroundSum: a small vector summed over every rank without blocking the training step.

A monitor that reports every rank's numbers needs one collective per report. Issued in the step and waited
for at once, it blocks every rank until the slowest arrives, and on a GPU reading its result syncs the host
with the device. Here the sum runs asynchronously over gloo, on CPU tensors: started at one step boundary,
read at a later one (by then long done), it never waits for the GPU. Under NCCL it has a gloo group of its
own; where training itself runs on gloo (CPU) it uses training's group, whose collectives are issued from the
same thread in the same order on every rank. It never shares the checkpoint coordination's group, whose
collectives run from another thread.

Example::

    summer = BackgroundSum()      # in setup, on every rank (creating the group is itself collective)
    summer.start([1.0, 2.0])      # at a logging step: returns at once
    ...                           # the next step trains meanwhile
    values = summer.result()      # [2.0, 4.0] on 2 ranks; waits only if the sum is not done yet
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_mlopt.distributed.host_group import host_sum_group, start_host_sum


class BackgroundSum:
    """Sums one float vector at a time over every rank, in the background; see the module docstring."""

    def __init__(self) -> None:
        self._several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # Training's group on gloo (its collectives are issued from this thread in the same order on every
        # rank), else a gloo group of its own: the sum stays on the host.
        self._group: Any = host_sum_group() if self._several else None
        self._work: Any = None
        self._values: torch.Tensor | None = None

    def start(self, values: list[float]) -> None:
        """Start summing ``values`` (the same length on every rank); returns at once."""
        if self._values is not None:
            raise RuntimeError("BackgroundSum.start: the previous sum has not been read")
        self._values = torch.tensor(values, dtype=torch.float64)
        if self._several:
            self._work = start_host_sum(self._values, self._group)

    def result(self) -> list[float]:
        """The sum started last, waiting for it if it is not done."""
        if self._values is None:
            raise RuntimeError("BackgroundSum.result: no sum was started")
        if self._work is not None:
            self._work.wait()
        values = self._values.tolist()
        self._work, self._values = None, None
        return values
