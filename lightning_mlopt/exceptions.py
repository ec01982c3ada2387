"""Every exception type lightning_mlopt raises on purpose, in one place, and what each one means for the run.

The entry point maps them to exit statuses (``exit_codes.py``): bad input exits 2, an unwritable checkpoint 74.
Modules raise these; they never define their own.

Example::

    from lightning_mlopt.exceptions import BadInputError, StoppedTogether

    try:
        trainer.fit(model)
    except StoppedTogether as stop:  # every rank raised it at the same step boundary
        print(stop, stop.checkpoint_first)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class BadInputError(ValueError):
    """The user's configuration is wrong; the message says what and how to fix it (the CLI exits with 2).

    ``said_elsewhere``: every rank raised it from one agreed decision, and rank zero says it; this rank exits
    with the same status without printing it again.
    """

    said_elsewhere = False


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an error's message, at most ``limit`` characters: what a one-line report quotes.

    Example::

        >>> first_line(OSError("No space left on device"), limit=8)
        'No space'
    """
    return (str(error).strip().splitlines() or [""])[0][:limit]


@contextlib.contextmanager
def said_by_rank_zero(rank: int) -> Iterator[None]:
    """Within it, a :class:`BadInputError` every rank raises alike (the same file, the same check) is said once.

    Example::

        with said_by_rank_zero(trainer.global_rank):
            optimizer.load_state_dict(keyed_by_index(saved, live))
    """
    try:
        yield
    except BadInputError as error:
        error.said_elsewhere = error.said_elsewhere or rank != 0
        raise


class UntrustedCheckpointError(BadInputError):
    """A checkpoint names Python objects outside the allowlist; it was not loaded, nothing in it ran."""


class RunDirBusy(BadInputError):
    """Another live job holds the run directory; the message names it (host, pid, job, since) and what to do.

    A bad-input refusal (exit 2): nothing of the run was written, and the holder's files are untouched.
    """


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; earlier checkpoints are intact. The message names the path and cause."""


class ObjectStoreError(CheckpointWriteError):
    """An object store (S3 and its kin) refused or failed a request; the message names the URL and the cause.

    Never a credential: the cause is the service's error code, or what could not be reached.
    """


class ConcurrentWriterError(ObjectStoreError):
    """Another writer changed what this one relied on (``latest``, a commit): two runs share one prefix."""


class SupersededCopyError(ObjectStoreError):
    """A local checkpoint was committed again (the same step saved anew) while it was being copied up.

    Not a failure of the store: the copy of the older save is dropped, and the newer save is the one to copy.
    """


class MissingObjectError(ObjectStoreError):
    """No object has the key: a read of something that may legitimately be absent (``latest`` before any commit)."""


class CheckpointInvalidError(Exception):
    """A checkpoint failed verification; the message says which file and why."""


class StoppedTogether(RuntimeError):
    """Every rank raised this at the same step boundary, from values they all agreed on.

    So a callback's ``on_exception`` may run collectives for it, unlike for an arbitrary error that one rank
    raised alone. ``checkpoint_first``: the raiser asks for the current state to be saved before the run ends
    (FaultTolerantCheckpoint does it, on every rank, whatever its ``save_on.exception``, recording
    ``checkpoint_reason`` in the manifest).
    """

    checkpoint_reason = "stopped"
    #: The state at this point is not worth saving at all (a diverged replica): no save on the way out.
    unsafe_to_save = False

    def __init__(self, message: str, checkpoint_first: bool = False) -> None:
        super().__init__(message)
        self.checkpoint_first = checkpoint_first

    def add_detail(self, line: str) -> None:
        """Append a line to the message, e.g. what a handler did about it (``add_note`` needs Python 3.11)."""
        self.args = (f"{self.args[0]}\n{line}", *self.args[1:])


class NonFiniteGradientError(StoppedTogether):
    """Training stopped on a non-finite gradient or a spike; the message holds the diagnosis."""

    checkpoint_reason = "nonfinite"


class ReplicaMismatchError(StoppedTogether):
    """Data-parallel replicas stopped being bit-identical; the message names the tensors, ranks and step."""

    checkpoint_reason = "replica_mismatch"
    unsafe_to_save = True


class CollectivesDivergedError(StoppedTogether):
    """Ranks issued different collectives in a step; the message names the first one and each rank's call site."""

    checkpoint_reason = "collectives_diverged"
    unsafe_to_save = True  # the step's collectives paired up wrongly: its results are not to be trusted


class HealthCheckError(RuntimeError):
    """A pre-flight check failed; the message names the ranks and hosts concerned."""


class CompatError(RuntimeError):
    """A private name we depend on in Lightning, torch or DeepSpeed is gone or changed; the message names it."""
