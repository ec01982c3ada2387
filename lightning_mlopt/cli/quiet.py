"""Known noise, silenced by message: lines a user of our CLI cannot act on, or that we answer ourselves.

Only these exact messages; every other warning and log line of Lightning, torch and DeepSpeed stays. Each
entry says why it is noise here. The CLI installs them; a script of one's own calls :func:`quiet_lightning`.

Example::

    from lightning_mlopt.cli import quiet_lightning

    quiet_lightning()  # before the Trainer is made
    trainer = Trainer(callbacks=[FaultTolerantCheckpoint()])
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def quiet_lightning() -> None:
    """Drop the lines of Lightning, torch and DeepSpeed that the CLI drops, in this process (idempotent).

    Filters by exact message (the list in this module, each with its reason), on Python's warnings and on
    Lightning's rank-zero logger; every other line stays. Call it once, before the Trainer is made (some of the
    lines come from its constructor). The CLI calls it for its runs.

    Example::

        from lightning.pytorch import Trainer
        from lightning_mlopt.cli import quiet_lightning

        quiet_lightning()
        Trainer(max_steps=100).fit(model)  # no litlogger tip, no tensorboardX notice, ...

    """
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


_PACKAGE = Path(__file__).resolve().parents[1]  # lightning_mlopt/
_format_before: Callable[..., str] = warnings.formatwarning  # Lightning's (set at its import) or Python's


def show_our_warnings_plainly() -> None:
    """The CLI's warnings of this package without their ``file:line`` and source line (idempotent).

    They are messages about the run (a setting, the data, a checkpoint), not about the line of ours that noticed:
    the place is noise to the user of the CLI, who wrote no code. Other packages' warnings keep theirs.
    """
    global _format_before
    if warnings.formatwarning is not _format_warning:
        _format_before, warnings.formatwarning = warnings.formatwarning, _format_warning


def _format_warning(
    message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    if _is_ours(filename):
        return f"{category.__name__}: {message}\n"
    return _format_before(message, category, filename, lineno, line)


def _is_ours(filename: Any) -> bool:
    try:
        return Path(os.path.abspath(filename)).is_relative_to(_PACKAGE)
    except (TypeError, ValueError):
        return False


def is_silenced(message: str) -> bool:
    """True for a warning message the filters drop (tests)."""
    return any(re.match(pattern, message) for pattern in (*_WARNINGS, _OUTSIDE_SLURM))
