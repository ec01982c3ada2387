"""Shared benchmark plumbing: environment description, medians, result files (see README.md)."""

from __future__ import annotations

import datetime as dt
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def hardware() -> str:
    """CPU model and core count (and GPU name when one is present)."""
    model = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import os

    text = f"{model}, {os.cpu_count()} cores"
    try:
        import torch

        if torch.cuda.is_available():
            text += f", {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return text


def versions() -> str:
    """Versions of Python and the libraries the numbers depend on."""
    import deepspeed
    import lightning
    import torch

    import lightning_mlopt

    return (
        f"Python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, "
        f"deepspeed {deepspeed.__version__}, lightning_mlopt {lightning_mlopt.__version__}"
    )


def median(values: Sequence[float]) -> float:
    """Median of repeats: robust to the one run the OS scheduler disturbed."""
    return statistics.median(values)


def write_result(topic: str, hardware_tag: str, body: str) -> Path:
    """Write ``results/<topic>_<hardware>_<yyyymm>.md`` with the environment and the exact command."""
    now = dt.datetime.now(dt.timezone.utc)
    path = RESULTS / f"{topic}_{hardware_tag}_{now:%Y%m}.md"
    RESULTS.mkdir(parents=True, exist_ok=True)
    header = (
        f"# {topic}\n\n"
        f"- Date: {now:%Y-%m-%d %H:%M} UTC\n"
        f"- Hardware: {hardware()}\n"
        f"- Versions: {versions()}\n"
        f"- Command: `python {' '.join(sys.argv)}`\n\n"
    )
    path.write_text(header + body)
    return path
