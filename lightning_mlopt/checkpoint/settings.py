"""FaultTolerantCheckpoint's settings by concern: what saves, what is kept, where copies go, preemption, resume.

Each group is a frozen dataclass that checks its own values when made, so a bad value is refused where it is
written (``ValueError``, exit 2 from the CLI) and the callback's constructor only stores them. jsonargparse reads
them as nested YAML keys, with each field's docstring as its ``--help`` text::

    checkpoint:
      every_n_steps: 500
      keep: {last: 5, monitor: val/loss}
      preemption: {grace_s: 30}
      resume: {final: true}

The flat keys of 0.1 (``keep_last``, ``auto_resume``, ...) are refused with the new key named:
:data:`RENAMED_KEYS`.

Example::

    >>> Keep(last=5, monitor="val/loss").retention()
    RetentionPolicy(keep_last=5, keep_every_n_steps=None, keep_best=1, mode='min')
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_mlopt.checkpoint.remote.object_store import ObjectURL, store_url
from lightning_mlopt.checkpoint.retention import RetentionPolicy
from lightning_mlopt.checkpoint.store import refuse_url
from lightning_mlopt.process import exit_codes
from lightning_mlopt.process.signals import DEFAULT_DEADLINE_S
from lightning_mlopt.renamed import refuse_renamed
from lightning_mlopt.spelling import Section

# Flat argument of 0.1 -> its key now (under the callback: ``checkpoint.<new>`` in the CLI's YAML).
RENAMED_KEYS: Mapping[str, str] = {
    "save_on_epoch_end": "save_on.epoch_end",
    "save_on_train_end": "save_on.train_end",
    "save_on_exception": "save_on.exception",
    "keep_last": "keep.last",
    "keep_every_n_steps": "keep.every_n_steps",
    "keep_best": "keep.best",
    "monitor": "keep.monitor",
    "mode": "keep.mode",
    "local_dirpath": "tiers.local_dirpath",
    "remote_every_n_steps": "tiers.remote_every_n_steps",
    "remote_every_n_minutes": "tiers.remote_every_n_minutes",
    "signals": "preemption.signals",
    "exit_code": "preemption.exit_code",
    "signal_deadline_s": "preemption.deadline_s",
    "preemption_grace_s": "preemption.grace_s",
    "auto_resume": "resume.auto",
    "resume_final": "resume.final",
    "trust_pickles": "resume.trust_pickles",
}


def refuse_flat_keys(given: Mapping[str, Any]) -> None:
    """TypeError naming the new key of each flat 0.1 argument of FaultTolerantCheckpoint in ``given``.

    Example::

        >>> refuse_flat_keys({"keep_last": 5})
        Traceback (most recent call last):
        ...
        TypeError: FaultTolerantCheckpoint: keep_last is now keep.last (e.g. keep=Keep(last=...); YAML: keep: ...
    """
    refuse_renamed("FaultTolerantCheckpoint", given, RENAMED_KEYS, _GROUP_CLASSES)


def configured(checkpoint: Any, key: str, default: Any = None) -> Any:
    """A dotted key of the CLI's parsed ``checkpoint:`` section (nested mappings, a Namespace or the groups).

    Example::

        >>> configured({"keep": {"mode": "max"}}, "keep.mode"), configured({}, "resume.auto", True)
        ('max', True)
    """
    node = checkpoint
    for part in key.split("."):
        if node is None:
            break
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


@dataclass(frozen=True)
class SaveOn:
    """Events that save, besides ``every_n_steps`` and ``every_n_minutes``.

    Example::

        FaultTolerantCheckpoint(every_n_steps=1000, save_on=SaveOn(epoch_end=False))
    """

    epoch_end: bool = True
    """Save at the last batch of every training epoch."""
    train_end: bool = True
    """Save at the end of training, marked final: a relaunch does not train again."""
    exception: bool = True
    """Save when training raises. Single-file strategies (DDP, one device) only: a sharded save needs every rank,
    and a rank that raised cannot bring the others along. Rank zero writes it (every rank holds the same state)."""


@dataclass(frozen=True)
class Keep:
    """Which checkpoints retention keeps; every other committed one is deleted after a save.

    Example::

        FaultTolerantCheckpoint(keep=Keep(last=2, every_n_steps=10_000, monitor="val/loss"))
    """

    last: int = 3
    """Keep the newest K checkpoints (>= 1)."""
    every_n_steps: int | None = None
    """Also keep forever the checkpoints whose step is a multiple of M."""
    monitor: str | None = None
    """A logged metric; the ``best`` checkpoints by it are kept too (and ``ckpt_path: best`` finds them)."""
    mode: Literal["min", "max"] = "min"
    """Which values of ``monitor`` are best."""
    best: int = 1
    """How many best checkpoints to keep when ``monitor`` is set."""

    def __post_init__(self) -> None:
        RetentionPolicy(self.last, self.every_n_steps, self.best, self.mode)  # checks the values, by these names

    def retention(self) -> RetentionPolicy:
        """The policy these settings give (no best kept without a metric to rank by)."""
        return RetentionPolicy(self.last, self.every_n_steps, self.best if self.monitor else 0, self.mode)


@dataclass(frozen=True)
class Tiers:
    """With ``dirpath: s3://...``: the fast local tier and how often the object store gets a copy.

    Example::

        tiers = Tiers(local_dirpath="/nvme/ckpt", remote_every_n_steps=1000)
        FaultTolerantCheckpoint(dirpath="s3://ckpt/run", tiers=tiers)
    """

    local_dirpath: str | None = None
    """The fast local tier (node-local disk, tmpfs), saved at every trigger; set, a failing copy to the store is
    said once while training goes on. None: ``<run_dir>/checkpoints``, every save is copied and a failed copy stops
    the run (exit 74)."""
    remote_every_n_steps: int | None = None
    """Copy to the object store when at least N steps passed since the last copy."""
    remote_every_n_minutes: float | None = None
    """Copy to the object store when at least T minutes passed since the last copy. With neither, every save is
    copied; the final and the signal save always are."""

    def check(self, dirpath: str | None) -> None:
        """ValueError for settings that cannot work: a URL no store here writes, a remote rule without a store.

        Example::

            >>> Tiers(local_dirpath="/local/ckpt", remote_every_n_steps=500).check("s3://ckpt/run")
            >>> Tiers(local_dirpath="/local/ckpt").check("/shared/ckpt")
            Traceback (most recent call last):
            ...
            ValueError: FaultTolerantCheckpoint(tiers=Tiers(local_dirpath=...)) sets the local tier of an object ...
        """
        store = store_url(dirpath)
        if store is not None:
            ObjectURL.parse(store)  # names the bucket
        elif dirpath is not None:
            refuse_url(
                dirpath, CHECKPOINT.setting("dirpath"), alternative=", or an S3-compatible store: s3://bucket/prefix"
            )
        if self.local_dirpath is not None:
            refuse_url(self.local_dirpath, CHECKPOINT.setting("tiers.local_dirpath"))
        if self.remote_every_n_steps is not None and self.remote_every_n_steps < 1:
            raise ValueError(f"tiers.remote_every_n_steps must be >= 1, got {self.remote_every_n_steps}")
        if self.remote_every_n_minutes is not None and self.remote_every_n_minutes <= 0:
            raise ValueError(f"tiers.remote_every_n_minutes must be > 0, got {self.remote_every_n_minutes}")
        given = [name for name, value in vars(self).items() if value is not None]
        if given and store is None:
            raise ValueError(
                f"{CHECKPOINT.setting(f'tiers.{given[0]}')} sets the local tier of an object store, and dirpath is "
                f"not one: set {CHECKPOINT.setting('dirpath', 's3://bucket/prefix')}, or remove it"
            )


@dataclass(frozen=True)
class Preemption:
    """The response to a preemption signal: save at the next step boundary on every rank, then exit.

    Example::

        FaultTolerantCheckpoint(preemption=Preemption(signals=["SIGUSR1"], grace_s=120))
    """

    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    """Signal names that request a save and a non-zero exit. The callback owns them for the run: Lightning's own
    handlers for them (which run a collective inside the handler and can hang the job) are kept off."""
    exit_code: int = exit_codes.REQUEUE
    """Exit status after a signal-triggered save; 75 is EX_TEMPFAIL ("try again"): a scheduler sees the job did
    not finish."""
    deadline_s: float | None = DEFAULT_DEADLINE_S
    """Seconds from a signal to a forced exit with ``exit_code`` when the process cannot reach a step boundary
    (e.g. a rank stuck in a collective); the previous checkpoint stays the one to resume from. None: wait forever.
    Moved below the grace when one is known."""
    grace_s: float | None = None
    """Seconds from the signal to the forced kill. None: what the launcher announced (``launch``: torchrun's
    shutdown timeout; the sbatch script: ``--signal_seconds``; a Kubernetes manifest: its grace), else unknown.
    Known, a save starts after a signal only if this run's earlier saves say it ends in time; otherwise the run
    exits with ``exit_code`` at once, naming the checkpoint a relaunch resumes from."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "signals", tuple(self.signals))  # a YAML list is as good as a tuple
        unknown = [name for name in self.signals if not hasattr(signal, name)]
        if unknown:
            raise ValueError(f"preemption.signals: unknown signal name(s) {unknown}; e.g. SIGTERM, SIGUSR1")
        if not 1 <= self.exit_code <= 255:
            raise ValueError(
                f"preemption.exit_code must be in 1..255 (non-zero, so a scheduler sees it), got {self.exit_code}"
            )
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError(f"preemption.deadline_s must be > 0 or null, got {self.deadline_s}")
        if self.grace_s is not None and self.grace_s <= 0:
            raise ValueError(f"preemption.grace_s must be > 0 or null, got {self.grace_s}")


@dataclass(frozen=True)
class Resume:
    """Whether and from what a relaunch resumes.

    Example::

        FaultTolerantCheckpoint(resume=Resume(final=True))  # train on after raising max_steps
        FaultTolerantCheckpoint(resume=Resume(ckpt_path="always"))  # roll back to ckpt_path, past newer saves
    """

    auto: bool = True
    """On ``fit``, resume from the run's newest valid checkpoint; ``ckpt_path`` is then the warm start of a run
    that has none of its own (see ``ckpt_path``). Off: ``fit`` starts from ``ckpt_path``, or from scratch."""
    final: bool = False
    """Resume a run whose newest checkpoint is marked final and train on (e.g. after raising ``max_steps``). Off: a
    finished run stays finished, whatever the limits say now."""
    trust_pickles: bool = False
    """Load checkpoints that reference Python types outside the allowlist of what lightning_mlopt checkpoints
    contain. Off: every pickle is checked before anything loads it, and one naming any other type is refused
    (exit 2), since unpickling it could run arbitrary code. Turn on only for checkpoints whose origin you trust."""
    ckpt_path: Literal["warm_start", "always"] = "warm_start"
    """How ``fit``'s ``ckpt_path`` meets this run's own checkpoints (with ``auto``). ``warm_start``: it is loaded
    only while the run has no checkpoint of its own, so a requeued job that carries it resumes from its own newest
    one (the CLI decides before the Trainer and says which it chose). ``always``: it is loaded whatever the run
    holds, and the run's checkpoints newer than it move to ``rolled_back/`` (a deliberate rollback, or a restart
    from another run's checkpoint); meant for one launch, not for a command that a scheduler requeues. A script
    that calls ``Trainer.fit(ckpt_path=...)`` itself always loads it."""


_GROUP_CLASSES = {"save_on": "SaveOn", "keep": "Keep", "tiers": "Tiers", "preemption": "Preemption", "resume": "Resume"}

CHECKPOINT = Section("checkpoint", "FaultTolerantCheckpoint", _GROUP_CLASSES)
"""How messages name FaultTolerantCheckpoint's settings: ``checkpoint.resume.final: true`` under the CLI,
``FaultTolerantCheckpoint(resume=Resume(final=True))`` in a script."""
