"""Known noise, silenced by message: lines a user of our CLI cannot act on, or that we answer ourselves.

Only these exact messages; every other warning and log line of Lightning, torch and DeepSpeed stays. Each
entry says why it is noise here.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

_WARNINGS = (
    # Lightning/torch internals warning about each other's deprecations: nothing the user calls.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # DeepSpeed's ZeRO calls these torch collectives (42 lines in a 10-step ZeRO-3 run).
    r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    # Only without the tensorboard package; the CSV logger it falls back to works.
    r"Starting from v1\.9\.0, `tensorboardX` has been removed",
    # FaultTolerantCheckpoint resumes mid-epoch exactly: it skips the consumed batches at the sampler and
    # restores every RNG (it says so in its own line), so this is not true of our resumes.
    r"You're resuming from a checkpoint that ended before the epoch ended",
    # `checkpoint consolidate` writes the single file this points to (docs/checkpointing.md).
    r"When saving the DeepSpeed Stage 3 checkpoint, each worker will save a shard",
)
_LOG_LINES = (
    "💡 Tip: For seamless",  # an advertisement for a cloud service, on every run
    "Loading `train_dataloader` to estimate number of stepping batches",  # the progress bar's ETA asks for it
    # The CLI brings its own model summary (FLOPs only where measured); Lightning says it skips its default.
    "Trainer already configured with model summary callbacks",
)
_OUTSIDE_SLURM = r"The `srun` command is available on your system but is not used"


class _DropLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(line) for line in _LOG_LINES)


def silence_known_noise() -> None:
    """Install the filters (idempotent). Call once per process, before the Trainer exists."""
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    if "SLURM_JOB_ID" not in os.environ:
        # Not inside a SLURM allocation: a local run on a machine that has SLURM tools installed is intended.
        # Inside one, the hint (use srun) is right and stays.
        warnings.filterwarnings("ignore", message=_OUTSIDE_SLURM)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropLines) for existing in logger.filters):
            logger.addFilter(_DropLines())


def is_silenced(message: str) -> bool:
    """True for a warning message the filters drop (tests)."""
    return any(re.match(pattern, message) for pattern in (*_WARNINGS, _OUTSIDE_SLURM))
