"""``fit``'s ``ckpt_path`` meets the run's own checkpoints: the run's newest wins, the given path is its warm start.

A scheduler requeues the command it was given, ``--ckpt_path`` included. Were the given path to win on every
launch, each requeue would restart from it (and set aside what the run saved since): the run would never get
past its first interruption. So, as Composer's ``autoresume`` and torchtitan's ``initial_load_path`` do, the
given path is loaded only while the run has no checkpoint of its own; ``checkpoint.resume.ckpt_path: always``
loads it whatever the run holds (a deliberate rollback, a restart from another run's checkpoint).

The CLI decides before the Trainer exists, on every rank alone and without a collective, so the decision reads
only what every rank sees alike: the run's checkpoint folder (shared by the job's nodes: sharded saves write
into it from every rank), and the object store of ``dirpath: s3://...``; never a node-local tier
(``tiers.local_dirpath``), which may differ from node to node. A folder counts when its manifest parses and
every file it lists has the recorded size (no checksum: resume verifies the one it takes, on rank zero).

Example::

    >>> choice = WarmStart("runs/a/checkpoints", own=(40, "runs/b/checkpoints/step-000000040"))
    >>> choice.loads_given
    False
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_mlopt.checkpoint.manifest import MANIFEST_NAME, Manifest
from lightning_mlopt.checkpoint.remote.checkpoints import RemoteCheckpoints
from lightning_mlopt.checkpoint.remote.object_store import ObjectStore, store_url
from lightning_mlopt.checkpoint.remote.tiers import checkpoint_folder
from lightning_mlopt.checkpoint.settings import CHECKPOINT, configured
from lightning_mlopt.checkpoint.store import ROLLED_BACK_DIR, CheckpointStore
from lightning_mlopt.exceptions import CheckpointInvalidError, CheckpointWriteError, ObjectStoreError

UseCkptPath = Literal["warm_start", "always"]


@dataclass(frozen=True)
class WarmStart:
    """Whether ``fit`` loads the ``ckpt_path`` it was given, or auto-resume takes the run's own newest checkpoint.

    Args:
        given: the ``ckpt_path`` as given.
        own: this run's newest checkpoint as ``(step, where)`` (:func:`own_newest`); None: it has none.
        use: ``checkpoint.resume.ckpt_path``: ``warm_start`` (only without one of the run's own) or ``always``.

    Example::

        >>> WarmStart("runs/a/checkpoints", own=None).loads_given
        True
        >>> WarmStart("runs/b/checkpoints/step-000000010", own=(40, "..."), use="always").loads_given
        True

    """

    given: str
    own: tuple[int, str] | None
    use: UseCkptPath = "warm_start"

    def __post_init__(self) -> None:
        if self.use not in ("warm_start", "always"):  # jsonargparse checks the YAML; this, a script's value
            raise ValueError(f"resume.ckpt_path must be 'warm_start' or 'always', got {self.use!r}")

    @property
    def loads_given(self) -> bool:
        """Whether ``fit`` loads ``given`` (False: auto-resume takes the run's own newest checkpoint)."""
        return self.own is None or self.use == "always"

    def line(self) -> str:
        """The one line that says which checkpoint the launch starts from, and why (rank zero prints it)."""
        if self.own is None:
            return f"ckpt_path: this run has no checkpoint of its own yet: starting from {self.given} (its warm start)"
        step, where = self.own
        always = CHECKPOINT.setting("resume.ckpt_path", "always")
        if self.use == "always":
            return (
                f"ckpt_path: loading {self.given} ({always}), not this run's own step {step} ({where}); the run's "
                f"checkpoints newer than the one loaded move to {ROLLED_BACK_DIR}/"
            )
        if self.given == "last":  # names the run's own newest: no choice was made
            return f"ckpt_path: last: resuming from this run's own newest checkpoint, step {step} ({where})"
        return (
            f"ckpt_path: resuming from this run's own step {step} ({where}); {self.given} is the warm start of a "
            f"run with no checkpoint of its own; to load it instead, set {always}"
        )


def own_newest(checkpoint: Any, run_dir: Path) -> tuple[int, str] | None:
    """The run's newest checkpoint as every rank sees it before the Trainer: ``(step, where)``, or None.

    ``checkpoint``: the CLI's parsed ``checkpoint:`` section (``run_dir`` placeholders filled in).

    Raises:
        CheckpointWriteError: the object store of ``dirpath`` could not be listed (no rank can tell then).

    """
    dirpath = configured(checkpoint, "dirpath")
    local_tier = configured(checkpoint, "tiers.local_dirpath")
    found: list[tuple[int, str]] = []
    if local_tier is None:  # a node-local tier is no rank's to judge alone: the store says for every node
        local = _newest_intact(CheckpointStore(checkpoint_folder(dirpath, None, run_dir)))
        found += [local] if local is not None else []
    url = store_url(dirpath)
    if url is not None:
        try:
            remote = _newest_in_store(url)
        except ObjectStoreError as error:
            raise CheckpointWriteError(f"cannot tell whether this run has checkpoints of its own: {error}") from None
        found += [remote] if remote is not None else []
    return max(found, default=None)


def _newest_intact(store: CheckpointStore) -> tuple[int, str] | None:
    """The newest committed folder whose manifest parses and whose files have their recorded sizes."""
    for step, path in reversed(store.committed()):
        if _intact(path):
            return step, str(path)
    return None


def _intact(folder: Path) -> bool:
    """Sizes, not checksums: every rank runs this, and hashing a large checkpoint N times would cost N reads."""
    try:
        manifest = Manifest.from_json((folder / MANIFEST_NAME).read_bytes())
    except (OSError, CheckpointInvalidError):
        return False
    for name, entry in manifest.files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != entry.size:
            return False
    return True


def _newest_in_store(url: str) -> tuple[int, str] | None:
    """The newest commit in the store whose files are all there at their sizes (one listing per commit tried)."""
    remote = RemoteCheckpoints(ObjectStore.for_url(url))
    for step in reversed(remote.committed()):
        if remote.incomplete(step) is None:
            return step, f"{remote.url}/{CheckpointStore.name_for(step)}"
    return None
