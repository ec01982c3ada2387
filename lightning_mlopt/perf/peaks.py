"""The FLOP/s a device can reach: its published dense peak (a table) and a measured matmul peak.

MFU (model FLOPs utilization) divides the FLOP/s a run achieves by a peak. The published figure is the
vendor's dense (no 2:4 sparsity) tensor-core number for the run's precision; a board this table does not know
gets no published peak (never another board's number). The measured peak is what a large matmul reaches on
this process's device right now: it exists everywhere, CPUs included, and includes clock throttling and any
other job sharing the device.

Example::

    >>> published_peak_flops("NVIDIA H200", "bf16") / 1e12
    989.4
    >>> published_peak_flops("NVIDIA GeForce GTX 1080", "bf16") is None
    True
"""

from __future__ import annotations

import re
import time

import torch

# Dense peak TFLOP/s by (board, precision), from the vendors' datasheets. The patterns are matched, in order,
# against the name the device reports (torch.cuda.get_device_name), e.g. "NVIDIA H100 80GB HBM3" (SXM),
# "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "AMD Instinct MI300X".
# "fp32" is the plain FP32 rate; "tf32" is FP32 matmuls on tensor cores (torch's allow_tf32 / "high").
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bH100\b.*NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    (r"\bH100\b.*PCIE", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0}),
    (r"\bH100\b", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),  # SXM (HBM3)
    (r"\bH200\b.*NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5}),
    (r"\bH200\b", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9}),  # SXM
    (r"\bB200\b", {"fp32": 75.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0}),
    (r"\bA100\b", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    (r"\bL40S\b", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0}),
    (r"\bMI3(00|25)X\b", {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9}),
    (r"\bMI300A\b", {"fp32": 122.6, "tf32": 490.3, "bf16": 980.6, "fp16": 980.6, "fp8": 1961.2}),
)

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")


def published_peak_flops(device_name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of the board called ``device_name`` at ``precision``; None when not known."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    name = device_name.upper()
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            peak = peaks.get(precision)
            return peak * 1e12 if peak is not None else None
    return None


def matmul_precision(trainer_precision: str) -> str:
    """The precision a run's matmuls run in, from Lightning's ``precision`` setting ("bf16-mixed" -> "bf16").

    Example::

        >>> matmul_precision("bf16-mixed"), matmul_precision("16-mixed"), matmul_precision("transformer-engine")
        ('bf16', 'fp16', 'fp8')
    """
    value = str(trainer_precision)
    if "transformer-engine" in value or "fp8" in value:
        return "fp8"
    if value.startswith("bf16"):
        return "bf16"
    if value.startswith("16"):
        return "fp16"
    # FP32 matmuls use tensor cores (TF32) unless torch is told to keep full precision.
    tf32 = torch.get_float32_matmul_precision() != "highest" or torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 and torch.cuda.is_available() else "fp32"


_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_peak_flops(device: torch.device, precision: str = "fp32", seconds: float = 0.15) -> float:
    """FLOP/s of square matmuls on ``device`` at ``precision``, timed for about ``seconds``.

    The size is 4096 on a GPU (large enough to saturate it) and 512 on a CPU (a CPU reaches its peak on small
    matrices, and every rank of a job on the same CPU runs its probe at once, as training will). FP8 is
    probed in bf16: torch has no portable FP8 matmul, so its measured MFU is against the bf16 rate.
    """
    size = 4096 if device.type == "cuda" else 512
    dtype = _DTYPES.get(precision, torch.bfloat16) if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    _synchronize(device)
    torch.mm(a, b)  # warm-up: kernel selection, first-touch of memory
    _synchronize(device)
    iterations, elapsed = 0, 0.0
    start = time.perf_counter()
    batch = 1
    while elapsed < seconds:
        for _ in range(batch):
            torch.mm(a, b)
        _synchronize(device)
        iterations += batch
        batch *= 2
        elapsed = time.perf_counter() - start
    return 2.0 * size**3 * iterations / elapsed


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
