"""Where a run's checkpoints live: one folder, or a fast local tier and an object store behind it.

With ``dirpath`` a folder, saves commit there. With ``dirpath: s3://bucket/prefix``, saves commit to a local
folder (``tiers.local_dirpath``, else the run dir's) and a
:class:`~lightning_mlopt.checkpoint.remote.replicator.Replicator` copies them up; resume takes the newest
checkpoint that verifies across both. These helpers reach the store before training starts (the settings check
themselves: ``settings.Tiers``).

Example::

    remote, replicator = attach_tiers(trainer, "s3://ckpt/run", Tiers(), RetentionPolicy())   # collective
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_mlopt.checkpoint.errors import first_problem
from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
from lightning_mlopt.checkpoint.remote.object_store import ObjectStore, store_url
from lightning_mlopt.checkpoint.remote.replicator import Replicator
from lightning_mlopt.checkpoint.retention import RetentionPolicy
from lightning_mlopt.checkpoint.settings import Tiers
from lightning_mlopt.exceptions import CheckpointWriteError, ObjectStoreError
from lightning_mlopt.run_dir import CHECKPOINTS_DIR


def local_folder(dirpath: str | None, local_dirpath: str | None) -> str | None:
    """The folder saves commit to: ``dirpath`` when it is one, else ``local_dirpath`` (None: the run dir's).

    Example::

        >>> local_folder("s3://ckpt/run", "/local/ckpt"), local_folder("/shared/ckpt", None)
        ('/local/ckpt', '/shared/ckpt')
    """
    return local_dirpath if store_url(dirpath) is not None else dirpath


def checkpoint_folder(dirpath: str | None, local_dirpath: str | None, run_dir: str | Path) -> Path:
    """The local folder a run's checkpoints commit to: :func:`local_folder`, else ``<run_dir>/checkpoints``.

    The one place the default is worked out: FaultTolerantCheckpoint (with the trainer's
    ``default_root_dir``), the CLI's ``ckpt_path`` resolution and its finished-run check agree by calling it.

    Example::

        >>> str(checkpoint_folder(None, None, "runs/a")), str(checkpoint_folder("s3://b/p", "/nvme/c", "runs/a"))
        ('runs/a/checkpoints', '/nvme/c')
    """
    return Path(local_folder(dirpath, local_dirpath) or Path(run_dir) / CHECKPOINTS_DIR)


def attach_remote(
    trainer: Any, url: str | None, retention: RetentionPolicy, required: bool
) -> RemoteCheckpoints | None:
    """Collective: rank zero's remote tier at ``url``, reached before training (None on other ranks, or no URL).

    ``required``: a store that cannot be reached stops every rank with :class:`CheckpointWriteError` (exit
    74) before the first step; else the first due copy tries again (and says once if it fails).
    """
    if url is None:
        return None
    remote, problem = None, None
    if trainer.is_global_zero:
        remote = RemoteCheckpoints(ObjectStore.for_url(url), retention)
        try:
            remote.attach()
        except ObjectStoreError as error:
            if required:
                problem = str(error)
            # else the first due copy tries again, and says it once if the store still fails
    problem = first_problem(trainer, problem)
    if problem is not None:
        raise CheckpointWriteError(
            f"cannot save checkpoints: {problem}; stopped before training, earlier checkpoints are intact"
        )
    return remote


def attach_tiers(
    trainer: Any, dirpath: str | None, tiers: Tiers, retention: RetentionPolicy
) -> tuple[RemoteCheckpoints | None, Replicator | None]:
    """Collective: the remote tier behind ``dirpath`` (an object store) and what copies to it; None, None without.

    Without a local tier of its own (``tiers.local_dirpath``) the store is required: unreachable, or a copy
    that fails, stops the run (exit 74).
    """
    required = tiers.local_dirpath is None
    remote = attach_remote(trainer, store_url(dirpath), retention, required=required)
    if remote is None:
        return None, None
    every_steps, every_minutes = tiers.remote_every_n_steps, tiers.remote_every_n_minutes
    return remote, Replicator(remote, every_steps, every_minutes, must_succeed=required)
