"""An all-reduce bandwidth probe, reported as nccl-tests defines algorithm and bus bandwidth."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Bandwidth:
    """Result of a probe.

    Attributes:
        size_bytes: bytes all-reduced per iteration.
        seconds: mean time of one all-reduce.
        algbw_gbps: algorithm bandwidth, ``size / time``, in GB/s (1e9 bytes).
        busbw_gbps: bus bandwidth, ``algbw * 2 (n - 1) / n`` for all-reduce: comparable across world sizes.

    """

    size_bytes: int
    seconds: float
    algbw_gbps: float
    busbw_gbps: float


def bus_bandwidth(size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for one all-reduce of ``size_bytes`` taking ``seconds`` on ``world_size`` ranks.

    nccl-tests: ``algbw = S / t``; an all-reduce moves ``2 (n - 1) / n`` of the data over each rank's link,
    so ``busbw = algbw * 2 (n - 1) / n``, a figure that can be compared with the hardware's link speed.

    Example::

        >>> bus_bandwidth(1_000_000_000, 0.5, 4)
        (2.0, 3.0)
    """
    if seconds <= 0 or world_size < 1:
        raise ValueError(f"need seconds > 0 and world_size >= 1, got {seconds} and {world_size}")
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


def probe_all_reduce(
    size_bytes: int, device: torch.device, warmup: int = 2, iterations: int = 5, group: object | None = None
) -> Bandwidth:
    """Time all-reduces of ``size_bytes`` (fp32) after ``warmup`` untimed ones; the slowest rank's figure, everywhere.

    Collective: all ranks call it.
    """
    tensor = torch.ones(max(1, size_bytes // 4), dtype=torch.float32, device=device)
    for _ in range(warmup):
        dist.all_reduce(tensor, group=group)
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor, group=group)
    _synchronize(device)
    # The slowest rank's time, on every rank (as nccl-tests reports): a threshold then passes or fails alike
    # everywhere, never on some ranks while the others go on into the next collective.
    slowest = torch.tensor([(time.perf_counter() - start) / iterations], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    seconds = float(slowest.item())
    world = dist.get_world_size(group)  # type: ignore[arg-type]
    algbw, busbw = bus_bandwidth(tensor.numel() * 4, seconds, world)
    return Bandwidth(tensor.numel() * 4, seconds, algbw, busbw)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
