"""What each rank runs: host, library and driver versions, GPU model, NCCL settings; and how ranks differ."""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from lightning_mlopt.redaction import redact

# Differ between ranks by design; everything else should be identical across a job.
PER_RANK_KEYS = frozenset({"host"})
_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")


def _package(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _nvidia_driver() -> str:
    path = Path("/proc/driver/nvidia/version")
    if path.is_file():
        first = path.read_text().splitlines()[0]
        for word in first.split():
            if word[:1].isdigit() and "." in word:
                return word
    return "none"


def collect_fingerprint() -> dict[str, str]:
    """Collect the environment fingerprint of this process.

    No secrets: of the environment, only NCCL_* and TORCH_NCCL_* variables are read, and of those, any whose
    name says it holds a secret (``*TOKEN*``, ``*KEY*``, ...) is recorded as ``<redacted>``.

    Example::

        >>> {"torch", "lightning", "python"} <= set(collect_fingerprint())
        True
    """
    import lightning

    import lightning_mlopt

    cuda = torch.cuda.is_available()
    nccl = "unavailable"
    if cuda and torch.distributed.is_nccl_available():
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())  # the library actually loaded
    fingerprint = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "nccl": nccl,
        "driver": _nvidia_driver(),
        "gpu": torch.cuda.get_device_name() if cuda else "none",
        "lightning": lightning.__version__,
        "deepspeed": _package("deepspeed"),
        "lightning_mlopt": lightning_mlopt.__version__,
    }
    for key in sorted(os.environ):
        if key.startswith(_ENV_PREFIXES):
            fingerprint[f"env:{key}"] = os.environ[key]
    return redact(fingerprint)


def fingerprint_mismatches(fingerprints: Sequence[dict[str, str]]) -> list[str]:
    """One line per key whose value differs across ranks, naming each value's ranks and hosts.

    Example::

        >>> fingerprint_mismatches([{"host": "a", "torch": "2.6"}, {"host": "b", "torch": "2.5"}])
        ["torch: '2.6' on rank 0 (a); '2.5' on rank 1 (b)"]
    """
    keys = sorted({key for fp in fingerprints for key in fp} - PER_RANK_KEYS)
    lines = []
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for rank, fp in enumerate(fingerprints):
            by_value.setdefault(fp.get(key, "<unset>"), []).append(rank)
        if len(by_value) > 1:
            parts = []
            for value, ranks in by_value.items():
                where = ", ".join(f"{r} ({fingerprints[r].get('host', '?')})" for r in ranks)
                parts.append(f"{value!r} on rank{'s' if len(ranks) > 1 else ''} {where}")
            lines.append(f"{key}: " + "; ".join(parts))
    return lines
